"""Node leases and the reaper (DESIGN.md §5 "A node dies"), on both backends."""

from __future__ import annotations

import pytest

import coordinator.coordinator as coordinator_module
from coordinator import Coordinator, Settings
from tests.conftest import MakeCoordinator
from tests.helpers import (
    assert_counters_match_reservations,
    counters,
    live_reservations,
    spec,
    wait_for,
)

SHORT = Settings(lease_ms=300, redis_timeout_ms=1000)
LONG = Settings(lease_ms=60_000, redis_timeout_ms=1000)


async def lease_deadline(c: Coordinator, node_id: str) -> float | None:
    """The node's lease deadline in the pool's node set (Redis ms), None when absent."""
    score = await c.redis.zscore(c.keys.column("nodes"), node_id)
    return None if score is None else float(score)


async def hold(c: Coordinator, n: int, first_tokens: int = 1) -> list[str]:
    """Reserve n requests on node c, moving the first few to decode."""
    rids = [(await c.reserve(100, 20)).rid for _ in range(n)]
    for rid in rids[:first_tokens]:
        assert await c.mark_first_token(rid)
    return rids


async def test_dead_node_is_reaped_and_live_node_kept(make_coordinator: MakeCoordinator) -> None:
    a = await make_coordinator("node-a", settings=SHORT)
    b = await make_coordinator("node-b", settings=LONG)
    for i in range(3):
        await a.register_instance(spec(i))
    await a.renew_lease()
    await b.renew_lease()
    a_rids = await hold(a, 4, first_tokens=2)
    b_rids = await hold(b, 3, first_tokens=1)
    await assert_counters_match_reservations(b)

    # A stops renewing; B's reaper must notice once A's 300 ms lease lapses.
    async def a_gone() -> bool:
        await b.reap_expired()
        return not set(a_rids) & set(await live_reservations(b))

    await wait_for(a_gone, what="node-a's reservations to be reaped")
    assert b.stats.reaped == len(a_rids)
    records = await live_reservations(b)
    assert set(records) == set(b_rids)
    assert {rec["node"] for rec in records.values()} == {"node-b"}
    await assert_counters_match_reservations(b)
    stored = await counters(b)
    assert sum(stored["inflight"].values()) == 3
    assert sum(stored["active_decode"].values()) == 1
    assert await lease_deadline(b, "node-a") is None
    assert await b.redis.exists(b.keys.node_rids("node-a")) == 0
    assert await b.redis.scard(b.keys.node_rids("node-b")) == 3

    # A wakes up late: its release and first-token calls are no-ops, nothing moves.
    before = await counters(b)
    assert await a.mark_first_token(a_rids[-1]) is False
    for rid in a_rids:
        assert await a.release(rid) is False
    assert await counters(b) == before
    # Reaping again finds nothing; A can come back and work normally.
    assert await b.reap_expired() == 0
    assert b.stats.reaped == len(a_rids)
    await a.renew_lease()
    again = await a.reserve(10, 10)
    assert await a.release(again.rid) is True
    for rid in b_rids:
        assert await b.release(rid) is True
    await assert_counters_match_reservations(b)
    assert all(v == 0 for col in (await counters(b)).values() for v in col.values())


async def test_renewing_node_is_never_reaped(make_coordinator: MakeCoordinator) -> None:
    a = await make_coordinator("node-a", settings=Settings(lease_ms=500, redis_timeout_ms=1000))
    b = await make_coordinator("node-b", settings=LONG)
    await a.register_instance(spec(0))
    await a.register_instance(spec(1))
    await a.renew_lease()
    a_rids = await hold(a, 3)
    first = await lease_deadline(b, "node-a")
    assert first is not None

    # Keep going for more than two of A's lease periods (Redis time), A renewing each turn.
    async def two_leases_passed() -> bool:
        await a.renew_lease()
        assert await b.reap_expired() == 0
        assert await b.reap_node("node-a") == 0
        reply = await b._call("reap_node", ["node-a"], (b.keys.node_rids("node-a"),))
        assert [str(reply[0]), int(reply[1])] == ["alive", 0]
        deadline = await lease_deadline(b, "node-a")
        assert deadline is not None
        return deadline > first + 1000

    await wait_for(two_leases_passed, what="two lease periods of renewals")
    assert b.stats.reaped == 0
    assert set(await live_reservations(b)) == set(a_rids)
    await assert_counters_match_reservations(b)


async def test_expired_node_that_renews_before_the_reaper_is_kept(
    make_coordinator: MakeCoordinator,
) -> None:
    a = await make_coordinator("node-a", settings=SHORT)
    b = await make_coordinator("node-b", settings=LONG)
    await a.register_instance(spec(0))
    await a.renew_lease()
    a_rids = await hold(a, 2)

    async def a_listed_expired() -> bool:
        return "node-a" in await b.renew_lease()

    await wait_for(a_listed_expired, what="node-a's lease to lapse")
    await a.renew_lease()  # A comes back before anyone reaped it
    assert await b.reap_expired() == 0
    assert await b.reap_node("node-a") == 0
    assert set(await live_reservations(b)) == set(a_rids)
    await assert_counters_match_reservations(b)
    for rid in a_rids:
        assert await a.release(rid) is True


async def test_counters_return_to_zero_after_every_node_died(
    make_coordinator: MakeCoordinator,
) -> None:
    nodes = [await make_coordinator(f"node-{k}", settings=SHORT) for k in range(3)]
    for i in range(4):
        await nodes[0].register_instance(spec(i))
    total = 0
    for k, node in enumerate(nodes):
        await node.renew_lease()
        total += len(await hold(node, 2 + k))
    assert sum((await counters(nodes[0]))["inflight"].values()) == total
    # Every node dies; a node started later cleans up after one lease period.
    late = await make_coordinator("node-late", settings=LONG)

    async def all_zero() -> bool:
        await late.reap_expired()
        stored = await counters(late)
        return all(v == 0 for col in stored.values() for v in col.values())

    await wait_for(all_zero, what="every counter to return to 0")
    assert late.stats.reaped == total
    assert await live_reservations(late) == {}
    await assert_counters_match_reservations(late)
    members = await late.redis.zrange(late.keys.column("nodes"), 0, -1)
    assert members == ["node-late"]


async def test_background_loop_renews_and_reaps(make_coordinator: MakeCoordinator) -> None:
    c = await make_coordinator("node-bg", settings=SHORT)
    dead = await make_coordinator("node-dead", settings=SHORT)
    await c.register_instance(spec(0))
    await dead.renew_lease()
    dead_rids = await hold(dead, 3)
    seen: list[int] = []
    c.on_reaped = seen.append
    c.start_background()
    c.start_background()  # idempotent: still one loop

    async def first_renewal() -> bool:
        return await lease_deadline(c, "node-bg") is not None

    await wait_for(first_renewal, what="the first lease renewal")
    first = await lease_deadline(c, "node-bg")
    assert first is not None

    async def moved_forward() -> bool:
        now = await lease_deadline(c, "node-bg")
        return now is not None and now > first

    await wait_for(moved_forward, what="the lease deadline to move forward")

    # The loop counts what it reaped once the script's reply is back: wait for that,
    # not for the records (a read can see them gone before the loop has the reply).
    await wait_for(lambda: c.stats.reaped >= 3, what="the background reaper")
    assert c.stats.reaped == 3 and sum(seen) == 3
    assert not set(dead_rids) & set(await live_reservations(c))
    await assert_counters_match_reservations(c)
    # One lease loop and one learned-timing loop, however often it was started.
    assert [t.get_name() for t in c._tasks] == ["coordinator-lease", "coordinator-timing"]


async def test_two_processes_under_one_node_id_are_told_apart(
    make_coordinator: MakeCoordinator,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two live processes given the same node id (a copied compose service, say) each
    see the other's mark on the lease they share: both count it and say it, once per
    NODE_ID_CONFLICT_LOG_S however often they renew."""
    a = await make_coordinator("node-dup", settings=LONG)
    b = await make_coordinator("node-dup", settings=LONG)
    await a.renew_lease()
    await b.renew_lease()  # its first: a mark there may be a dead predecessor's
    assert (b.stats.node_id_conflicts, b.node_id_shared) == (0, False)
    for _ in range(3):
        await a.renew_lease()
        await b.renew_lease()
    assert (a.stats.node_id_conflicts, b.stats.node_id_conflicts) == (3, 3)
    assert a.node_id_shared and b.node_id_shared
    said = [r for r in caplog.records if "in use by another process" in r.getMessage()]
    assert [r.levelname for r in said] == ["ERROR", "ERROR"]
    monkeypatch.setattr(coordinator_module, "NODE_ID_CONFLICT_LOG_S", 0.0)
    await a.renew_lease()  # the interval passed: said again
    said = [r for r in caplog.records if "in use by another process" in r.getMessage()]
    assert len(said) == 3 and a.stats.node_id_conflicts == 4


async def test_a_restart_under_its_old_id_is_not_a_shared_id(
    make_coordinator: MakeCoordinator,
) -> None:
    """A process restarted under its predecessor's id (kill -9, then the same pod name)
    finds the predecessor's mark on its first renewal, and its own after that."""
    old = await make_coordinator("node-r", settings=LONG)
    await old.renew_lease()
    await old.renew_lease()
    new = await make_coordinator("node-r", settings=LONG)  # old renews no more
    for _ in range(3):
        await new.renew_lease()
    assert (old.stats.node_id_conflicts, new.stats.node_id_conflicts) == (0, 0)
    assert not new.node_id_shared
    owner = new.keys.node_owner("node-r")
    assert await new.redis.hget(owner, "incarnation") == new._incarnation
    assert 0 < await new.redis.pttl(owner) <= LONG.lease_ms


async def test_a_lease_that_lapsed_is_not_a_shared_id(make_coordinator: MakeCoordinator) -> None:
    """A node stalled past its lease finds no mark (it expired with the lease): a lost
    lease, which it re-asserts, not a second process."""
    c = await make_coordinator("node-s", settings=SHORT)
    await c.renew_lease()

    async def lapsed() -> bool:
        return not await c.redis.exists(c.keys.node_owner("node-s"))

    await wait_for(lapsed, what="the lease's mark to expire with it")
    await c.renew_lease()
    assert c.stats.node_id_conflicts == 0 and not c.node_id_shared


@pytest.mark.parametrize("lease_ms", [1, 86_400_000])
async def test_lease_bounds_are_accepted(make_coordinator: MakeCoordinator, lease_ms: int) -> None:
    c = await make_coordinator("node-x", settings=Settings(lease_ms=lease_ms))
    await c.renew_lease()
    deadline = await lease_deadline(c, "node-x")
    assert deadline is not None


async def test_retire_releases_what_is_left_and_drops_the_lease(
    make_coordinator: MakeCoordinator,
) -> None:
    c = await make_coordinator("leaving")
    await c.register_instance(spec(0))
    for _ in range(3):
        await c.reserve(10, 10)
    assert await c.redis.zscore(c.keys.column("nodes"), "leaving") is not None
    assert await c.retire() == 3
    assert await c.redis.zscore(c.keys.column("nodes"), "leaving") is None
    assert await live_reservations(c) == {}
    assert c.local_reservations == {}
    await assert_counters_match_reservations(c)
