"""The node's view of a pool (flat cost): packed state per decision, specs on change,
bounded steps for long work, and starting over when Redis lost the pool."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest

from coordinator import Coordinator
from coordinator import coordinator as coordinator_module
from coordinator.coordinator import REAP_STEP, SWEEP_STEP
from coordinator.errors import CoordinationUnavailableError, InvalidArgumentError
from coordinator.models import Hint, RequestShape
from coordinator.packed import LIVE_BYTES, STATE_BYTES, LiveRecord, pack_live
from coordinator.settings import Settings
from coordinator.snapshot import PoolCache
from tests.conftest import MakeCoordinator
from tests.helpers import (
    assert_counters_match_reservations,
    counters,
    delete_pool,
    live_reservations,
    spec,
    wait_for,
)
from tests.library.test_fault_paths import Call, intercept

POOL_SIZE = 50


def count_calls(c: Coordinator) -> Counter[str]:
    """Count the scripts a node calls from now on, by name."""
    calls: Counter[str] = Counter()

    async def counted(name: str, real: Call, *args: Any) -> Any:
        calls[name] += 1
        return await real(*args)

    intercept(c, counted)
    return calls


async def assert_view_is_current(c: Coordinator, make_coordinator: MakeCoordinator) -> None:
    """The node's incrementally kept rows equal what a brand-new node reads."""
    fresh = await make_coordinator(f"fresh-{c.node_id}")
    await fresh.refresh(live=True)
    await c.refresh(live=True)
    assert c._cache.run_id == fresh._cache.run_id
    assert c._cache.spec_gen == fresh._cache.spec_gen
    assert c._cache.rows == fresh._cache.rows


async def notice_pool_lost(c: Coordinator) -> None:
    """A node's next read sees the new run: it re-asserts, then reads the pool afresh."""
    with pytest.raises(CoordinationUnavailableError):
        await c.refresh()
    assert c.coordination == "degraded"
    await wait_for(lambda: c.coordination == "ok", what="the re-assert after the pool was lost")


async def two_nodes(make_coordinator: MakeCoordinator) -> tuple[Coordinator, Coordinator]:
    """Node a reads the pool; node b registers POOL_SIZE instances first.

    a's view never ages into a re-read by itself (a slow run would otherwise refresh
    it before a decision, and the replies these tests count would differ): it is read
    when a test says so, or when a reply tells a it is behind."""
    a = await make_coordinator(
        "node-a",
        snapshot_max_age_ms=600_000,
        live_refresh_ms=600_000,
        instance_ttl_ms=2_400_000,
    )
    b = await make_coordinator("node-b")
    for i in range(POOL_SIZE):
        await b.register_instance(spec(i))
    return a, b


async def test_only_changed_records_rebuild_rows(make_coordinator: MakeCoordinator) -> None:
    a, b = await two_nodes(make_coordinator)
    await a.refresh(live=True)
    cache = a._cache
    assert len(cache.rows) == POOL_SIZE
    assert len(cache.state) == POOL_SIZE * STATE_BYTES
    assert len(cache.live) == POOL_SIZE * LIVE_BYTES
    built = cache.rows_applied
    await a.refresh(live=True)
    assert cache.rows_applied == built, "nothing changed, nothing rebuilt"

    held = [await b.reserve(100, 10) for _ in range(3)]
    await a.refresh(live=False)
    assert cache.rows_applied - built == len({r.instance_id for r in held})
    built = cache.rows_applied
    await b.heartbeat_instance("i7", {"engine_running": 2.5})
    await a.refresh(live=False)
    assert cache.rows_applied == built, "liveness is read only when asked or due"
    await a.refresh(live=True)
    assert cache.rows_applied - built == 1
    assert cache.rows["i7"].hints["engine_running"].value == 2.5
    for r in held:
        await b.release(r.rid)
    await assert_view_is_current(a, make_coordinator)


async def test_specs_are_read_only_when_they_change(make_coordinator: MakeCoordinator) -> None:
    a, b = await two_nodes(make_coordinator)
    await a.refresh()
    calls = count_calls(a)
    for _ in range(5):
        await a.release((await a.reserve(100, 10)).rid)
        await a.refresh()
    assert calls["read_specs"] == 0, calls
    await b.register_instance(spec(3, max_slots=7))
    await a.refresh()
    assert calls["read_specs"] == 1
    assert a._cache.rows["i3"].max_slots == 7
    await assert_view_is_current(a, make_coordinator)


async def test_a_reservation_reply_carries_its_own_change(
    make_coordinator: MakeCoordinator,
) -> None:
    a, b = await two_nodes(make_coordinator)
    await a.refresh()
    calls = count_calls(a)
    first = await b.reserve(100, 10)
    res = await a.reserve(100, 10, exclude=[first.instance_id])
    assert calls == {"reserve": 1}, "a fresh view needs no separate read"
    assert a._cache.rows[res.instance_id].inflight == 1, "its own claim shows at once"
    assert a._cache.rows[first.instance_id].inflight == 0, "a peer's: at the next whole read"
    await a.refresh()
    assert a._cache.rows[first.instance_id].inflight == 1


def spy_replies(c: Coordinator) -> list[tuple[str, Any]]:
    """Record every script reply a node gets from now on, with the script's name."""
    replies: list[tuple[str, Any]] = []

    async def spied(name: str, real: Call, *args: Any) -> Any:
        reply = await real(*args)
        replies.append((name, reply))
        return reply

    intercept(c, spied)
    return replies


async def assert_state_is_redis(c: Coordinator) -> None:
    """The node's packed state and its version are exactly what Redis holds."""
    state = await c.redis.get(c.keys.column("state"))
    ver = await c.redis.hget(c.keys.column("meta"), "state_ver")
    assert c._cache.state == state.encode("latin-1")
    assert c._cache.state_ver == int(ver)


async def test_a_current_view_gets_only_the_changed_records(
    make_coordinator: MakeCoordinator,
) -> None:
    a, b = await two_nodes(make_coordinator)
    await a.refresh()
    replies = spy_replies(a)
    for _ in range(3):
        res = await a.reserve(100, 10)
        await assert_state_is_redis(a)
        await a.mark_first_token(res.rid)
        await assert_state_is_redis(a)
        await a.release(res.rid)
        await assert_state_is_redis(a)
    views = [reply[-1] for name, reply in replies if name == "reserve"]
    assert [view[3] for view in views] == [None] * 3, "no whole state for a current view"
    assert all(len(reply) == 4 for name, reply in replies if name != "reserve")

    # Peers take every instance once: each of a's candidates is busier than a saw it,
    # but none is busier than the pool's mean, so a takes the least busy at once.
    taken = [await b.reserve(100, 10) for _ in range(POOL_SIZE)]
    assert {r.instance_id for r in taken} == set(a._cache.rows)
    taken.append(await a.reserve(100, 10))
    assert [reply[0] for name, reply in replies[-1:]] == ["ok"]
    # Then a second time the ten instances a may choose from: every candidate is
    # busier than a saw it and than the pool's mean, so the node decides again.
    allowed = sorted(a._cache.rows)[:10]
    others = set(a._cache.rows) - set(allowed)
    taken += [await b.reserve(100, 10, exclude=others) for _ in range(10)]
    inflight = (await counters(a))["inflight"]
    assert all(inflight[iid] >= 2 for iid in allowed)
    held = await a.reserve(100, 10, exclude=others)
    statuses = [(reply[0], reply[-1][3] is not None) for name, reply in replies[-2:]]
    assert statuses == [("stale", True), ("ok", False)], "the retry decides on the whole state"
    await assert_state_is_redis(a)
    for res in [*taken, held]:
        await b.release(res.rid)
    await assert_view_is_current(a, make_coordinator)


async def test_a_refusal_to_a_view_far_behind_brings_no_large_state(
    make_coordinator: MakeCoordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node whose view missed a change per instance sends its view token with '~'
    once its state is over LEAN_STATE_BYTES (0 here; 4 KB by default, where the test
    above gets the whole state): a refused reserve then brings no whole state (copying
    it through Lua costs more than the sampled retry it would serve), only how far
    behind the view is now."""
    monkeypatch.setattr("coordinator.coordinator.LEAN_STATE_BYTES", 0)
    a, b = await two_nodes(make_coordinator)
    await a.refresh()
    allowed = sorted(a._cache.rows)[:10]
    others = set(a._cache.rows) - set(allowed)
    # b puts 3 on each allowed instance, and 20 more elsewhere that it releases: 70
    # changes a has not seen; the mean stays below 1.
    taken = [await b.reserve(100, 10, exclude=others) for _ in range(3 * len(allowed))]
    passing = [await b.reserve(100, 10, exclude=allowed) for _ in range(20)]
    for res in passing:
        await b.release(res.rid)
    taken.append(await a.reserve(100, 10, exclude=allowed))  # its reply: how far behind
    assert a._cache.missed_changes >= POOL_SIZE
    replies = spy_replies(a)
    taken.append(await a.reserve(100, 10, exclude=others))
    refusals = [reply for name, reply in replies if name == "reserve" and reply[0] != "ok"]
    assert refusals and all(reply[0] == "stale" for reply in refusals)
    assert all(reply[-1][3] is None for reply in refusals), "no whole state"
    ver = int(await a.redis.hget(a.keys.column("meta"), "state_ver"))
    assert a._cache.seen_state_ver == ver
    for res in taken:
        await b.release(res.rid)


async def test_a_view_far_behind_ranks_a_random_sample(
    make_coordinator: MakeCoordinator,
) -> None:
    """Once replies show a node's view missed a change per instance, least_load ranks
    Settings.stale_sample random instances (each node's own draw), until the view is
    whole again."""
    a, b = await two_nodes(make_coordinator)
    await a.refresh(live=True)
    ranked: list[tuple[int, int]] = []  # (sample asked for, changes the view missed)
    real = a._columns_view.rank_least_load

    def spy(*args: Any, **kwargs: Any) -> Any:
        ranked.append((kwargs["sample"], a._cache.missed_changes))
        return real(*args, **kwargs)

    a._columns_view.rank_least_load = spy  # type: ignore[method-assign]
    sent = spy_replies(a)
    mine = [await a.reserve(100, 10)]
    assert ranked == [(0, 0)], "a current view ranks every instance"
    theirs = [await b.reserve(100, 10) for _ in range(POOL_SIZE)]
    mine.append(await a.reserve(100, 10))  # its reply tells a how far behind it is
    assert a._cache.missed_changes >= POOL_SIZE
    ranked.clear()
    mine.append(await a.reserve(100, 10))
    sample = a.settings.stale_sample
    assert ranked[0][0] == sample > 0
    assert all((s == sample) == (missed >= POOL_SIZE) for s, missed in ranked)
    await a.refresh()
    ranked.clear()
    mine.append(await a.reserve(100, 10))
    assert ranked == [(0, 0)], "a whole read makes the view current again"
    assert all(reply[0] == "ok" for name, reply in sent if name == "reserve")
    for res in mine:
        await a.release(res.rid)
    for res in theirs:
        await b.release(res.rid)


async def test_whole_reads_by_age_thin_out_in_a_large_fleet(
    make_coordinator: MakeCoordinator,
) -> None:
    """read_state counts the nodes holding a lease; beyond snapshot_nodes of them, a
    node lets its view age proportionally longer before reading it whole again."""
    a = await make_coordinator("node-a", snapshot_nodes=2)
    others = [await make_coordinator(f"node-{k}") for k in range(3)]
    await a.register_instance(spec(0))
    held = [await node.reserve(100, 10) for node in [a, *others]]  # each takes a lease
    assert a.snapshot_max_age_ms() == a.settings.snapshot_max_age_ms
    await a.refresh()
    assert a.snapshot_max_age_ms() == a.settings.snapshot_max_age_ms * 4 / 2
    for node, res in zip([a, *others], held, strict=True):
        await node.release(res.rid)


async def test_a_record_ahead_of_the_view_waits_for_the_one_before(
    make_coordinator: MakeCoordinator,
) -> None:
    a, b = await two_nodes(make_coordinator)
    first, second = await b.reserve(100, 10), await b.reserve(100, 10)
    await a.refresh()
    replies = spy_replies(b)
    await b.release(first.rid)
    await b.release(second.rid)
    (_, one), (_, two) = replies
    cache = a._cache
    ver, state = cache.state_ver, cache.state
    slot = int(two[2])
    cache.apply_patch(*two[1:])  # the later change first: held ahead of the view
    assert cache.state_ver == ver
    assert cache.state[slot * STATE_BYTES : (slot + 1) * STATE_BYTES] == two[3].encode()
    cache.apply_view(cache.run_id, cache.seen_spec_gen, cache.now_ms, state, None, ver)
    assert cache.state[slot * STATE_BYTES : (slot + 1) * STATE_BYTES] == two[3].encode(), (
        "a whole view older than a record held ahead keeps that record"
    )
    cache.apply_patch(*one[1:])
    assert cache.state_ver == ver + 2, "the record before it moves the view past both"
    await assert_state_is_redis(a)


async def test_unregistered_slot_is_reused_and_read_right(
    make_coordinator: MakeCoordinator,
) -> None:
    a, b = await two_nodes(make_coordinator)
    await a.refresh()
    slot = a._cache.entries["i5"].slot
    await b.unregister_instance("i5")
    await b.register_instance(spec("fresh", max_slots=3))
    await a.refresh()
    assert "i5" not in a._cache.rows
    assert a._cache.entries["fresh"].slot == slot
    held = await b.reserve(100, 10, exclude=[f"i{i}" for i in range(POOL_SIZE)])
    assert held.instance_id == "fresh"
    await a.refresh()
    assert a._cache.rows["fresh"].inflight == 1
    await assert_view_is_current(a, make_coordinator)


async def test_a_node_behind_the_kept_spec_log_reads_everything_in_steps(
    make_coordinator: MakeCoordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = await two_nodes(make_coordinator)
    await a.refresh()
    await b.unregister_instance("i1")
    for i in range(POOL_SIZE, POOL_SIZE + 5):
        await b.register_instance(spec(i))
    # The log kept only its newest entry (as after more than SPEC_LOG_MAX changes).
    await a.redis.zremrangebyrank(a.keys.column("spec_log"), 0, -2)
    monkeypatch.setattr(coordinator_module, "SPEC_READ_STEP", 7)
    calls = count_calls(a)
    await a.refresh()
    assert calls["read_specs"] >= (POOL_SIZE + 4) // 7, calls
    assert "i1" not in a._cache.rows and f"i{POOL_SIZE + 4}" in a._cache.rows
    await assert_view_is_current(a, make_coordinator)


async def test_unregister_voids_records_in_bounded_steps(make_coordinator: MakeCoordinator) -> None:
    a = await make_coordinator("node-a")
    await a.register_instance(spec(0))
    await a.register_instance(spec(1))
    held = [await a.reserve(10, 10, exclude=["i1"]) for _ in range(700)]
    assert {r.instance_id for r in held} == {"i0"}
    await a.unregister_instance("i0")
    left = await live_reservations(a)
    assert 0 < len(left) < 700, "one call deletes a bounded number of records"
    await assert_counters_match_reservations(a)  # the rest are queued, counted nowhere
    for _ in range(math.ceil(700 / SWEEP_STEP) - 1):
        assert await live_reservations(a) != {}
        await a.reap_expired()  # the lease loop's step: renew, reap, sweep one step
    assert await live_reservations(a) == {}
    assert await a.redis.scard(a.keys.column("voids")) == 0
    await assert_counters_match_reservations(a)


async def test_restart_voids_old_epoch_in_steps_while_new_counts_exactly(
    make_coordinator: MakeCoordinator,
) -> None:
    a = await make_coordinator("node-a")
    await a.register_instance(spec(0))
    for _ in range(600):
        await a.reserve(10, 10)
    await a.register_instance(spec(0, epoch=2))
    fresh = await a.reserve(10, 10)
    assert fresh.epoch == 2
    await assert_counters_match_reservations(a)
    assert (await a.snapshot()).by_id()["i0"].inflight == 1
    # The re-registration swept one step; each lease-loop round sweeps one more.
    for _ in range(math.ceil(600 / SWEEP_STEP) - 1):
        assert set(await live_reservations(a)) != {fresh.rid}
        await a.reap_expired()
    assert set(await live_reservations(a)) == {fresh.rid}
    await assert_counters_match_reservations(a)


async def test_a_dead_node_is_reaped_in_bounded_steps(make_coordinator: MakeCoordinator) -> None:
    dead = await make_coordinator("dead", lease_ms=60_000)
    await dead.register_instance(spec(0))
    for _ in range(1_100):
        await dead.reserve(10, 10)
    reaper = await make_coordinator("reaper")
    calls = count_calls(reaper)
    assert await reaper.reap_node("dead", force=True) == 1_100
    assert calls["reap_node"] == math.ceil(1_100 / REAP_STEP)
    assert await live_reservations(reaper) == {}
    await assert_counters_match_reservations(reaper)


async def test_reserve_rereads_before_reporting_no_instance(
    make_coordinator: MakeCoordinator,
) -> None:
    a = await make_coordinator("node-a", snapshot_max_age_ms=60_000)
    b = await make_coordinator("node-b")
    await a.refresh()  # node a has a fresh view of an empty pool
    await b.register_instance(spec(0))
    r = await a.reserve(10, 10)
    assert r.instance_id == "i0"


async def test_pool_lost_means_new_run_and_full_reread(
    make_coordinator: MakeCoordinator,
) -> None:
    a, b = await two_nodes(make_coordinator)
    await a.refresh()
    old_run = a._cache.run_id
    a.prefix.seen.note("i1#1", 500, 0.0)  # a prefix index count it saw
    # Redis restarts empty: the pool's keys vanish, then one node re-registers a few.
    await delete_pool(a.redis, a.settings.key_prefix, a.pool)
    for i in (1, 2, 60):
        await b.register_instance(spec(i))
    await notice_pool_lost(a)
    assert a._cache.run_id != old_run
    # The index's counts start again from 0: one seen before would void new entries.
    assert a.prefix.seen.fresh("i1#1", 10**6, 0.0) is None
    assert set(a._cache.rows) == {"i1", "i2", "i60"}
    await assert_view_is_current(a, make_coordinator)


async def test_pool_lost_with_nothing_back_empties_the_view(
    make_coordinator: MakeCoordinator,
) -> None:
    a, _ = await two_nodes(make_coordinator)
    await a.refresh()
    old_run = a._cache.run_id
    await delete_pool(a.redis, a.settings.key_prefix, a.pool)
    await notice_pool_lost(a)
    assert a._cache.run_id != old_run
    assert a._cache.rows == {}
    assert (await a.snapshot()).rows == []


async def test_a_reservation_goes_to_the_url_redis_has_now(
    make_coordinator: MakeCoordinator,
) -> None:
    """An engine restarted on another address: the next reservation carries the new URL."""
    a = await make_coordinator("node-a")
    b = await make_coordinator("node-b")
    await b.register_instance(spec(0, url="http://127.0.0.1:9000"))
    await a.release((await a.reserve(10, 10)).rid)  # a's view is fresh and knows the old URL
    await b.register_instance(spec(0, url="http://127.0.0.1:9999", epoch=2))
    res = await a.reserve(10, 10)
    assert (res.epoch, res.url) == (2, "http://127.0.0.1:9999")


async def test_a_node_whose_candidates_all_left_reserves_on_the_newcomer(
    make_coordinator: MakeCoordinator,
) -> None:
    # Found by the stateful invariant test: the 'none' reply says the specs moved on,
    # and the retry must rank the instances Redis has now, not the cached ones.
    a = await make_coordinator("node-a")
    b = await make_coordinator("node-b")
    await b.register_instance(spec("old"))
    first = await a.reserve(10, 10)
    await b.register_instance(spec("new"))
    await b.unregister_instance("old")
    res = await a.reserve(10, 10, rid=first.rid)
    assert res.instance_id == "new"
    await a.release(res.rid)
    await assert_counters_match_reservations(a)


async def test_a_view_follows_redis_back_to_an_older_state_ver(
    make_coordinator: MakeCoordinator,
) -> None:
    """A failover to a replica that lagged (or an AOF restart) keeps the run_id but
    takes `state_ver` back: a read issued after the view reached a version and
    answered with an older one is that older history, not a late reply."""
    a, b = await two_nodes(make_coordinator)
    await a.refresh()
    res = await a.reserve(100, 10)
    meta = a.keys.column("meta")
    # The replica promoted missed a's reservation's writes and a few before it.
    await a.redis.hincrby(meta, "state_ver", -5)
    await b.release(res.rid)  # a change after the failover: still below a's version
    await a.refresh()
    assert a._cache.rows[res.instance_id].inflight == 0
    await assert_view_is_current(a, make_coordinator)


def state_record(pending: int) -> bytes:
    """A `state` record with `pending` prefills (3 base-128 digits) and nothing else."""
    return bytes((0, pending >> 7, pending & 0x7F)) + bytes(STATE_BYTES - 3)


def test_a_patch_after_new_liveness_builds_the_new_liveness() -> None:
    """Patches reuse the decoded `live` record of their slot: a new `live` must drop it."""
    now = 1_000_000
    s = spec(0)
    cache = PoolCache()
    cache.apply_view("run", 0, now, state_record(0), pack_live(LiveRecord(now - 5)), 0)
    cache.apply_specs([s.id, s.to_json(), 1, 0, 0], full=True)
    cache.apply_patch(1, 0, state_record(1))
    assert cache.rows[s.id].last_seen_ms == now - 5
    assert cache.rows[s.id].pending_prefill == 1

    hints = {"queue_depth": Hint(3.0, now + 10)}
    cache.apply_view("run", 0, now + 10, None, pack_live(LiveRecord(now + 10, hints)), 1, -1)
    assert cache.rows[s.id].last_seen_ms == now + 10
    cache.apply_patch(2, 0, state_record(2))
    row = cache.rows[s.id]
    assert (row.last_seen_ms, row.hints, row.pending_prefill) == (now + 10, hints, 2)

    fresh = PoolCache()
    fresh.apply_view("run", 0, now + 10, cache.state, cache.live, 2)
    fresh.apply_specs([s.id, s.to_json(), 1, 0, 0], full=True)
    assert fresh.rows == cache.rows


async def test_a_view_is_scored_at_the_current_time_not_at_its_last_read(
    make_coordinator: MakeCoordinator,
) -> None:
    a, b = await two_nodes(make_coordinator)
    # Seconds of predicted prefill on every instance.
    held = [await b.reserve(20_000, 10) for _ in range(POOL_SIZE)]
    await a.refresh()
    request = RequestShape(10, 10, {})

    def least_backlog() -> tuple[float, float]:
        """The least predicted backlog in the snapshot, and among the ranked candidates."""
        rows = a._current_snapshot().rows
        scores = a._rank_for_reserve(None, frozenset(), request).scores
        return (
            min(float(row.predicted_total_backlog_ms or 0) for row in rows),
            min(float(score.components["backlog_ms"] or 0) for score in scores.values()),
        )

    before = least_backlog()
    assert min(before) > 1000
    # Half a second passes with no Redis call: every prefill is half a second nearer.
    a._cache.clock_mono -= 0.5
    after = least_backlog()
    assert all(b - c >= 500 for b, c in zip(before, after, strict=True)), (before, after)
    for res in held:
        await b.release(res.rid)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"stale_sample": 4}, "stale_sample must be 0 or in top_k"),
        ({"stale_sample": -1}, "stale_sample"),
        ({"snapshot_nodes": 0}, "snapshot_nodes must be a positive integer"),
    ],
)
def test_view_settings_are_checked(changes: dict[str, int], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        Settings(top_k=8, **changes)
    assert Settings(stale_sample=0).stale_sample == 0  # 0 turns sampling off
