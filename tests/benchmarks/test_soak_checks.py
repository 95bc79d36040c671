"""bench/soak.py's invariant check reads the pool as the scripts store it.

The soak compares every counter with the live reservations every 2 s. It once read
counters from per-column hashes that the packed `state` records had replaced, so
every check of a long soak reported a violation (and its leak check summed nothing);
this reads a real pool through it, and breaks a counter to see the check fail.
"""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from bench.soak import Soak, read_pool_state
from coordinator.keys import PoolKeys
from coordinator.packed import STATE_BYTES
from tests.fake_engine import Harness
from tests.helpers import spec

pytestmark = pytest.mark.timeout(60)


async def test_the_soaks_check_reads_the_counters_as_stored(
    harness: Harness, real_client: Redis, pool: str
) -> None:
    c = await harness.coordinator()
    for i in range(2):
        await c.register_instance(spec(i))
    held = [await c.reserve(100, 10) for _ in range(3)]
    await c.mark_first_token(held[0].rid)
    keys = PoolKeys("lc", pool)

    counters, records, epochs = await read_pool_state(real_client, keys)
    assert set(records) == {r.rid for r in held}
    assert sum(counters["inflight"].values()) == 3
    assert sum(counters["active_decode"].values()) == 1
    assert Soak.inconsistencies(counters, records, epochs) == []

    slot = int(await real_client.hget(keys.column("slot"), held[1].instance_id))
    await real_client.setrange(keys.column("state"), slot * STATE_BYTES, "\0" * 6)
    found = Soak.inconsistencies(*await read_pool_state(real_client, keys))
    assert any(f"'{held[1].instance_id}': 0" in problem for problem in found), found
