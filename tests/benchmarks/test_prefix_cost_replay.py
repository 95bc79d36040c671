"""bench/prefix_live.py's busy-shard replay: it sends again exactly the commands the
node sent while logging (its pipelines' included, nothing sent while not), each time
from the state they started from, so the pool ends as the logged run left it. No
timing is asserted: the CPU figure depends on the machine."""

from __future__ import annotations

import math

import pytest
from redis.asyncio import Redis

from bench.prefix_live import CommandLog, _dump, replayed_cpu_us
from coordinator.keys import PoolKeys
from tests.helpers import delete_pool

pytestmark = pytest.mark.real


async def test_the_replay_sends_the_logged_commands_from_their_starting_state(
    redis_url: str, pool: str
) -> None:
    redis = Redis.from_url(redis_url)  # bytes: DUMP payloads are binary
    keys = PoolKeys("lc", pool)
    key, pattern = keys.prefix_index(), keys.pattern()
    log = CommandLog(redis)
    try:
        await redis.hset(key, mapping={"a": 1})
        start = await _dump(redis, pattern)
        log.on = True
        await redis.hincrby(key, "a", 1)
        pipe = redis.pipeline(transaction=False)
        pipe.hset(key, "b", 2)
        await pipe.execute()
        log.on = False
        await redis.hset(key, "c", 3)  # not logged: not replayed
        assert [c[0] for c in log.commands] == ["HINCRBY", "HSET"]

        cpu = await replayed_cpu_us(redis, pattern, start, log.commands, requests=2, repeats=3)

        assert math.isfinite(cpu) and cpu >= 0
        # each replay started from `start`: three replays incremented "a" once
        assert await redis.hgetall(key) == {b"a": b"2", b"b": b"2"}
    finally:
        await delete_pool(redis, "lc", pool)
        await redis.aclose()
