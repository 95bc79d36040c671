"""Reservation lifecycle against the real server and fakeredis (they must agree)."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator import (
    EpochFencedError,
    InvalidArgumentError,
    NoInstanceError,
    PoolFullError,
    ScriptArgumentError,
    UnknownInstanceError,
)
from coordinator.packed import (
    CANDIDATE_FIELDS,
    NO_SLOT,
    STARTED_WRAP,
    STATE_BYTES,
    _digits,
    pack_candidate,
)
from coordinator.settings import Weights
from tests.conftest import MakeCoordinator
from tests.helpers import (
    assert_counters_match_reservations,
    counters,
    live_reservations,
    packed_counters,
    register_stale_instance,
    spec,
    wait_for,
)


async def test_lifecycle_moves_counters_exactly(make_coordinator: MakeCoordinator) -> None:
    c = await make_coordinator("n1")
    for i in range(3):
        await c.register_instance(spec(i))
    res = [await c.reserve(100, 10) for _ in range(5)]
    assert sum((await counters(c))["inflight"].values()) == 5
    await assert_counters_match_reservations(c)
    assert await c.mark_first_token(res[0].rid) is True
    assert await c.mark_first_token(res[0].rid) is False
    stored = await counters(c)
    assert stored["active_decode"][res[0].instance_id] == 1
    await assert_counters_match_reservations(c)
    for r in res:
        assert await c.release(r.rid) is True
    before = await counters(c)
    assert await c.release(res[0].rid) is False
    assert await c.release("never-reserved") is False
    assert await counters(c) == before
    assert all(v == 0 for col in before.values() for v in col.values())


async def test_sequential_reserves_spread_over_idle_instances(
    make_coordinator: MakeCoordinator,
) -> None:
    c = await make_coordinator("n1")
    for i in range(4):
        await c.register_instance(spec(i))
    chosen = [(await c.reserve(100, 10)).instance_id for _ in range(8)]
    assert sorted(chosen) == sorted([f"i{i}" for i in range(4)] * 2)


async def test_predicted_ttft_chains_serialized_prefill(make_coordinator: MakeCoordinator) -> None:
    """Exact, in Redis time: every expectation comes from the times the scripts recorded.

    (It used to assume both reserves ran within 5 ms of each other; on a loaded machine
    fakeredis took longer, and 200 - elapsed fell below the bound.)
    """
    c = await make_coordinator("n1")
    await c.register_instance(spec(0, prefill_ms_per_token=1.0, prefill_overhead_ms=0.0))
    first = await c.reserve(100, 10)
    second = await c.reserve(100, 10)
    records = await live_reservations(c)
    one, two = records[first.rid], records[second.rid]
    assert first.predicted_ttft_ms == one["first_token_at_ms"] - one["created_ms"] == 100
    # The second prompt waits for the first one's 100 ms prefill, then takes its own.
    assert two["first_token_at_ms"] == one["first_token_at_ms"] + 100
    assert second.predicted_ttft_ms == two["first_token_at_ms"] - two["created_ms"]
    assert second.predicted_ttft_ms is not None and 100 < second.predicted_ttft_ms <= 200
    snap = await c.snapshot()
    row = snap.by_id()["i0"]
    assert row.pending_prefill_count == 2
    assert row.prefill_free_in_ms == max(0, two["first_token_at_ms"] - snap.now_ms)
    await c.mark_first_token(first.rid)
    first_token_at = (await live_reservations(c))[first.rid]["first_token_at_ms"]
    snap = await c.snapshot()
    row = snap.by_id()["i0"]
    # Re-chained: the first token's time + the remaining prefill work (one 100 ms prompt).
    assert row.prefill_free_in_ms == max(0, first_token_at + 100 - snap.now_ms)


async def test_duplicate_rid_is_idempotent(make_coordinator: MakeCoordinator) -> None:
    c = await make_coordinator("n1")
    await c.register_instance(spec(0))
    await c.register_instance(spec(1))
    a = await c.reserve(10, 10, rid="req-1")
    b = await c.reserve(10, 10, rid="req-1")
    assert a.instance_id == b.instance_id
    assert sum((await counters(c))["inflight"].values()) == 1


async def test_epoch_fencing_voids_old_reservations(make_coordinator: MakeCoordinator) -> None:
    c = await make_coordinator("n1")
    first = await c.register_instance(spec(0, epoch=5))
    assert first.epoch == 5
    r = await c.reserve(10, 10)
    await c.mark_first_token(r.rid)
    assert (await counters(c))["inflight"]["i0"] == 1
    restarted = await c.register_instance(spec(0, epoch=6))
    assert (restarted.status, restarted.voided_reservations) == ("restarted", 1)
    assert (await counters(c))["inflight"]["i0"] == 0
    assert await c.release(r.rid) is False
    assert (await counters(c))["active_decode"]["i0"] == 0
    with pytest.raises(EpochFencedError):
        await c.register_instance(spec(0, epoch=4))
    same = await c.register_instance(spec(0))
    assert (same.status, same.epoch) == ("updated", 6)
    await assert_counters_match_reservations(c)


async def test_unknown_instance_and_unregister(make_coordinator: MakeCoordinator) -> None:
    c = await make_coordinator("n1")
    with pytest.raises(UnknownInstanceError):
        await c.heartbeat_instance("ghost")
    with pytest.raises(UnknownInstanceError):
        await c.unregister_instance("ghost")
    await c.register_instance(spec(0))
    r = await c.reserve(10, 10)
    assert await c.unregister_instance("i0") == 1
    assert await c.release(r.rid) is False
    assert await c.list_instances(include_dead=True) == []
    with pytest.raises(NoInstanceError):
        await c.reserve(10, 10)


async def test_bad_input_writes_nothing(make_coordinator: MakeCoordinator) -> None:
    c = await make_coordinator("n1")
    await c.register_instance(spec(0))
    before = await c.redis.hgetall(c.keys.column("meta"))
    for bad in (-1, 1.5, "10", True, None):
        with pytest.raises(InvalidArgumentError):
            await c.reserve(bad, 10)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError):
            await c.reserve(10, bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        await c.heartbeat_instance("i0", {"engine_running": -1})
    with pytest.raises(InvalidArgumentError):
        await c.reserve(10, 10, rid="has space")
    # Straight to the script: Lua validates too, with a clear error and no write.
    with pytest.raises(ScriptArgumentError, match="prompt_tokens"):
        await c._call(
            "reserve",
            ["r1", "n1", "-5", "1", 0, 0, 1000, 0, "", 1, "i0", 1, 0, 0, 0, 0],
            (c.keys.node_rids("n1"),),
        )
    with pytest.raises(ScriptArgumentError):
        await c._call("heartbeat", ["i0", "nan", "", ""])
    with pytest.raises(ScriptArgumentError):
        await c._call("register", ["i{0}", "{}", 0, 0])
    assert await c.redis.hgetall(c.keys.column("meta")) == before
    assert await c.redis.hlen(c.keys.column("reservations")) == 0


async def test_pool_name_with_braces_is_rejected(make_coordinator: MakeCoordinator) -> None:
    c = await make_coordinator("n1")
    from coordinator import Coordinator

    with pytest.raises(InvalidArgumentError, match="pool"):
        Coordinator(c.redis, pool="bad{pool}")


async def test_noscript_after_script_flush(make_coordinator: MakeCoordinator) -> None:
    c = await make_coordinator("n1")
    await c.register_instance(spec(0))
    await c.redis.script_flush()
    r = await c.reserve(10, 10)
    await c.redis.script_flush()
    assert await c.release(r.rid) is True


async def test_max_slots_reject_policy(make_coordinator: MakeCoordinator) -> None:
    c = await make_coordinator("n1", enforce_max_slots=True)
    await c.register_instance(spec(0, max_slots=2))
    a = await c.reserve(10, 10)
    await c.reserve(10, 10)
    with pytest.raises(PoolFullError) as full:
        await c.reserve(10, 10)
    assert full.value.retry_after_ms >= 0
    await c.release(a.rid)
    assert (await c.reserve(10, 10)).instance_id == "i0"


async def test_max_slots_queue_policy_waits_for_a_slot(make_coordinator: MakeCoordinator) -> None:
    c = await make_coordinator(
        "n1", enforce_max_slots=True, full_policy="queue", queue_timeout_ms=5000
    )
    await c.register_instance(spec(0, max_slots=1))
    a = await c.reserve(10, 10)
    waiter = asyncio.create_task(c.reserve(10, 10))
    await wait_for(lambda: c.stats.queue_waiting == 1, what="the reserve to queue for a slot")
    assert not waiter.done()
    await c.release(a.rid)
    b = await asyncio.wait_for(waiter, 5)
    assert b.instance_id == "i0"


async def test_herding_four_nodes_burst_onto_sixteen(make_coordinator: MakeCoordinator) -> None:
    nodes = [await make_coordinator(f"n{k}") for k in range(4)]
    for i in range(16):
        await nodes[0].register_instance(spec(i))
    for node in nodes:
        await node.refresh()
    # Every node has the same (idle) view, then all 32 reserves race.
    results = await asyncio.gather(*(node.reserve(100, 10) for node in nodes for _ in range(8)))
    per_instance = (await counters(nodes[0]))["inflight"]
    assert sorted(per_instance.values()) == [2] * 16, per_instance
    assert len({r.rid for r in results}) == 32
    await assert_counters_match_reservations(nodes[0])


async def test_skewed_node_clock_changes_nothing(
    make_coordinator: MakeCoordinator, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    import time as time_module

    if backend == "fake":
        pytest.skip("fakeredis's TIME is this process's clock, so it cannot be skewed apart")
    c = await make_coordinator("n1")
    await c.register_instance(spec(0))
    real_time = time_module.time
    monkeypatch.setattr(time_module, "time", lambda: real_time() + 3600)
    r = await c.reserve(10, 10)
    snap = await c.snapshot()
    assert snap.by_id()["i0"].alive
    server_ms = int(float((await c.redis.time())[0]) * 1000)
    assert abs(snap.now_ms - server_ms) < 5_000
    assert await c.release(r.rid)


async def test_cached_tokens_rank_and_predict_only_the_uncached_prefill(
    make_coordinator: MakeCoordinator,
) -> None:
    """A request-aware ranking sends the request where its prefix is cached."""
    c = await make_coordinator("n1", weights=Weights(ttft_ms=1.0))
    for i in range(2):
        await c.register_instance(spec(i, prefill_ms_per_token=1.0, prefill_overhead_ms=0.0))
    res = await c.reserve(1000, 10, cached_tokens={"i1": 900})
    assert (res.instance_id, res.cached_tokens, res.prefill_ms) == ("i1", 900, 100)
    assert res.score is not None and res.score.components["ttft_ms"] == 100
    await c.release(res.rid)
    plain = await c.reserve(1000, 10)
    assert (plain.cached_tokens, plain.prefill_ms) == (0, 1000)
    assert plain.score is not None and plain.score.components["ttft_ms"] == 1000
    with pytest.raises(InvalidArgumentError):
        await c.reserve(10, 10, cached_tokens={"i0": -1})
    capped = await c.reserve(10, 10, cached_tokens={"i0": 50, "i1": 50})
    assert (capped.cached_tokens, capped.prefill_ms) == (10, 0)


async def test_a_score_read_later_is_the_one_the_decision_made(
    make_coordinator: MakeCoordinator,
) -> None:
    """A reservation's score is built when first read: from the rows as they were
    ranked, not as later reservations changed them."""
    c = await make_coordinator("n1")
    await c.register_instance(spec(0))
    first = await c.reserve(10, 10)
    later = [await c.reserve(10, 10) for _ in range(3)]
    assert first.score is not None and first.score.components["inflight"] == 0
    assert [r.score.components["inflight"] for r in later] == [1, 2, 3]
    assert first.score is first.score  # built once


def _reserve_args(
    node: str,
    rid: str,
    groups: list[tuple[str, int, int]],
    ties: int = 0,
    free_at: int = 0,
    slots: list[int] | None = None,
    slots_token: str = "",
) -> list[object]:
    """The reserve script's arguments (its header), enforcing max_slots, for candidates
    (id, max inflight, max pending_prefill) in rank order, the first `ties` tied, each
    with the bound `free_at` on its prefill's free-at (0: none) and its slot from
    `slots` (default: not known), read at `slots_token` ('<run_id>:<spec_gen>')."""
    args: list[object] = [
        rid, node, 10, 10, 0, 1, 600_000, 600_000, "", len(groups), ties, slots_token
    ]  # fmt: skip
    for k, (iid, max_inflight, max_pending) in enumerate(groups):
        slot = slots[k] if slots else NO_SLOT
        args += [iid, pack_candidate(slot, 5, 100, max_inflight, max_pending, free_at)]
    return args


async def test_reserve_walks_past_candidates_it_cannot_take(
    make_coordinator: MakeCoordinator,
) -> None:
    """Past the first candidate the script reads the rest in one step: an unknown id,
    a full instance and one busier than its bound are passed over in rank order, the
    first within bounds taken, unless one passed over for its counts beats it (fewer
    live reservations, a TTFT no longer: then the walk goes on); with every one over
    its bound, the least busy at or below the pool's mean."""
    c = await make_coordinator("n1", enforce_max_slots=True)
    for i in range(4):
        await c.register_instance(spec(i, max_slots=1 if i == 1 else 0))
    await c.refresh()
    rids = c.keys.node_rids("n1")
    for rid, iid in (("f1", "i1"), ("b2", "i2"), ("b3", "i3")):
        args = _reserve_args("n1", rid, [(iid, 99, 99)])
        assert (await c._direct_call("reserve", args, (rids,)))[:2] == ["ok", iid]
    walk = [("ghost", 99, 99), ("i1", 99, 99), ("i2", 0, 0), ("i3", 99, 99), ("i0", 99, 99)]
    reply = await c._direct_call("reserve", _reserve_args("n1", "w1", walk), (rids,))
    assert reply[:2] == ["ok", "i3"]  # 1 live, as many as i2 passed over
    # i3 now has 2 live; i2, passed over, has 1 and starts no later: i0 (0 live).
    reply = await c._direct_call("reserve", _reserve_args("n1", "w1b", walk[2:]), (rids,))
    assert reply[:2] == ["ok", "i0"]
    # Every one over its bound: the least busy, i2 (1 live), is at or below the mean
    # (5 live on 4 instances); one more there puts it above (2 > 6 / 4): stale.
    over = [("i3", 0, 0), ("i2", 0, 0)]
    reply = await c._direct_call("reserve", _reserve_args("n1", "w2", over), (rids,))
    assert reply[:2] == ["ok", "i2"]
    reply = await c._direct_call("reserve", _reserve_args("n1", "w2b", over), (rids,))
    assert reply[0] == "stale"
    reply = await c._direct_call("reserve", _reserve_args("n1", "w3", [("i1", 99, 99)]), (rids,))
    assert reply[0] == "full"
    reply = await c._direct_call(
        "reserve", _reserve_args("n1", "w4", [("ghost", 99, 99), ("i1", 99, 99)]), (rids,)
    )
    assert reply[0] == "full"
    reply = await c._direct_call("reserve", _reserve_args("n1", "w5", [("ghost", 9, 9)]), (rids,))
    assert reply[0] == "none"
    per_instance = (await counters(c))["inflight"]
    assert per_instance == {"i0": 1, "i1": 1, "i2": 2, "i3": 2}, per_instance
    await assert_counters_match_reservations(c)


@pytest.mark.parametrize("backend", ["real"])  # register_stale_instance needs a URL
async def test_a_dead_instance_passed_over_beats_no_candidate(
    make_coordinator: MakeCoordinator, redis_url: str, pool: str
) -> None:
    """A candidate passed over for its counts beats a later one within its bounds only
    while it is alive: i2 (2 live, then dead) does not keep the walk from i0 (3 live),
    which an alive i2 beats (placed first, its prefills end no later; and above the
    pool's mean, 5 on 3 instances, it is not taken either: stale)."""
    c = await make_coordinator("n1")
    for i in range(3):
        await c.register_instance(spec(i))
    rids = c.keys.node_rids("n1")
    for rid, iid in (("c1", "i2"), ("c2", "i2"), ("a1", "i0"), ("a2", "i0"), ("a3", "i0")):
        args = _reserve_args("n1", rid, [(iid, 99, 99)])
        assert (await c._direct_call("reserve", args, (rids,)))[:2] == ["ok", iid]
    walk = [("i2", 0, 0), ("i0", 9, 9)]

    async def reserve(rid: str) -> list[object]:
        args = _reserve_args("n1", rid, walk)
        args[6] = 10_000  # instance ttl: an instance silent for a minute is dead
        return list(await c._direct_call("reserve", args, (rids,)))

    assert (await reserve("w1"))[0] == "stale"
    await register_stale_instance(redis_url, pool, "i2")  # its engine went quiet
    assert (await reserve("w2"))[:2] == ["ok", "i0"]


async def test_a_reserve_sent_again_is_a_dup_whatever_its_candidates(
    make_coordinator: MakeCoordinator,
) -> None:
    """A reserve sent again under its rid (its reply was lost) answers where the first
    went, whether this call's candidates would take another instance (the record's
    HSETNX finds it) or none at all (full, busier than their bounds, unknown)."""
    c = await make_coordinator("n1", enforce_max_slots=True)
    for i in range(3):
        await c.register_instance(spec(i, max_slots=1 if i == 1 else 0))
    await c.refresh()
    rids = c.keys.node_rids("n1")
    first = await c._direct_call("reserve", _reserve_args("n1", "r1", [("i0", 99, 99)]), (rids,))
    assert first[:2] == ["ok", "i0"]
    filler = await c._direct_call("reserve", _reserve_args("n1", "f", [("i1", 99, 99)]), (rids,))
    assert filler[:2] == ["ok", "i1"]
    for groups in (
        [("i2", 99, 99)],  # would take i2
        [("i1", 99, 99)],  # full
        [("i0", 0, 0)],  # over its bound, and above the pool's mean
        [("ghost", 9, 9)],  # none alive
    ):
        reply = await c._direct_call("reserve", _reserve_args("n1", "r1", groups), (rids,))
        assert reply[:6] == ["dup", *first[1:6]], (groups, reply)
    assert (await counters(c))["inflight"] == {"i0": 1, "i1": 1, "i2": 0}
    await assert_counters_match_reservations(c)


async def test_records_without_a_slot_still_move_their_counters(
    make_coordinator: MakeCoordinator,
) -> None:
    """Records written before they kept their instance's slot (or with -1) look the
    slot up: first token and release move the right instance's counters."""
    c = await make_coordinator("n1")
    for i in range(3):
        await c.register_instance(spec(i))
    held = [await c.reserve(10, 10, rid=f"old-{k}") for k in range(3)]
    key = c.keys.column("reservations")
    for k, res in enumerate(held):
        record = json.loads(await c.redis.hget(key, res.rid))
        assert record["slot"] >= 0
        if k == 0:
            del record["slot"]
        else:
            record["slot"] = -1
        await c.redis.hset(key, res.rid, json.dumps(record))
    await c.mark_first_token(held[0].rid)
    await c.mark_first_token(held[1].rid)
    await assert_counters_match_reservations(c)
    for res in held:
        assert await c.release(res.rid) is True
    assert (await counters(c))["inflight"] == {"i0": 0, "i1": 0, "i2": 0}
    await assert_counters_match_reservations(c)


@pytest.mark.parametrize(("preset", "taken"), [("ttft", {"i1", "i2"}), ("seed", {"i0"})])
async def test_a_stale_view_does_not_queue_behind_a_prefill_it_missed(
    make_coordinator: MakeCoordinator, preset: str, taken: set[str]
) -> None:
    """A node whose view predates another node's long prefill on its best candidate
    (the fast i0, idle in the view, against i1 and i2 with one short prefill each)
    skips it when it ranks on predicted TTFT: the count bounds alone let i0 through
    (1 live, 1 prefilling: no more than the others), the prefill-free-at bound does
    not. The seed's weights rank on counts and keep the count bounds only. Neither
    costs a retry."""
    setup = await make_coordinator("n0")
    for i in range(3):
        await setup.register_instance(spec(i, prefill_ms_per_token=0.05 if i == 0 else 0.1))
    for iid in ("i1", "i2"):
        await setup.reserve(100, 10, exclude={"i0", "i1", "i2"} - {iid})
    late = await make_coordinator("n1", weights=Weights.preset(preset), snapshot_max_age_ms=600_000)
    await late.refresh()
    long = await setup.reserve(100_000, 10, exclude={"i1", "i2"})
    assert (long.instance_id, long.prefill_ms) == ("i0", 5005)
    res = await late.reserve(100, 10)
    assert res.instance_id in taken
    assert late.stats.reserve_retries == 0
    await assert_counters_match_reservations(late)


async def test_candidates_past_their_free_at_bound_yield_the_soonest_start(
    make_coordinator: MakeCoordinator,
) -> None:
    """Every candidate within its count bounds but busy past its free-at bound: the
    script takes the one that starts the prefill soonest (i1, 1 s queued, over i0's
    10 s), not the first, and costs no retry; within its free-at bound, the first."""
    c = await make_coordinator("n1")
    for i in range(2):
        await c.register_instance(spec(i))
    for iid, prompt in (("i0", 100_000), ("i1", 10_000)):
        await c.reserve(prompt, 10, exclude={"i0", "i1"} - {iid})
    rids = c.keys.node_rids("n1")
    both = [("i0", 99, 99), ("i1", 99, 99)]
    reply = await c._direct_call("reserve", _reserve_args("n1", "s1", both, free_at=1), (rids,))
    assert reply[:2] == ["ok", "i1"]
    never = 4398046511103  # the largest time a record holds
    reply = await c._direct_call("reserve", _reserve_args("n1", "s2", both, free_at=never), (rids,))
    assert reply[:2] == ["ok", "i0"]
    await assert_counters_match_reservations(c)


@pytest.mark.parametrize("slots_sent", [False, True])
async def test_tied_candidates_are_taken_in_the_pools_turn(
    make_coordinator: MakeCoordinator, slots_sent: bool
) -> None:
    """Two nodes sending a tied group take its instances in one turn round the pool
    (by slot, after meta tie_last), not each from its first: no two of four reserves
    share an instance, whatever order each node sends, and whether the script reads
    the slots or the node sends them (in each candidate's bounds). A refused call
    leaves the turn where it was."""
    nodes = [await make_coordinator(f"n{k}") for k in range(2)]
    for i in range(4):
        await nodes[0].register_instance(spec(i))
    tied = [(f"i{i}", 99, 99) for i in range(4)]
    # Each node sends the tie in an order of its own: here last slot first.
    slots = [3, 2, 1, 0] if slots_sent else None
    taken = []
    for k in range(4):
        node = nodes[k % 2]
        args = _reserve_args(node.node_id, f"t{k}", tied[::-1], ties=4, slots=slots)
        reply = await node._direct_call("reserve", args, (node.keys.node_rids(node.node_id),))
        assert reply[0] == "ok"
        taken.append(reply[1])
    assert taken == ["i0", "i1", "i2", "i3"]
    meta = nodes[0].keys.column("meta")
    assert await nodes[0].redis.hget(meta, "tie_last") in (b"3", "3")  # i3's slot
    # Every one over its bound and above the mean (4 on 4 after one more on i0): stale,
    # and the turn stays.
    one = nodes[0]
    rids = one.keys.node_rids(one.node_id)
    assert (await one._direct_call("reserve", _reserve_args("n0", "t4", [("i0", 9, 9)]), (rids,)))[
        0
    ] == "ok"
    over = [(f"i{i}", 0, 0) for i in range(4)]
    reply = await one._direct_call("reserve", _reserve_args("n0", "t5", over[:1], ties=0), (rids,))
    assert reply[0] == "stale"
    reply = await one._direct_call(
        "reserve", _reserve_args("n0", "t6", [over[0], over[0]], ties=2), (rids,)
    )
    assert reply[0] == "stale"
    assert await one.redis.hget(meta, "tie_last") in (b"3", "3")
    with pytest.raises(ScriptArgumentError):
        await one._direct_call("reserve", _reserve_args("n0", "t7", tied, ties=5), (rids,))
    for bounds in (b"\x00" * 22, b"\x00" * 22 + b"\x80", b"\x7f" * 23):
        # Short; a byte that is no base-128 digit; a prefill past MAX_PREDICTED_MS.
        bad = _reserve_args("n0", "t8", tied)
        bad[13] = bounds
        with pytest.raises(ScriptArgumentError):
            await one._direct_call("reserve", bad, (rids,))
    await assert_counters_match_reservations(one)


async def test_sent_tie_slots_order_the_walk_and_the_turn_takes_redis_slot(
    make_coordinator: MakeCoordinator,
) -> None:
    """The slots a node sends order its tie (a stale view changes only whose turn it
    is); the turn then moves to the slot Redis holds for the instance taken."""
    c = await make_coordinator("n0")
    for i in range(3):
        await c.register_instance(spec(i))  # slots 0, 1, 2
    # As a stale view would have them (at no spec_gen reserve trusts).
    args = _reserve_args("n0", "t0", [(f"i{i}", 99, 99) for i in range(3)], 3, slots=[2, 1, 0])
    reply = await c._direct_call("reserve", args, (c.keys.node_rids("n0"),))
    assert reply[:2] == ["ok", "i2"]  # the lowest slot sent, after no turn yet
    assert await c.redis.hget(c.keys.column("meta"), "tie_last") in (b"2", "2")
    await assert_counters_match_reservations(c)


def test_candidate_bounds_pack_as_base_128_digits() -> None:
    assert pack_candidate(1, 128, 2, 3, 4, 5) == (
        b"\x00\x00\x01" + b"\x00\x00\x01\x00" + b"\x00\x00\x00\x02" + b"\x00\x00\x03"
        + b"\x00\x00\x04" + b"\x00" * 5 + b"\x05"
    )  # fmt: skip
    # A slot not known or too large for 3 digits; counts past 3 digits saturate.
    for slot in (-1, NO_SLOT, 128**3):
        assert pack_candidate(slot, 0, 0, 0, 0, 0)[:3] == b"\x7f\x7f\x7f"
    assert pack_candidate(0, 0, 0, 128**3, 0, 0)[11:14] == b"\x7f\x7f\x7f"


@given(
    st.integers(-2, 2 * NO_SLOT),
    st.lists(st.integers(-(2**70), 2**70) | st.integers(0, 300), min_size=5, max_size=5),
)
def test_candidate_bounds_are_each_field_in_its_digits(slot: int, values: list[int]) -> None:
    """The shift-and-mask packing equals the plain one: each field saturated to its
    width and written digit by digit (what lua/reserve.lua reads back)."""
    fields = [slot if 0 <= slot < NO_SLOT else NO_SLOT, *values]
    plain = b"".join(_digits(v, w) for v, w in zip(fields, CANDIDATE_FIELDS, strict=True))
    assert pack_candidate(slot, *values) == plain


@pytest.mark.parametrize("backend", ["real"])  # counts the real server's own commands
async def test_reserve_trusts_sent_slots_only_at_the_pools_run_and_spec_gen(
    make_coordinator: MakeCoordinator,
) -> None:
    """At the pool's run and spec_gen the slots a node sends are the instances' own:
    the script looks up no slot (two HGETs: the candidate's max_slots, enforced here,
    and the chosen one's epoch). At an older
    spec_gen or another run, even a wrong slot sent costs only a lookup: the
    reservation counts on the instance's own record."""
    c = await make_coordinator("n0")
    for i in range(3):
        await c.register_instance(spec(i))  # slots 0, 1, 2
    meta = await c.redis.hmget(c.keys.column("meta"), ["run_id", "spec_gen"])
    run, gen = (v.decode() if isinstance(v, bytes) else v for v in meta)
    rids = c.keys.node_rids("n0")

    async def hgets() -> int:
        stats = await c.redis.info("commandstats")
        return int(stats.get("cmdstat_hget", {}).get("calls", 0))

    for k, (token, sent, lookups) in enumerate(
        ((f"{run}:{gen}", 0, 0), (f"{run}:{int(gen) - 1}", 2, 1), (f"other:{gen}", 2, 1))
    ):
        before = await hgets()
        args = _reserve_args("n0", f"r{k}", [("i0", 99, 99)], slots=[sent], slots_token=token)
        assert (await c._direct_call("reserve", args, (rids,)))[:2] == ["ok", "i0"]
        assert await hgets() - before == 2 + lookups
    inflight = (await counters(c))["inflight"]
    assert (inflight["i0"], inflight["i1"], inflight["i2"]) == (3, 0, 0)
    await assert_counters_match_reservations(c)


@pytest.mark.parametrize("backend", ["real"])  # counts the real server's own commands
async def test_a_walk_past_the_first_candidate_reads_the_others_records_at_once(
    make_coordinator: MakeCoordinator,
) -> None:
    """A view many changes behind sends candidates that all got busier: reserve reads
    the first one's records, then the others' in one GETRANGE of `state` (their slots
    lie close together), not one command each, and still takes the least busy of
    them."""
    a = await make_coordinator("node-a", snapshot_max_age_ms=600_000, live_refresh_ms=600_000)
    b = await make_coordinator("node-b")
    for i in range(12):
        await b.register_instance(spec(i))
    await a.refresh(live=True)  # every instance idle, as a will rank them
    theirs = [await b.reserve(100, 10) for _ in range(12)]  # one on each
    assert {r.instance_id for r in theirs} == {f"i{i}" for i in range(12)}

    async def getranges() -> int:
        stats = await a.redis.info("commandstats")
        return int(stats.get("cmdstat_getrange", {}).get("calls", 0))

    before = await getranges()
    mine = await a.reserve(100, 10)
    # The first one's `state` and `live` records, then the others' `state` at once;
    # none of them is less busy, so none needs its liveness read.
    assert await getranges() - before == 3
    inflight = (await counters(a))["inflight"]
    assert inflight[mine.instance_id] == 2 and sorted(inflight.values()) == [1] * 11 + [2]
    await a.release(mine.rid)
    for res in theirs:
        await b.release(res.rid)
    await assert_counters_match_reservations(a)


async def test_started_counts_the_reservations_placed_on_a_slot(
    make_coordinator: MakeCoordinator,
) -> None:
    """`started` (coordinator/packed.py) grows by one per reservation placed, whatever
    happens to it after; a reserve sent again under its rid places nothing; a freed
    slot starts again at 0; the count wraps at STARTED_WRAP. Nodes read it in their
    view (the hot-spot guard's fleet-wide counts)."""
    c = await make_coordinator("n1")
    for i in range(2):
        await c.register_instance(spec(i))
    placed = [await c.reserve(100, 1, exclude=["i1"]) for _ in range(3)]
    await c.mark_first_token(placed[0].rid)
    await c.release(placed[1].rid)
    again = await c.reserve(100, 1, rid=placed[2].rid, exclude=["i1"])
    assert again.instance_id == "i0"
    await c.reserve(100, 1, exclude=["i0"])
    await c.flush_carried()
    assert (await packed_counters(c))["started"] == {"i0": 3, "i1": 1}
    await c.refresh()
    assert {iid: row.started for iid, row in c._cache.rows.items()} == {"i0": 3, "i1": 1}
    await c.unregister_instance("i0")
    await c.register_instance(spec(2))  # takes i0's freed slot
    assert (await packed_counters(c))["started"] == {"i1": 1, "i2": 0}
    slot = int(await c.redis.hget(c.keys.column("slot"), "i1"))
    end = (slot + 1) * STATE_BYTES
    await c.redis.setrange(c.keys.column("state"), end - 3, bytes((127, 127, 127)))
    assert (await packed_counters(c))["started"]["i1"] == STARTED_WRAP - 1
    await c.reserve(100, 1, exclude=["i2"])
    assert (await packed_counters(c))["started"]["i1"] == 0
