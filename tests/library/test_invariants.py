"""coordinator/invariants.py: the pool's invariants checked against what Redis stores.

Every test of the suite that calls tests/helpers.assert_counters_match_reservations
shows the scripts keep them; here each one is broken by hand, the way eviction or an
operator's edit would, and the check must name it.
"""

from __future__ import annotations

import json

import pytest

from coordinator import Coordinator
from coordinator.invariants import lex_member, pool_problems
from coordinator.packed import STATE_BYTES
from tests.conftest import MakeCoordinator
from tests.helpers import live_reservations, spec

pytestmark = pytest.mark.timeout(60)


async def busy_pool(make_coordinator: MakeCoordinator) -> tuple[Coordinator, list[str]]:
    """Three instances, four reservations (one in decode); consistent as stored."""
    c = await make_coordinator("node-a")
    for i in range(3):
        await c.register_instance(spec(i))
    held = [await c.reserve(100 * (k + 1), 10) for k in range(4)]
    await c.mark_first_token(held[0].rid)
    assert await pool_problems(c.redis, c.keys) == []
    return c, [r.rid for r in held]


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        ("zero a counter", ": state _Counts(inflight=0"),
        ("drop an index entry", "by_instance lacks"),
        ("raise inflight_total", "meta inflight_total"),
        ("drop a spec", "spec, max_slots, last_seen_ms hold"),
        ("free a held slot twice", "meta slots"),
        ("move a record's slot", "record slot"),
        ("forget an epoch", "a void reservation not queued"),
    ],
)
async def test_each_broken_invariant_is_named(
    make_coordinator: MakeCoordinator, damage: str, named: str
) -> None:
    c, rids = await busy_pool(make_coordinator)
    column = c.keys.column
    rec = (await live_reservations(c))[rids[1]]
    iid = rec["instance"]
    slot = int(await c.redis.hget(column("slot"), iid))
    if damage == "zero a counter":
        await c.redis.setrange(column("state"), slot * STATE_BYTES, "\0" * 6)
    elif damage == "drop an index entry":
        member = lex_member(iid, rec["epoch"], rec["end_at_ms"], rids[1])
        assert await c.redis.zrem(column("by_instance"), member) == 1
    elif damage == "raise inflight_total":
        await c.redis.hincrby(column("meta"), "inflight_total", 1)
    elif damage == "drop a spec":
        assert await c.redis.hdel(column("spec"), "i2") == 1
    elif damage == "free a held slot twice":
        await c.redis.zadd(column("free_slots"), {str(slot): slot})
    elif damage == "move a record's slot":
        moved = {**rec, "slot": slot + 100}
        await c.redis.hset(column("reservations"), rids[1], json.dumps(moved))
    elif damage == "forget an epoch":
        assert await c.redis.hdel(column("epoch"), iid) == 1
    problems = await pool_problems(c.redis, c.keys)
    assert any(named in p for p in problems), problems
