"""The pool audit (lua/renew_lease.lua): a key lost or edited outside the scripts.

Every script keeps the pool's keys consistent with each other; a key evicted under a
maxmemory-policy other than noeviction, or deleted or edited by hand, breaks that,
and the counters then carry the damage for good (a lost `reservations` hash left each
instance counting its requests after they ended). The audit, one bounded step in a
lease renewal at most once per `audit_interval_ms` for the whole fleet, finds such a
pool and deletes its keys, as a FLUSHDB would: every node then re-asserts what it
registered and holds, the recovery tests/library/test_fault_paths.py covers.
"""

from __future__ import annotations

from typing import Any

import pytest

from coordinator import Coordinator, Settings
from coordinator.coordinator import AUDIT_STEP
from coordinator.packed import STATE_BYTES, as_text
from tests.conftest import MakeCoordinator
from tests.helpers import (
    assert_counters_match_reservations,
    live_reservations,
    spec,
    wait_for,
)
from tests.library.test_fault_paths import FAST, recovered

pytestmark = pytest.mark.timeout(60)

AUDITING = Settings(audit_interval_ms=60_000, **FAST)
VOIDED = 260  # reservations on a restarted instance: more than one sweep step


async def audit(c: Coordinator) -> None:
    """Renew c's lease with an audit step due (meta's audit_at, when the fleet's next
    step may run, is no relation the audit checks)."""
    await c.redis.hdel(c.keys.column("meta"), "audit_at")
    await c.reap_expired()


async def slot_of(c: Coordinator, instance_id: str) -> int:
    return int(await c.redis.hget(c.keys.column("slot"), instance_id))


async def lose(c: Coordinator, damage: str) -> None:
    """Break the pool as eviction or a hand edit would."""
    column = c.keys.column
    if damage.startswith("DEL "):
        assert await c.redis.delete(column(damage.removeprefix("DEL "))) == 1
    elif damage == "HDEL spec i1":
        assert await c.redis.hdel(column("spec"), "i1") == 1
    elif damage == "HINCRBY meta inflight_total 5":
        await c.redis.hincrby(column("meta"), "inflight_total", 5)
    elif damage == "zero i0's counters":
        at = await slot_of(c, "i0") * STATE_BYTES
        await c.redis.setrange(column("state"), at, "\0" * 6)  # pending, decode
    else:
        raise AssertionError(damage)


@pytest.mark.parametrize(
    "damage",
    [
        "DEL reservations",
        "DEL by_instance",
        "DEL state",
        "DEL meta",
        "DEL slot",
        "DEL free_slots",
        "HDEL spec i1",
        "zero i0's counters",
        "HINCRBY meta inflight_total 5",
    ],
)
async def test_a_lost_or_edited_key_is_rebuilt_from_the_nodes(
    make_coordinator: MakeCoordinator, damage: str
) -> None:
    a = await make_coordinator("node-a", settings=AUDITING)
    b = await make_coordinator("node-b", settings=AUDITING)
    for i in range(4):
        await a.register_instance(spec(i))
    await a.unregister_instance("i2")  # its slot stays free
    await audit(a)
    await audit(b)
    held_a = [await a.reserve(100, 10) for _ in range(4)]
    held_b = [await b.reserve(100, 10) for _ in range(3)]
    await a.mark_first_token(held_a[0].rid)
    await b.release(held_b[2].rid)
    assert {r.instance_id for r in held_a} >= {"i0"}
    await audit(a)  # consistent: nothing found
    assert a.stats.audit_resets == 0

    await lose(a, damage)
    await audit(a)
    assert a.stats.audit_resets == 1
    assert a.coordination == "degraded"
    assert a.stats.lease_losses == 0, "the reset, not a stall, took the lease"
    await recovered(a)
    extra = await b.reserve(100, 10)  # meets the new run_id: b re-asserts too
    await recovered(b)
    records = await live_reservations(a)
    assert set(records) == {r.rid for r in [*held_a, *held_b[:2], extra]}
    assert records[held_a[0].rid]["phase"] == "decode"
    assert {r.id for r in (await a.snapshot()).rows} == {"i0", "i1", "i3"}
    await assert_counters_match_reservations(a)
    await audit(a)
    await audit(b)
    assert a.stats.audit_resets + b.stats.audit_resets == 1, "consistent again"
    for r in [*held_a, *held_b[:2], extra]:
        await (a if r in held_a else b).release(r.rid)
    await assert_counters_match_reservations(a)
    assert await live_reservations(a) == {}


async def test_the_pool_as_the_scripts_leave_it_is_never_reset(
    make_coordinator: MakeCoordinator,
) -> None:
    """Every kind of write between audit steps: none is taken for damage."""
    a = await make_coordinator("node-a", settings=AUDITING)
    dead = await make_coordinator("node-dead", settings=AUDITING.with_(lease_ms=200))
    steps: list[Any] = []

    async def audited() -> None:
        await audit(a)
        assert a.stats.audit_resets == 0, steps[-1]
        assert a.stats.orphans_released == 0, steps[-1]

    for i in range(4):
        steps.append(f"register i{i}")
        await a.register_instance(spec(i))
        await audited()
    held = []
    for n in range(12):
        steps.append(f"reserve {n}")
        held.append(await a.reserve(100 * (n + 1), 10 + n))
        await audited()
    await dead.renew_lease()
    doomed = [await dead.reserve(100, 10) for _ in range(3)]
    for r in held[:4]:
        steps.append(f"first token {r.rid}")
        await a.mark_first_token(r.rid)
        await audited()
    for r in held[4:7]:
        steps.append(f"release {r.rid}")
        await a.release(r.rid)
        await audited()
    steps.append("restart i0 (a higher epoch voids its reservations)")
    await a.register_instance(spec(0, epoch=10**9))
    await audited()
    steps.append("unregister i1")
    await a.unregister_instance("i1")
    await audited()
    steps.append("a dead node reaped")
    await dead.close()

    async def dead_reaped() -> bool:
        await audited()
        return not set(r.rid for r in doomed) & set(await live_reservations(a))

    await wait_for(dead_reaped, what="the dead node's reservations to be reaped")
    steps.append("register i1 again")
    await a.register_instance(spec(1))
    await audited()
    await assert_counters_match_reservations(a)


async def test_the_counters_of_a_big_pool_are_checked_a_step_at_a_time(
    make_coordinator: MakeCoordinator,
) -> None:
    """AUDIT_STEP instances a step (resumed from meta's audit_cursor): one instance's
    damaged counters are found within two passes over the pool."""
    a = await make_coordinator("node-a", settings=AUDITING)
    n = 2 * AUDIT_STEP + 20
    for i in range(n):
        await a.register_instance(spec(i))
    await audit(a)
    cursor, offset = await a.redis.hmget(a.keys.column("meta"), "audit_cursor", "audit_offset")
    assert (int(cursor or 0), int(offset or 0)) != (0, 0), "one step checked a part of the pool"
    res = await a.reserve(100, 10)
    at = await slot_of(a, res.instance_id) * STATE_BYTES
    await a.redis.setrange(a.keys.column("state"), at, "\0" * 6)
    steps = 0
    while a.stats.audit_resets == 0:
        steps += 1
        assert steps <= 2 * (n // AUDIT_STEP + 1), "not found within two passes"
        await audit(a)
    await recovered(a)
    assert set(await live_reservations(a)) == {res.rid}
    await assert_counters_match_reservations(a)


async def test_the_fleet_audits_at_most_once_per_interval(
    make_coordinator: MakeCoordinator,
) -> None:
    slow = Settings(audit_interval_ms=600_000, **FAST)
    a = await make_coordinator("node-a", settings=slow)
    b = await make_coordinator("node-b", settings=slow)
    await a.register_instance(spec(0))
    await a.reserve(100, 10)
    await a.reap_expired()  # the pool's first step: consistent; the next in 10 minutes
    await lose(a, "DEL reservations")
    await a.reap_expired()
    await b.reap_expired()
    assert a.stats.audit_resets + b.stats.audit_resets == 0
    assert a.coordination == b.coordination == "ok"


async def test_counters_lost_while_requests_ran_are_found_after_they_ended(
    make_coordinator: MakeCoordinator,
) -> None:
    """`state` lost with requests in flight, which then end: every counter reads 0
    and nothing is indexed, but the pool's total still counts them."""
    a = await make_coordinator("node-a", settings=AUDITING)
    for i in range(2):
        await a.register_instance(spec(i))
    held = [await a.reserve(100, 10) for _ in range(5)]
    await audit(a)
    await lose(a, "DEL state")
    for r in held:
        await a.release(r.rid)
    assert await live_reservations(a) == {}
    await audit(a)
    assert a.stats.audit_resets == 1
    await recovered(a)
    assert await a.redis.hget(a.keys.column("meta"), "inflight_total") in (None, b"0", "0")
    await assert_counters_match_reservations(a)


async def test_records_past_the_end_of_state_read_as_zeros(
    make_coordinator: MakeCoordinator,
) -> None:
    """`state` cut short (evicted, then one slot written again; here by hand): the
    records past its end read as zeros in every script, as a slot not written yet
    does, never as an error (the reserve script failed on them when it read several
    candidates' records at once, and the proxy answered 500)."""
    stale = {"snapshot_max_age_ms": 600_000, "live_refresh_ms": 600_000}
    a = await make_coordinator("node-a", settings=AUDITING.with_(**stale))
    b = await make_coordinator("node-b", settings=AUDITING)
    ids = [f"i{i}" for i in range(6)]
    for i in range(6):
        await a.register_instance(spec(i))
    await a.refresh()  # a's view: all idle, and it stays so
    busy = await slot_of(a, "i0")
    held = [await b.reserve(100, 10, exclude=[x for x in ids if x != "i0"]) for _ in range(4)]
    key = a.keys.column("state")
    first = busy * STATE_BYTES
    kept = await a.redis.getrange(key, first, first + STATE_BYTES - 1)  # i0's record
    await a.redis.set(key, ("\0" if isinstance(kept, str) else b"\0") * first + kept)
    # a's ranking ties every instance; the script finds i0 busier than a's bounds and
    # walks on to the others, whose records lie past the end of `state`
    held += [await a.reserve(100, 10) for _ in range(6)]
    assert not any(r.degraded for r in held)
    assert set(await live_reservations(a)) == {r.rid for r in held}
    await assert_counters_match_reservations(a)  # the others held nothing: no loss
    await audit(a)
    assert a.stats.audit_resets == 0


async def test_a_reservation_on_an_instance_whose_spec_left_keeps_its_url(
    make_coordinator: MakeCoordinator,
) -> None:
    """The reserve's reply names a spec change, and the specs read after it no longer
    hold the chosen instance's (its key evicted meanwhile; here by hand): the
    reservation still goes to the URL it was ranked with, not to '' (502)."""
    a = await make_coordinator("node-a", settings=AUDITING)
    for i in range(2):
        await a.register_instance(spec(i))
    await a.refresh()
    meta, gen = a.keys.column("meta"), await a.redis.hget(a.keys.column("meta"), "spec_gen")
    await a.redis.hdel(a.keys.column("spec"), "i0")
    await a.redis.zadd(a.keys.column("spec_log"), {"i0": int(gen) + 1})
    await a.redis.hincrby(meta, "spec_gen", 1)
    res = await a.reserve(100, 10, exclude=["i1"])
    assert (res.instance_id, res.url) == ("i0", spec(0).url)


async def test_a_lost_voids_set_is_found_while_void_records_remain(
    make_coordinator: MakeCoordinator,
) -> None:
    """Records of a restarted instance wait in `voids` for the sweep; without that
    set they would stay for good, and the pool's total no longer explains them."""
    a = await make_coordinator("node-a", settings=AUDITING)
    await a.register_instance(spec(0))
    for _ in range(VOIDED):
        await a.reserve(10, 10)
    # A restart: every record void; its registration sweeps 250 (lua/_lib.lua
    # SWEEP_BUDGET), the lease loop the rest, unless `voids` is lost.
    await a.register_instance(spec(0, epoch=10**9))
    assert await a.redis.hlen(a.keys.column("reservations")) == VOIDED - 250
    assert await a.redis.delete(a.keys.column("voids")) == 1
    await audit(a)
    assert a.stats.audit_resets == 1
    await recovered(a)
    assert await live_reservations(a) == {}, "the restart had ended them"
    await assert_counters_match_reservations(a)


async def test_a_node_whose_rids_set_was_lost_restores_it(
    make_coordinator: MakeCoordinator,
) -> None:
    """The reaper releases a dead node's reservations from its rids set: lost or
    edited while the node lives, the node's next renewal finds fewer ids there than
    it holds, and its re-assert puts them back."""
    a = await make_coordinator("node-a", settings=AUDITING)
    await a.register_instance(spec(0))
    await a.renew_lease()
    held = [await a.reserve(100, 10) for _ in range(3)]
    rids = a.keys.node_rids("node-a")
    await a.renew_lease()
    assert a.coordination == "ok", "the set holds every reservation"
    await a.redis.srem(rids, held[1].rid)
    await a.renew_lease()
    assert a.coordination == "degraded"
    await recovered(a)
    assert {as_text(m) for m in await a.redis.smembers(rids)} == {r.rid for r in held}
    await assert_counters_match_reservations(a)


async def dead_and_reaped(a: Coordinator, dead: Coordinator) -> None:
    """Let `dead` die (its lease runs out) and a's reaper remove it from `nodes`."""
    await dead.close()

    async def reaped() -> bool:
        await a.reap_expired()
        return await a.redis.zscore(a.keys.column("nodes"), dead.node_id) is None

    await wait_for(reaped, what=f"{dead.node_id} reaped")


@pytest.mark.parametrize("lost", ["its whole rids set", "one id of its rids set"])
async def test_a_dead_nodes_reservations_its_rids_set_no_longer_named_are_released(
    make_coordinator: MakeCoordinator, lost: str
) -> None:
    """The reaper releases what a dead node's rids set names, then removes the node;
    records the set had lost outlive it with nobody to release them. The audit's step
    over `reservations` releases those orphans (whose node is not in `nodes` at all),
    and never a live or merely expired node's."""
    a = await make_coordinator("node-a", settings=AUDITING)
    dead = await make_coordinator("node-dead", settings=AUDITING.with_(lease_ms=200))
    for i in range(2):
        await a.register_instance(spec(i))
    mine = [await a.reserve(100, 10) for _ in range(2)]
    doomed = [await dead.reserve(100, 10) for _ in range(3)]
    await dead.mark_first_token(doomed[0].rid)
    rids = a.keys.node_rids(dead.node_id)
    if lost == "one id of its rids set":
        assert await a.redis.srem(rids, doomed[1].rid) == 1
    else:
        assert await a.redis.delete(rids) == 1
    orphans = 1 if lost == "one id of its rids set" else 3
    await audit(a)  # the dead node still holds its lease: nothing is an orphan yet
    assert a.stats.orphans_released == 0
    await dead_and_reaped(a, dead)
    assert len(await live_reservations(a)) == len(mine) + orphans, "the reaper missed them"

    await audit(a)
    assert a.stats.orphans_released == orphans
    assert set(await live_reservations(a)) == {r.rid for r in mine}
    await assert_counters_match_reservations(a)
    await audit(a)
    assert (a.stats.orphans_released, a.stats.audit_resets) == (orphans, 0)


async def test_a_lost_nodes_key_orphans_only_the_dead(make_coordinator: MakeCoordinator) -> None:
    """With `nodes` lost, a dead node is never listed as expired again, so its
    reservations are orphans; a live node's look the same until its next renewal,
    which finds its lease gone and re-asserts them."""
    a = await make_coordinator("node-a", settings=AUDITING)
    b = await make_coordinator("node-b", settings=AUDITING)
    dead = await make_coordinator("node-dead", settings=AUDITING.with_(lease_ms=200))
    await a.register_instance(spec(0))
    held = [await a.reserve(100, 10), await b.reserve(100, 10)]
    await dead.reserve(100, 10)
    await dead.close()
    assert await a.redis.delete(a.keys.column("nodes")) == 1
    await audit(a)  # a, the caller, counts as alive: its lease is renewed next
    assert a.stats.orphans_released == 2, "b's and the dead node's"
    await b.renew_lease()
    assert b.coordination == "degraded", "b's lease was gone: it re-asserts"
    await recovered(a)  # its renewal found its lease gone too
    await recovered(b)
    assert set(await live_reservations(a)) == {r.rid for r in held}
    await assert_counters_match_reservations(a)
