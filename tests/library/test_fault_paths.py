"""Issue 13: the core's fault paths. Lost replies, stalls, lost pools, odd rows.

Each test reproduces one defect the issue describes; together with
tests/library/test_degraded_core.py (write-refusing errors) and the randomized
stress (tests/faults/test_fault_stress.py) they must catch any of them if it
comes back.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from coordinator import Coordinator, InstanceSpec, Settings
from coordinator.errors import CoordinationUnavailableError, InvalidArgumentError, PoolFullError
from coordinator.keys import ID_RE, POOL_NAME_RE
from coordinator.models import MAX_PREDICTED_MS
from coordinator.snapshot import PoolCache
from local_fleet.engine_model import EngineModel, EngineTiming
from tests.conftest import MakeCoordinator
from tests.helpers import (
    assert_counters_match_reservations,
    delete_pool,
    live_reservations,
    spec,
    wait_for,
)

pytestmark = pytest.mark.timeout(60)

FAST = {"redis_timeout_ms": 1000, "recovery_interval_ms": 20}

Call = Callable[..., Awaitable[Any]]


def intercept(
    c: Coordinator, hook: Callable[[str, Call, str, list[Any], Any], Awaitable[Any]]
) -> None:
    """Route every script call of `c` through `hook(name, real_call, ...)`."""
    real = c._direct_call

    async def call(name: str, args: list[Any], extra: Any = ()) -> Any:
        return await hook(name, real, name, args, extra)

    c._direct_call = call  # type: ignore[method-assign]


def lose_next_reply(c: Coordinator, script: str) -> None:
    """The next call of `script` runs in Redis, but its reply is lost on the way back."""
    fired = False

    async def hook(name: str, real: Call, *args: Any) -> Any:
        nonlocal fired
        reply = await real(*args)
        if name == script and not fired:
            fired = True
            raise RedisConnectionError("reply lost")
        return reply

    intercept(c, hook)


async def recovered(c: Coordinator) -> None:
    """Wait until the node has re-asserted its state and left degraded mode."""
    await wait_for(lambda: c.coordination == "ok", what=f"{c.node_id} to re-assert")


async def reserve_until(
    c: Coordinator, predicate: Callable[[Any], bool], *args: Any, tries: int = 20
) -> Any:
    """Reserve until a reservation satisfies `predicate`, releasing the others."""
    for _ in range(tries):
        res = await c.reserve(*args)
        if predicate(res):
            return res
        await c.release(res.rid)
    raise AssertionError("no reservation satisfied the predicate")


# ---------------------------------------------------------------------- 1. restore


async def test_restore_keeps_the_instance_redis_recorded(
    make_coordinator: MakeCoordinator,
) -> None:
    """A reserve's reply is lost, the degraded node picks another instance locally and
    the first token arrives before recovery: restore must advance the recorded one."""
    c = await make_coordinator("n1", settings=Settings(**FAST))
    for i in range(2):
        await c.register_instance(spec(i))
    lose_next_reply(c, "reserve")
    res = await c.reserve(150, 10)  # 150 tokens: prefill_ms 20
    assert res.degraded
    recorded = (await live_reservations(c))[res.rid]["instance"]
    assert recorded != res.instance_id, "precondition: the local pick differs from Redis'"
    assert await c.mark_first_token(res.rid)
    await recovered(c)
    await assert_counters_match_reservations(c)
    rec = (await live_reservations(c))[res.rid]
    assert (rec["instance"], rec["phase"]) == (recorded, "decode")
    assert c.local_reservations[res.rid].instance_id == recorded
    assert await c.release(res.rid)
    await assert_counters_match_reservations(c)
    assert not await live_reservations(c)


# ---------------------------------------------------------------------- 2. re-assert


async def test_reassert_renews_the_lease_while_it_runs(
    make_coordinator: MakeCoordinator,
) -> None:
    """Restoring takes longer than the lease (slow link): a peer must reap nothing."""
    lease = Settings(lease_ms=300, **FAST)
    a = await make_coordinator("node-a", settings=lease)
    peer = await make_coordinator("node-b", settings=lease)
    for i in range(2):
        await a.register_instance(spec(i))
    await a.renew_lease()
    await a.refresh()  # the rows a degraded node selects from
    down = True

    async def hook(name: str, real: Call, *args: Any) -> Any:
        if down:
            raise RedisConnectionError("redis is down")
        if name == "restore":
            await asyncio.sleep(0.015)  # a slow link: 40 restores take 2 leases
        return await real(*args)

    intercept(a, hook)
    held = [await a.reserve(100, 10) for _ in range(40)]
    assert all(r.degraded for r in held)
    stop = asyncio.Event()

    async def reaper() -> None:
        while not stop.is_set():
            await peer.reap_expired()
            await asyncio.sleep(0.02)

    task = asyncio.create_task(reaper())
    try:
        down = False
        await recovered(a)
    finally:
        stop.set()
        await task
    assert set(await live_reservations(a)) == {r.rid for r in held}
    await assert_counters_match_reservations(a)
    # The node dies now: within about one lease the peer reaps everything it held.
    await wait_for(
        lambda: _reap_and_count(peer), timeout_s=5, what="the dead node's reservations reaped"
    )
    await assert_counters_match_reservations(peer)


async def _reap_and_count(peer: Coordinator) -> bool:
    await peer.reap_expired()
    return not await live_reservations(peer)


# ---------------------------------------------------------------------- 3. stalls


async def _stall_until_reaped(a: Coordinator, peer: Coordinator) -> None:
    """`a` renews nothing (SIGSTOP) until its lease expires and `peer` reaps it."""
    await wait_for(
        lambda: _reap_and_count(peer), timeout_s=5, what=f"{a.node_id} reaped while stalled"
    )


async def test_a_node_reaped_while_stalled_reasserts_on_resume(
    make_coordinator: MakeCoordinator,
) -> None:
    lease = Settings(lease_ms=200, **FAST)
    a = await make_coordinator("node-a", settings=lease)
    peer = await make_coordinator("node-b", settings=lease)
    await a.register_instance(spec(0))
    await a.renew_lease()
    held = [await a.reserve(100, 10) for _ in range(3)]
    await a.mark_first_token(held[0].rid)
    await _stall_until_reaped(a, peer)
    # SIGCONT: the lease loop renews first. It must learn the lease had expired.
    await a.renew_lease()
    assert a.coordination == "degraded" and a.stats.lease_losses == 1
    await recovered(a)
    records = await live_reservations(a)
    assert set(records) == {r.rid for r in held}
    assert records[held[0].rid]["phase"] == "decode"
    await assert_counters_match_reservations(a)


async def test_a_resumed_node_writes_nothing_without_a_lease(
    make_coordinator: MakeCoordinator,
) -> None:
    """Resumed, it reserves before its next renewal, then dies: nothing may stay."""
    lease = Settings(lease_ms=200, **FAST)
    a = await make_coordinator("node-a", settings=lease)
    peer = await make_coordinator("node-b", settings=lease)
    await a.register_instance(spec(0))
    await a.renew_lease()
    await a.reserve(100, 10)
    await _stall_until_reaped(a, peer)
    late = await a.reserve(100, 10)
    stored = await live_reservations(a)
    leases = {str(n) for n in await a.redis.zrange(a.keys.column("nodes"), 0, -1)}
    assert late.rid not in stored or "node-a" in leases, "a reservation without a lease"
    await a.close()  # dies: renews nothing from now on
    await wait_for(
        lambda: _reap_and_count(peer), timeout_s=5, what="no reservation left without a lease"
    )
    await assert_counters_match_reservations(peer)


# ---------------------------------------------------------------------- 4. lost pool


async def test_a_lost_pool_is_rebuilt_like_after_an_outage(
    make_coordinator: MakeCoordinator,
) -> None:
    """FLUSHDB (here: the pool's keys deleted) without a dropped connection."""
    a = await make_coordinator("node-a", settings=Settings(**FAST))
    for i in range(2):
        await a.register_instance(spec(i))
    await a.renew_lease()
    held = [await a.reserve(100, 10) for _ in range(3)]
    await a.mark_first_token(held[0].rid)
    await delete_pool(a.redis, a.settings.key_prefix, a.pool)
    fourth = await a.reserve(100, 10)  # not a 503 no_instance: degraded, served
    assert fourth.degraded
    assert a.stats.pool_losses == 1
    await recovered(a)
    records = await live_reservations(a)
    assert set(records) == {r.rid for r in [*held, fourth]}
    assert {r.id for r in (await a.snapshot()).rows} == {"i0", "i1"}
    await assert_counters_match_reservations(a)


# ---------------------------------------------------------------------- 6. max_slots


async def test_full_instances_are_ranked_out_before_the_script(
    make_coordinator: MakeCoordinator,
) -> None:
    """Four 1-slot instances and one 100-slot one: no 429 while any slot is free."""
    c = await make_coordinator("n1", settings=Settings(enforce_max_slots=True, **FAST))
    for i in range(4):
        await c.register_instance(spec(i, max_slots=1))
    await c.register_instance(spec(4, max_slots=100))
    held = [await c.reserve(10, 10) for _ in range(104)]
    placed = [r.instance_id for r in held]
    assert placed.count("i4") == 100
    with pytest.raises(PoolFullError):
        await c.reserve(10, 10)
    await assert_counters_match_reservations(c)


# ---------------------------------------------------------------------- 8. clamping


async def test_long_decode_predictions_are_clamped(make_coordinator: MakeCoordinator) -> None:
    """5M tokens x 20 ms/token exceeds the scripts' one-day cap: clamp, never refuse."""
    c = await make_coordinator("n1", settings=Settings(**FAST))
    await c.register_instance(spec(0, decode_ms_per_token=20.0))
    res = await c.reserve(100, 5_000_000)
    assert res.decode_ms == MAX_PREDICTED_MS
    await assert_counters_match_reservations(c)


async def test_one_long_request_never_wedges_recovery(make_coordinator: MakeCoordinator) -> None:
    c = await make_coordinator("n1", settings=Settings(**FAST))
    await c.register_instance(spec(0, decode_ms_per_token=20.0))
    await c.renew_lease()
    await c.refresh()
    lose_next_reply(c, "read_state")
    with pytest.raises(CoordinationUnavailableError):
        await c.refresh()  # Redis "fails": the node degrades
    long = await c.reserve(100, 5_000_000)
    assert long.degraded
    await recovered(c)
    assert long.rid in await live_reservations(c)
    await assert_counters_match_reservations(c)


async def test_requests_arriving_during_reassert_do_not_keep_it_chasing(
    make_coordinator: MakeCoordinator,
) -> None:
    """Requests keep coming while a node re-asserts: here one per reservation it
    restores, faster than it restores them. Once its first pass is done, new ones
    wait for the last few restores and then go through Redis, instead of adding
    local reservations the loop would chase for as long as traffic lasts (an outside
    run saw a node stay degraded 10 s after Redis was back)."""
    c = await make_coordinator("n1", settings=Settings(**FAST))
    await c.register_instance(spec(0))
    await c.refresh()
    lose_next_reply(c, "read_state")
    with pytest.raises(CoordinationUnavailableError):
        await c.refresh()  # the node degrades
    first = [await c.reserve(100, 10) for _ in range(3)]
    assert all(r.degraded for r in first)
    arrivals: list[asyncio.Task[Any]] = []
    restores = 0

    async def hook(name: str, real: Call, *args: Any) -> Any:
        nonlocal restores
        if name == "restore" and c._reasserting:
            restores += 1
            if restores <= 50:  # without the wait: 50 arrivals, 50 more restores
                arrivals.append(asyncio.create_task(c.reserve(100, 10)))
        return await real(*args)

    intercept(c, hook)
    await recovered(c)
    made = await asyncio.gather(*arrivals)
    # The first pass restored 3 and let 3 arrive locally; the tail restored those 3,
    # and what arrived meanwhile waited and went through Redis.
    assert restores == 6
    assert [r.degraded for r in made] == [True] * 3 + [False] * 3
    await assert_counters_match_reservations(c)
    assert set(await live_reservations(c)) == {r.rid for r in [*first, *made]}


# ---------------------------------------------------------------------- 9. bad rows


@pytest.mark.parametrize("value", [1e300, 1.7e308, 60_001.0])
def test_timing_fields_are_validated_to_sane_ranges(value: float) -> None:
    for name in ("prefill_ms_per_token", "decode_ms_per_token"):
        with pytest.raises(InvalidArgumentError):
            spec(0, **{name: value})
    if value > MAX_PREDICTED_MS:
        with pytest.raises(InvalidArgumentError):
            spec(0, prefill_overhead_ms=value)


@pytest.mark.parametrize("value", [1e300, 1.7e308])
async def test_selection_survives_a_row_that_got_in(
    make_coordinator: MakeCoordinator, value: float
) -> None:
    """A spec written straight into Redis, past validation, breaks no decision."""
    c = await make_coordinator("n1", settings=Settings(**FAST))
    await c.register_instance(spec(0))
    bad = json.loads(spec(1).to_json())
    bad["prefill_ms_per_token"] = bad["decode_ms_per_token"] = value
    await c._direct_call("register", ["i1", json.dumps(bad), 0, 0])
    for _ in range(4):
        res = await c.reserve(100, 10)
        assert (res.instance_id, res.degraded) == ("i0", False)
    assert [r.id for r in (await c.snapshot()).rows] == ["i0"]
    await assert_counters_match_reservations(c)


async def test_unregister_invalidates_the_nodes_own_cache(
    make_coordinator: MakeCoordinator,
) -> None:
    c = await make_coordinator("n1", settings=Settings(snapshot_max_age_ms=60_000, **FAST))
    for i in range(2):
        await c.register_instance(spec(i))
    await c.reserve(10, 10)
    assert c._cache.age_ms() < 60_000
    await c.unregister_instance("i1")
    assert c._cache.age_ms() == float("inf"), "the next decision must re-read the pool"
    for _ in range(3):
        assert (await c.reserve(10, 10)).instance_id == "i0"


# ---------------------------------------------------------------------- 10. ids


@pytest.mark.parametrize("value", ["abc\n", "abc\r\n", "\nabc"])
def test_ids_with_a_newline_are_refused(value: str) -> None:
    assert ID_RE.fullmatch(value) is None and ID_RE.match(value) is None
    assert POOL_NAME_RE.match(value) is None
    with pytest.raises(InvalidArgumentError):
        InstanceSpec(id=value, url="http://127.0.0.1:1")


async def test_rid_with_a_newline_is_refused_before_redis(
    make_coordinator: MakeCoordinator,
) -> None:
    c = await make_coordinator("n1")
    await c.register_instance(spec(0))
    calls: list[str] = []

    async def hook(name: str, real: Call, *args: Any) -> Any:
        calls.append(name)
        return await real(*args)

    intercept(c, hook)
    for op in (c.release, c.mark_first_token):
        with pytest.raises(InvalidArgumentError):
            await op("abc\n")
    with pytest.raises(InvalidArgumentError):
        await c.reserve(10, 10, rid="abc\n")
    assert calls == []


# ---------------------------------------------------------------------- 11. re-chain


async def _redis_now(c: Coordinator) -> int:
    seconds, micros = await c.redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _engine_prefill_free_at(engine: EngineModel) -> float:
    """When the engine has finished every prefill it holds (none queued behind)."""
    end = engine.next_event_ms() or 0.0
    return end + sum(engine.timing.prefill_ms(s.prompt_tokens) for s in engine.waiting)


async def _rechain_against_the_engine(
    c: Coordinator, progress_ms: int, release_first: bool
) -> tuple[float, float]:
    """A 300 ms prefill runs and a 100 ms one waits; after `progress_ms` one of them is
    released. Returns (the cursor the scripts predict, the engine model's) from t0."""
    await c.register_instance(spec(0, prefill_ms_per_token=1.0, prefill_overhead_ms=0.0))
    first = await c.reserve(300, 10)
    queued = await c.reserve(100, 10)
    records = await live_reservations(c)
    t0 = records[first.rid]["created_ms"]
    await wait_for(lambda: _elapsed(c, t0, progress_ms), what="the first prefill to make progress")
    released = first if release_first else queued
    await c.release(released.rid)
    snap = await c.snapshot()
    predicted_free_at = snap.now_ms + (snap.by_id()["i0"].prefill_free_in_ms or 0)
    engine = EngineModel(EngineTiming(prefill_ms_per_token=1.0, prefill_overhead_ms=0.0))
    engine.submit(first.rid, 300, 10, 0.0)
    engine.submit(queued.rid, 100, 10, float(records[queued.rid]["created_ms"] - t0))
    engine.advance(float(snap.now_ms - t0))
    assert engine.cancel(released.rid)
    return predicted_free_at - t0, _engine_prefill_free_at(engine)


async def test_rechain_after_a_queued_release_keeps_the_progress_made(
    make_coordinator: MakeCoordinator,
) -> None:
    """A 300 ms prefill runs, a 100 ms one waits and is released: the cursor must say
    what the engine model says (the first prefill's remaining time), not now + 300."""
    c = await make_coordinator("n1")
    # Progress made, so the old and new formulas differ by >= 120 ms.
    predicted, engine = await _rechain_against_the_engine(c, 120, release_first=False)
    assert predicted == pytest.approx(engine, abs=1)
    await assert_counters_match_reservations(c)


async def test_rechain_after_releasing_the_prefill_in_progress(
    make_coordinator: MakeCoordinator,
) -> None:
    """The engine finishes a cancelled prefill anyway: the queue still waits for it."""
    c = await make_coordinator("n1")
    predicted, engine = await _rechain_against_the_engine(c, 50, release_first=True)
    assert predicted == pytest.approx(engine, abs=1)


async def _elapsed(c: Coordinator, t0: int, ms: int) -> bool:
    return await _redis_now(c) - t0 >= ms


# ---------------------------------------------------------------------- 12. clock


def test_the_cached_redis_time_resets_with_the_run() -> None:
    cache = PoolCache()
    cache.apply_view("run-a", 1, 2_000_000, "")
    assert cache.now_ms == 2_000_000
    cache.apply_view("run-b", 1, 1_000_000, "")  # a failover to a server running behind
    assert cache.now_ms == 1_000_000
    cache.apply_view("run-b", 1, 999_000, "")  # a late reply of the same run never rewinds
    assert cache.now_ms == 1_000_000


async def test_degraded_selection_knows_what_the_node_registered(
    make_coordinator: MakeCoordinator,
) -> None:
    """Found by the stress: a node whose cache was empty (a reply of another run, or
    none yet) degraded with nothing to choose from and refused every request."""
    c = await make_coordinator("n1", settings=Settings(**FAST))
    await c.register_instance(spec(0))  # registered, but never read back into the cache
    lose_next_reply(c, "read_state")
    res = await c.reserve(10, 10)
    assert res.degraded and res.instance_id == "i0"
    await recovered(c)
    await assert_counters_match_reservations(c)
