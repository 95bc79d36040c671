"""Learned timing: the estimator, the order of sources, drift, epochs, and the merge script."""

from __future__ import annotations

import random

import pytest

from coordinator.models import InstanceSpec
from coordinator.timing import (
    DECODE,
    DEFAULT_DECODE_MS_PER_TOKEN,
    DEFAULT_PREFILL_MS_PER_TOKEN,
    PREFILL,
    Observations,
    TimingPolicy,
    add_sample,
    empty_record,
    expected_output,
    fit,
    flush_interval_ms,
    merge_record,
    own_ratio,
    pack,
    pool_prior,
    resolve_pool,
    screened,
    unpack,
)
from tests.conftest import MakeCoordinator
from tests.helpers import spec

HALF_LIFE, FLOOR = 10_000, 4.0


def bare(iid: str = "a", **timing: float) -> InstanceSpec:
    return InstanceSpec(id=iid, url="http://127.0.0.1:1", **timing)  # type: ignore[arg-type]


def prefill_record(per_token: float, overhead: float, n: int, epoch: int = 1) -> list[float]:
    record = empty_record(epoch, 2)
    rng = random.Random(n)
    for _ in range(n):
        tokens = rng.randint(50, 4000)
        add_sample(record, PREFILL, tokens, overhead + per_token * tokens)
        batch = rng.randint(1, 16)
        add_sample(record, DECODE, batch, 12.0 + 0.25 * batch)
    return record


def test_fit_recovers_the_line_and_keeps_it_non_negative() -> None:
    line = fit(prefill_record(0.8, 100.0, 50), PREFILL, 0.0)
    assert line is not None and line.samples == 50
    assert line.slope == pytest.approx(0.8) and line.intercept == pytest.approx(100.0)
    decode = fit(prefill_record(0.8, 100.0, 50), DECODE, 0.0)
    assert decode is not None
    assert (decode.intercept, decode.slope) == (pytest.approx(12.0), pytest.approx(0.25))
    flat = empty_record(1, 2)
    for _ in range(5):
        add_sample(flat, PREFILL, 1000, 500.0)  # one prompt size: slope from the prior
    same = fit(flat, PREFILL, 100.0)
    assert same is not None and same.at(1000) == pytest.approx(500.0)
    assert same.intercept == 100.0
    falling = empty_record(1, 2)
    add_sample(falling, PREFILL, 10, 100.0)
    add_sample(falling, PREFILL, 1000, 50.0)
    assert fit(falling, PREFILL, 0.0) == fit(falling, PREFILL, 0.0)
    line = fit(falling, PREFILL, 0.0)
    assert line is not None and line.slope == 0.0 and line.intercept == pytest.approx(75.0)
    assert fit(empty_record(1, 2), PREFILL, 0.0) is None


def test_outliers_are_dropped_and_movement_is_bounded() -> None:
    assert screened(250.0, None) == 250.0  # nothing learned yet: nothing to judge by
    assert screened(5_000.0, 100.0) is None  # a stall, 50x the prediction
    assert screened(1.0, 100.0) is None
    assert screened(500.0, 100.0) == 300.0  # clipped to 3x
    assert screened(20.0, 100.0) == pytest.approx(100.0 / 3)
    obs = Observations()
    assert obs.prefill("a", 1, 100, 5_000.0, 100.0) is False
    assert obs.rejected == 1 and obs.drain() == {}
    assert obs.prefill("a", 2, 100, 150.0, 100.0) is True
    assert obs.prefill("a", 1, 100, 150.0, 100.0) is False  # an older epoch's sample
    batch = obs.drain()["a"]
    assert batch[0] == 2 and batch[2] == 1


def test_merge_decays_by_half_life_and_stops_at_the_floor() -> None:
    batch = empty_record(1, 1)
    for _ in range(40):
        add_sample(batch, 0, 1.0, 10.0)
    first = merge_record(None, batch, 1_000, HALF_LIFE, FLOOR)
    assert first is not None and first[2:4] == [40, 40.0]
    later = merge_record(first, empty_record(1, 1), 11_000, HALF_LIFE, FLOOR)
    assert later is not None and later[3] == pytest.approx(20.0) and later[2] == 40
    idle = merge_record(later, empty_record(1, 1), 1_000_000, HALF_LIFE, FLOOR)
    assert idle is not None and idle[3] == pytest.approx(FLOOR)
    assert idle[5] / idle[3] == pytest.approx(10.0), "decay keeps the mean"
    assert merge_record(idle, empty_record(0, 1), 1_000_001, HALF_LIFE, FLOOR) is None
    restarted = merge_record(idle, empty_record(2, 1), 1_000_002, HALF_LIFE, FLOOR)
    assert restarted is not None and restarted[0] == 2 and restarted[2:] == [0.0] * 6


def test_sources_in_order_configured_learned_scaled_pool_default() -> None:
    policy = TimingPolicy(min_samples=8)
    configured = bare(prefill_ms_per_token=0.1, prefill_overhead_ms=5.0, decode_ms_per_token=9.0)
    few, many = prefill_record(0.8, 100.0, 5), prefill_record(0.8, 100.0, 40)
    spec_, src = policy.resolve(configured, 1, None, None)
    assert (src.prefill, src.decode, src.prefill_samples) == ("configured", "configured", 0)
    assert spec_.prefill_ms_per_token == 0.1
    spec_, src = policy.resolve(configured, 1, few, None)
    assert (src.prefill, src.decode, src.prefill_samples) == ("scaled", "scaled", 5)
    assert 0.1 < spec_.prefill_ms_per_token < 0.8  # type: ignore[operator]
    spec_, src = policy.resolve(configured, 1, many, None)
    assert (src.prefill, src.decode, src.decode_samples) == ("learned", "learned", 40)
    assert spec_.prefill_ms_per_token == pytest.approx(0.8)
    assert spec_.decode_ms_per_token == pytest.approx(12.0 + 0.25 * fit(many, DECODE, 0).mean_x)  # type: ignore[union-attr]
    assert src.decode_ms_per_seq == pytest.approx(0.25)
    for record in (few, many):
        pinned, src = TimingPolicy(pinned=True).resolve(configured, 1, record, None)
        assert (src.prefill, src.decode, pinned.prefill_ms_per_token) == ("configured",) * 2 + (
            0.1,
        )
    spec_, src = policy.resolve(bare(), 1, None, None)
    assert (src.prefill, src.decode) == ("default", "default")
    assert spec_.prefill_ms_per_token == DEFAULT_PREFILL_MS_PER_TOKEN
    assert spec_.decode_ms_per_token == DEFAULT_DECODE_MS_PER_TOKEN
    assert spec_.has_timing
    prior = pool_prior([bare(prefill_ms_per_token=1.0, decode_ms_per_token=10.0), spec_])
    assert prior is not None
    spec_, src = policy.resolve(bare(), 1, None, prior)
    assert (src.prefill, src.decode) == ("pool", "pool")
    assert spec_.prefill_ms_per_token == pytest.approx((1.0 + DEFAULT_PREFILL_MS_PER_TOKEN) / 2)
    spec_, src = policy.resolve(bare(), 1, few, prior)
    assert (src.prefill, src.decode) == ("scaled", "scaled")
    assert pool_prior([]) is None


def test_a_few_own_samples_scale_the_prior_to_the_instance_speed() -> None:
    """Issue 15's code-trace miss: a slow instance with fewer than min_samples samples
    was predicted with the pool's average (the fast instances' speed) and overloaded."""
    policy = TimingPolicy(min_samples=8, prior_weight=2.0)
    prior = bare(prefill_ms_per_token=0.06, prefill_overhead_ms=8.0, decode_ms_per_token=20.0)
    record = empty_record(1, 2)
    for tokens in (300, 1200, 2500, 4000, 700):  # 5 samples of an engine 2.5x slower
        add_sample(record, PREFILL, tokens, 2.5 * (8.0 + 0.06 * tokens))
        add_sample(record, DECODE, 4, 2.5 * 20.0)
    spec_, src = policy.resolve(bare(), 1, record, prior)
    assert (src.prefill, src.prefill_samples, src.decode) == ("scaled", 5, "scaled")
    ratio = (5 * 2.5 + 2.0) / (5 + 2.0)  # the observed ratio, shrunk by 2 pseudo-samples
    assert spec_.prefill_ms_per_token == pytest.approx(0.06 * ratio)
    assert spec_.prefill_overhead_ms == pytest.approx(8.0 * ratio)
    assert spec_.decode_ms_per_token == pytest.approx(20.0 * ratio)
    assert spec_.prefill_ms(2000) == pytest.approx(2.5 * (8.0 + 0.06 * 2000), rel=0.25)
    # A configured (shared, wrong) timing is scaled the same way; the same record
    # under a prior that is right does not move it.
    right = bare(prefill_ms_per_token=0.15, prefill_overhead_ms=20.0, decode_ms_per_token=50.0)
    spec_, src = policy.resolve(right, 1, record, None)
    assert src.prefill == "scaled"
    assert spec_.prefill_ms(2000) == pytest.approx(2.5 * (8.0 + 0.06 * 2000), rel=0.05)
    # One wild sample (a cold start, unscreened before learning) moves it at most 8-fold.
    stall = empty_record(1, 2)
    add_sample(stall, PREFILL, 1000, 1e9)
    spec_, _ = policy.resolve(bare(), 1, stall, prior)
    assert spec_.prefill_ms_per_token == pytest.approx(0.06 * 8.0)
    assert own_ratio(None, PREFILL, 8.0, 0.06, 2.0) is None
    assert own_ratio(empty_record(1, 2), PREFILL, 8.0, 0.06, 2.0) is None


def test_a_new_epoch_starts_over_from_the_pool_prior() -> None:
    policy = TimingPolicy()
    record = prefill_record(0.8, 100.0, 40, epoch=1)
    prior = bare(prefill_ms_per_token=0.3, prefill_overhead_ms=1.0, decode_ms_per_token=7.0)
    spec_, src = policy.resolve(bare(), 2, record, prior)
    assert (src.prefill, src.prefill_samples) == ("pool", 0)
    assert spec_.prefill_ms_per_token == 0.3


def test_drift_is_followed_within_30_seconds() -> None:
    """A fake clock: samples every 250 ms, then the engine gets twice as slow."""
    policy = TimingPolicy(half_life_ms=HALF_LIFE)
    rng = random.Random(7)
    record: list[float] | None = None
    now, per_token = 0, 0.8

    def run(seconds: float) -> None:
        nonlocal record, now
        end = now + seconds * 1000
        while now < end:
            obs = Observations()
            resolved, source = policy.resolve(bare(), 1, record, None)
            for _ in range(8):  # one 2-second flush of samples
                tokens = rng.randint(100, 4000)
                noise = rng.uniform(0.9, 1.1)
                # As Coordinator.observe: screened by the prediction once learned.
                predicted = resolved.prefill_ms(tokens) if source.prefill == "learned" else None
                obs.prefill("a", 1, tokens, (50 + per_token * tokens) * noise, predicted)
                if rng.random() < 0.05:  # a stall: far off, dropped once learned
                    obs.prefill("a", 1, tokens, 60_000.0, predicted)
            now += 2_000
            record = merge_record(record, obs.drain()["a"], now, HALF_LIFE, FLOOR) or record

    run(120)
    before, _ = policy.resolve(bare(), 1, record, None)
    assert before.prefill_ms_per_token == pytest.approx(0.8, rel=0.1)
    per_token = 1.6
    run(30)
    after, _ = policy.resolve(bare(), 1, record, None)
    assert after.prefill_ms_per_token == pytest.approx(1.6, rel=0.2)


def test_output_length_is_per_model_and_pool_wide() -> None:
    obs = Observations()
    for tokens in (100, 300):
        obs.output("m1", tokens)
    records = {name: merge_record(None, b, 1, HALF_LIFE, FLOOR) for name, b in obs.drain().items()}
    assert expected_output(records, "m1") == pytest.approx(200.0)  # type: ignore[arg-type]
    assert expected_output(records, "m2") is None  # type: ignore[arg-type]


def test_pack_round_trips_and_refuses_garbage() -> None:
    record = prefill_record(0.8, 100.0, 3)
    assert unpack(pack(record)) == record
    for bad in ("zz", "", pack([1.0, 2.0]), "c0", pack([1, 2, 3, 4, 5, 6, 7, float("nan")])):
        assert unpack(bad) is None


@pytest.mark.parametrize("backend", ["real"], indirect=True)  # fakeredis has no cmsgpack
async def test_merge_script_equals_the_python_merge(make_coordinator: MakeCoordinator) -> None:
    c = await make_coordinator("n1")
    await c.register_instance(spec(0))
    key = c.keys.timing()
    stored: dict[str, list[float] | None] = {}
    for round_ in range(4):
        epoch = 1 if round_ < 3 else 2
        batches = {"i0": prefill_record(0.8, 100.0, 5 + round_, epoch)}
        batches["|output|m"] = empty_record(0, 1)
        add_sample(batches["|output|m"], 0, 0.0, 120.0 + round_)
        args: list[object] = [HALF_LIFE, repr(FLOOR), 60_000, ""]
        for name, batch in batches.items():
            args += [name, pack(batch)]
        reply = await c._call("merge_timing", args, (key,))
        now = int(reply[0])
        flat = list(reply[1])
        got = {flat[k]: unpack(flat[k + 1]) for k in range(0, len(flat), 2)}
        for name, batch in batches.items():
            expected = merge_record(stored.get(name), batch, now, HALF_LIFE, FLOOR)
            stored[name] = expected if expected is not None else stored.get(name)
            assert got[name] == pytest.approx(stored[name], rel=1e-12)
    assert 0 < await c.redis.pttl(key) <= 60_000
    with pytest.raises(Exception, match="not a timing record"):
        await c._call("merge_timing", [HALF_LIFE, "4", 1000, "", "i0", "00"], (key,))


@pytest.mark.parametrize("backend", ["real"], indirect=True)  # fakeredis has no cmsgpack
async def test_merge_script_refuses_bad_hex_and_restarts_a_corrupt_record(
    make_coordinator: MakeCoordinator,
) -> None:
    """Hex is decoded through a lookup table: a pair that is not two lowercase hex
    digits must still be refused in a batch, and a stored record that is not valid hex
    must count as no record (the batch starts it again), exactly as the Python merge."""
    c = await make_coordinator("n1")
    await c.register_instance(spec(0))
    key = c.keys.timing()
    good = pack(prefill_record(0.8, 100.0, 5))
    assert good.startswith("9e01")  # a 14-item array, epoch 1 as one byte
    # "G1" is no hex pair, but its two characters are two msgpack integers: left in
    # place they shift the array into one that looks like a record.
    shifted = "9eG1" + good[4:]
    for bad in (good.upper(), "zz" + good[2:], good[:-1], "0g" + good[2:], shifted):
        with pytest.raises(Exception, match="not a timing record"):
            await c._call("merge_timing", [HALF_LIFE, repr(FLOOR), 60_000, "", "i0", bad], (key,))
    assert not await c.redis.exists(key)  # a refused call writes nothing
    for corrupt in (good.upper(), "x" * len(good), good[:-2], shifted):
        await c.redis.hset(key, "i0", corrupt)
        reply = await c._call(
            "merge_timing", [HALF_LIFE, repr(FLOOR), 60_000, "", "i0", good], (key,)
        )
        flat = list(reply[1])
        expected = merge_record(None, unpack(good), int(reply[0]), HALF_LIFE, FLOOR)
        assert unpack(flat[1]) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("backend", ["real"], indirect=True)
async def test_nodes_share_learned_timing_and_a_new_node_starts_warm(
    make_coordinator: MakeCoordinator,
) -> None:
    a = await make_coordinator("na")
    await a.register_instance(InstanceSpec(id="e1", url="http://127.0.0.1:9001"))
    await a.refresh()
    assert a._cache.rows["e1"].timing.prefill == "default"  # type: ignore[union-attr]
    for k in range(12):
        res = await a.reserve(200 + 300 * k, 10)
        assert res.prefill_alone and res.predicted_ttft_ms is not None
        a.observe(res, ttft_ms=100 + 0.8 * (200 + 300 * k), output_tokens=11, decode_ms=200.0)
        await a.release(res.rid)
    await a.sync_timing()
    row = a._cache.rows["e1"]
    assert row.timing is not None and row.timing.prefill == "learned"
    assert row.spec.prefill_ms_per_token == pytest.approx(0.8)
    assert row.spec.decode_ms_per_token == pytest.approx(20.0)
    assert a.expected_output_tokens(None) == 11
    assert a.expected_output_tokens(None, max_tokens=5) == 5
    b = await make_coordinator("nb")
    await b.refresh()
    await b.sync_timing()
    res = await b.reserve(1000, 10)
    assert res.prefill_ms == 900 and b._cache.rows["e1"].timing == row.timing


@pytest.mark.parametrize("backend", ["real"], indirect=True)  # fakeredis has no cmsgpack
async def test_a_pool_larger_than_one_step_is_read_in_bounded_calls(
    make_coordinator: MakeCoordinator,
) -> None:
    a = await make_coordinator("na")
    for start in range(0, 1_200, 400):
        args: list[object] = [HALF_LIFE, repr(FLOOR), 60_000, ""]
        for i in range(start, start + 400):
            args += [f"i{i}", pack(prefill_record(0.8, 100.0, 3))]
        await a._call("merge_timing", args, (a.keys.timing(),))
    b = await make_coordinator("nb")
    sizes: list[int] = []
    call = b._call

    async def counted(name: str, args: list[object], *rest: object) -> object:
        reply = await call(name, args, *rest)  # type: ignore[arg-type]
        if name == "merge_timing":
            sizes.append(len(reply[1]) // 2)
        return reply

    b._call = counted  # type: ignore[method-assign]
    await b.sync_timing()
    assert len(b._cache.learned) == 1_200  # every record, from pages of the hash
    assert len(sizes) >= 2 and max(sizes) < 1_200  # no call returned the whole pool


@pytest.mark.parametrize("backend", ["real"], indirect=True)  # fakeredis has no cmsgpack
async def test_only_a_registered_model_gets_its_own_output_length(
    make_coordinator: MakeCoordinator,
) -> None:
    c = await make_coordinator("n1")
    await c.register_instance(InstanceSpec(id="e1", url="http://127.0.0.1:9001", model="m"))
    await c.refresh()
    for model in ("m", "made-up-by-a-client"):
        res = await c.reserve(100, 10)
        c.observe(res, output_tokens=7, model=model)
        await c.release(res.rid)
    await c.sync_timing()
    fields = set(await c.redis.hkeys(c.keys.timing()))
    # A client's model name is not a key space: it teaches the pool-wide length only.
    assert {"|output|", "|output|m"} <= fields
    assert "|output|made-up-by-a-client" not in fields
    with pytest.raises(Exception, match="instance id or"):
        batch = pack(empty_record(0, 1))
        await c._call(
            "merge_timing", [HALF_LIFE, "4", 1000, "", "\x01bad", batch], (c.keys.timing(),)
        )


async def test_timing_resolved_aside_yields_to_a_spec_changed_meanwhile(
    make_coordinator: MakeCoordinator,
) -> None:
    """sync_timing resolves the pool's timing in a worker thread; an instance whose
    spec changed while it ran is resolved again on its new spec, not the stale one."""
    c = await make_coordinator("n1")
    for iid in ("e1", "e2"):
        await c.register_instance(InstanceSpec(id=iid, url="http://127.0.0.1:9001"))
    await c.refresh()
    records = {"e2": prefill_record(0.8, 100.0, 40)}
    cache = c._cache
    inputs = cache.timing_inputs()
    aside = (inputs, *resolve_pool(cache.timing_policy, inputs, records))
    configured = InstanceSpec(id="e1", url="http://127.0.0.1:9001", prefill_ms_per_token=2.5)
    await c.register_instance(configured)  # meanwhile
    await c.refresh()
    cache.apply_learned(records, aside)
    rows = cache.rows
    assert rows["e1"].timing is not None and rows["e1"].timing.prefill == "configured"
    assert rows["e1"].spec.prefill_ms_per_token == 2.5
    assert rows["e2"].timing is not None and rows["e2"].timing.prefill == "learned"
    assert rows["e2"].spec.prefill_ms_per_token == pytest.approx(0.8)


@pytest.mark.parametrize("backend", ["real"], indirect=True)  # fakeredis has no cmsgpack
async def test_a_big_fleet_merges_less_often(make_coordinator: MakeCoordinator) -> None:
    """Each merge counts the nodes holding a lease; beyond timing_flush_nodes a node
    stretches its interval in proportion, so the pool's merges per timing_flush_ms stay
    at timing_flush_nodes however many nodes it has."""
    made = [
        await make_coordinator(f"n{k}", timing_flush_ms=1_000, timing_flush_nodes=2)
        for k in range(5)
    ]
    await made[0].register_instance(spec(0))
    c = made[0]
    assert c.timing_flush_interval_ms() == 1_000  # no merge yet: only itself known
    for node in made[:2]:
        await node.renew_lease()
    await c.sync_timing()
    assert c.timing_flush_interval_ms() == 1_000  # 2 live nodes: at the bound
    for node in made[2:]:
        await node.renew_lease()
    await c.sync_timing()
    assert c.timing_flush_interval_ms() == 2_500  # 5 live nodes: 5 / 2 of the interval


def test_the_flush_interval_stretches_with_the_fleet_up_to_the_half_life() -> None:
    assert flush_interval_ms(2_000, 8, 10_000, 1) == 2_000
    assert flush_interval_ms(2_000, 8, 10_000, 8) == 2_000
    assert flush_interval_ms(2_000, 8, 10_000, 16) == 4_000
    assert flush_interval_ms(2_000, 8, 10_000, 64) == 10_000  # capped: samples stay fresh
    assert flush_interval_ms(20_000, 8, 10_000, 64) == 20_000  # never below the setting
