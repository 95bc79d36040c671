"""The incremental snapshot (DESIGN.md §4 cost target): deltas, tombstones, ordering, resets."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator import Coordinator
from coordinator.errors import CoordinationUnavailableError
from coordinator.snapshot import PoolCache
from tests.conftest import MakeCoordinator
from tests.helpers import delete_pool, spec, wait_for

POOL_SIZE = 50


async def raw_snapshot(c: Coordinator, since: int = 0, run_id: str = "") -> list[Any]:
    """The snapshot script's reply as it comes off the wire."""
    reply: list[Any] = await c._call("snapshot", [since, run_id])
    return reply


async def full_read(c: Coordinator) -> PoolCache:
    """A cache built from one full read, to compare incremental caches against."""
    cache = PoolCache()
    cache.apply(await raw_snapshot(c))
    return cache


async def assert_cache_is_current(c: Coordinator) -> None:
    """The node's incrementally kept rows equal a fresh full read, row for row."""
    fresh = await full_read(c)
    assert c._cache.run_id == fresh.run_id
    assert c._cache.version == fresh.version
    assert c._cache.rows == fresh.rows


async def notice_pool_lost(c: Coordinator) -> None:
    """A node's next read sees the new run: it re-asserts, then reads the pool afresh."""
    with pytest.raises(CoordinationUnavailableError):
        await c.refresh()
    assert c.coordination == "degraded"
    await wait_for(lambda: c.coordination == "ok", what="the re-assert after the pool was lost")


async def two_nodes(make_coordinator: MakeCoordinator) -> tuple[Coordinator, Coordinator]:
    """Node a reads the pool; node b registers POOL_SIZE instances first."""
    a = await make_coordinator("node-a")
    b = await make_coordinator("node-b")
    for i in range(POOL_SIZE):
        await b.register_instance(spec(i))
    return a, b


async def test_refresh_applies_only_changed_rows(make_coordinator: MakeCoordinator) -> None:
    a, b = await two_nodes(make_coordinator)
    await a.refresh()
    cache = a._cache
    assert len(cache.rows) == POOL_SIZE
    assert cache.rows_applied == POOL_SIZE  # the first read is full
    await assert_cache_is_current(a)

    applied = cache.rows_applied
    await a.refresh()  # nothing changed: nothing decoded
    assert cache.rows_applied == applied

    await b.heartbeat_instance("i7", {"engine_running": 3.0})
    r = await b.reserve(100, 10)
    await b.mark_first_token(r.rid)
    changed = {"i7", r.instance_id}
    await a.refresh()
    # Several changes to the same instance still ship as one row.
    assert cache.rows_applied - applied == len(changed)
    assert cache.rows["i7"].hints["engine_running"].value == 3.0
    assert cache.rows[r.instance_id].active_decode == 1
    await assert_cache_is_current(a)

    # A node's own reserve piggybacks just the row it touched.
    applied = cache.rows_applied
    mine = await a.reserve(100, 10)
    assert cache.rows_applied - applied == 1
    assert cache.rows[mine.instance_id].inflight == 1 + (mine.instance_id == r.instance_id)
    await assert_cache_is_current(a)
    await b.release(r.rid)
    await a.release(mine.rid)
    applied = cache.rows_applied
    await a.refresh()
    assert cache.rows_applied == applied  # the release replies already carried every change
    await assert_cache_is_current(a)


async def test_unregistered_instances_leave_by_tombstone(make_coordinator: MakeCoordinator) -> None:
    a, b = await two_nodes(make_coordinator)
    await a.refresh()
    cache = a._cache
    applied = cache.rows_applied
    await b.unregister_instance("i3")
    await b.unregister_instance("i40")
    await a.refresh()
    assert cache.rows_applied - applied == 2
    assert "i3" not in cache.rows and "i40" not in cache.rows
    assert len(cache.rows) == POOL_SIZE - 2
    assert {row.id for row in await a.list_instances(include_dead=True)} == {
        f"i{i}" for i in range(POOL_SIZE)
    } - {"i3", "i40"}
    await assert_cache_is_current(a)

    # The id comes back later with a version above its tombstone, so it is not dropped.
    await b.register_instance(spec(3))
    await a.refresh()
    assert "i3" in cache.rows
    await assert_cache_is_current(a)
    # A full read never ships tombstones.
    fresh = await raw_snapshot(a)
    assert int(fresh[3]) == 1
    assert len(fresh[4]) == POOL_SIZE - 1
    assert all(row[1] is not None for row in fresh[4])


async def test_out_of_order_replies_never_regress_a_row(make_coordinator: MakeCoordinator) -> None:
    a, b = await two_nodes(make_coordinator)
    await a.refresh()
    since, run_id = a._cache.since()
    first = await b.reserve(100, 10)
    iid = first.instance_id
    older = await raw_snapshot(a, since, run_id)  # delta: iid with 1 reservation
    older_full = await raw_snapshot(a)
    second = await b.reserve(100, 10, strategy="round_robin")
    await b.mark_first_token(second.rid)
    await b.heartbeat_instance(iid, {"queue_depth": 2.0})
    await b.reserve(100, 10)
    newer = await raw_snapshot(a, since, run_id)

    cache = a._cache
    cache.apply(newer)
    expected = {rid: row for rid, row in cache.rows.items()}
    version = cache.version
    cache.apply(older)  # arrives late: must change nothing
    cache.apply(older_full)
    assert cache.rows == expected
    assert cache.version == version
    await assert_cache_is_current(a)

    # The same holds for a cache that first sees a full read, then stale deltas.
    other = PoolCache()
    other.apply(await raw_snapshot(a))
    other.apply(older)
    assert other.rows == (await full_read(a)).rows


async def test_late_reply_does_not_resurrect_an_unregistered_instance(
    make_coordinator: MakeCoordinator,
) -> None:
    a, b = await two_nodes(make_coordinator)
    await a.refresh()
    since, run_id = a._cache.since()
    await b.heartbeat_instance("i5")
    older = await raw_snapshot(a, since, run_id)  # carries the live row of i5
    await b.unregister_instance("i5")
    newer = await raw_snapshot(a, since, run_id)  # carries i5's tombstone
    cache = a._cache
    cache.apply(newer)
    assert "i5" not in cache.rows
    cache.apply(older)
    assert "i5" not in cache.rows, "an older reply brought an unregistered instance back"


async def test_reserve_rereads_before_reporting_no_instance(
    make_coordinator: MakeCoordinator,
) -> None:
    # The default snapshot_max_age_ms (25 ms) has the same flaw, only in a narrower window.
    a = await make_coordinator("node-a", snapshot_max_age_ms=60_000)
    b = await make_coordinator("node-b")
    await a.refresh()  # node a has a fresh view of an empty pool
    await b.register_instance(spec(0))
    r = await a.reserve(10, 10)
    assert r.instance_id == "i0"


async def test_pool_lost_means_new_run_and_full_reread(make_coordinator: MakeCoordinator) -> None:
    a, b = await two_nodes(make_coordinator)
    await a.refresh()
    cache = a._cache
    old_run, old_version = cache.run_id, cache.version
    assert old_run and old_version >= POOL_SIZE

    # Redis restarts empty: the pool's keys vanish, then one node re-registers a few.
    await delete_pool(a.redis, a.settings.key_prefix, a.pool)
    for i in (1, 2, 60):
        await b.register_instance(spec(i))
    applied = cache.rows_applied
    reply = await raw_snapshot(a, *cache.since())
    assert int(reply[3]) == 1, "a changed run must answer with a full read"
    await notice_pool_lost(a)
    assert cache.run_id != old_run
    assert set(cache.rows) == {"i1", "i2", "i60"}
    assert cache.rows_applied - applied == 3
    assert cache.version < old_version
    await assert_cache_is_current(a)

    # And the new run is incremental again from there.
    applied = cache.rows_applied
    await b.heartbeat_instance("i2")
    await a.refresh()
    assert cache.rows_applied - applied == 1
    await assert_cache_is_current(a)


async def test_pool_lost_with_nothing_back_empties_the_cache(
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
