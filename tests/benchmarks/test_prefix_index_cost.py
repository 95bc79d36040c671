"""The index cost measurements (bench/prefix_live.redis_cost, bench/instructions.py's
index workloads): a record rides along with a call the node makes anyway, so each
takes off that call's floor, measured apart."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from redis.asyncio import Redis

from bench import instructions
from bench.prefix_live import redis_cost
from tests.helpers import private_server

pytestmark = pytest.mark.real


async def test_redis_cost_takes_off_the_empty_calls_and_leaves_nothing() -> None:
    with private_server() as server:  # the bench resets the server's statistics
        results = await redis_cost(
            server.url, 2, blocks=4, added=1, requests=20, capacity_tokens=5000, chunk=10
        )
        client = Redis.from_url(server.url)
        try:
            assert await client.dbsize() == 0, "the pool's keys are deleted after"
        finally:
            await client.aclose()
    assert [r.case for r in results] == [
        "follow-up turn: +1 blocks on a held 4",
        "new 4-block prompt",
    ]
    for r in results:
        # one carry call per record (sampled reclaims run plain commands only)
        assert r.records_per_request == 1.0
        assert r.lookup_us > 0
        assert all(math.isfinite(v) for v in (r.record_us, r.cpu_us, r.replayed_cpu_us))


async def test_index_workloads_record_their_floor_apart(redis_url: str) -> None:
    recorded = await instructions._record("index follow-up", redis_url, 2, 20)
    names = Counter(name for kind, name, _, _ in recorded["calls"] if kind == "evalsha")
    assert names == {"carry": 20}, "each record in a carry call of its own"
    floor = recorded["floor"]
    assert floor["requests"] == 20 and floor["start"] is recorded["start"]
    assert [(kind, name, args) for kind, name, _, args in floor["calls"]] == [
        ("evalsha", "carry", [0])
    ] * 20
