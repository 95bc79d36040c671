"""bench/redis_memory.py at a tiny scale: it measures Redis, then leaves nothing behind.

No size is asserted beyond the sign of the reservations' growth (2 MB or so, well
above the allocator's noise of a few hundred KB): bytes per item depend on the
server's version, allocator and encodings.
"""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from bench.redis_memory import measure, render

pytestmark = pytest.mark.real


async def test_a_tiny_run_measures_growth_and_cleans_up(redis_url: str) -> None:
    client = Redis.from_url(redis_url)
    try:
        before = {k async for k in client.scan_iter(match="lc:{mem-*")}
        row = await measure(redis_url, instances=20, reservations=3000)
        after = {k async for k in client.scan_iter(match="lc:{mem-*")}
    finally:
        await client.aclose()
    assert row["instances"] == 20 and row["reservations"] == 3000
    assert row["per_reservation"] > 0
    assert after == before  # both pools (warm-up and measured) deleted
    table = render([row], "test server", streams=1000, fleet=100)
    assert "| 20 | 3,000 |" in table and "Projected for 100 instances and 1,000 streams" in table
