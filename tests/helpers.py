"""Small helpers shared by tests: spec builders, counter checks, condition waits."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
from aiohttp import web

from coordinator import Coordinator, InstanceSpec, Settings
from coordinator.invariants import pool_problems
from coordinator.keys import PoolKeys
from coordinator.packed import LIVE_BYTES, LiveRecord, pack_live, state_by_instance
from local_fleet.embedded import EmbeddedRedis, ServerUnavailableError, free_port

COUNTER_COLUMNS = ("inflight", "pending_prefill", "active_decode")


def spec(i: int | str, **overrides: Any) -> InstanceSpec:
    """An instance spec with a timing model on a loopback URL."""
    values: dict[str, Any] = {
        "id": f"i{i}" if isinstance(i, int) else i,
        "url": f"http://127.0.0.1:{9000 + (i if isinstance(i, int) else 0)}",
        "prefill_ms_per_token": 0.1,
        "prefill_overhead_ms": 5.0,
        "decode_ms_per_token": 10.0,
    }
    values.update(overrides)
    return InstanceSpec(**values)


def decode_counters(raw_slots: dict[Any, Any], state: Any) -> dict[str, dict[str, int]]:
    """Every registered instance's counters from its packed `state` record (the only
    place they are stored): name -> instance -> value, for the COUNTER_COLUMNS plus
    pending_prefill_ms, prefill_free_at_ms, earliest_end_at_ms and started. `raw_slots` is the
    `slot` hash (instance -> slot) as read, `state` the `state` string."""
    records = state_by_instance(raw_slots, state)
    names = (
        *COUNTER_COLUMNS,
        "pending_prefill_ms",
        "prefill_free_at_ms",
        "earliest_end_at_ms",
        "started",
    )
    return {name: {iid: getattr(r, name) for iid, r in records.items()} for name in names}


async def packed_counters(c: Coordinator) -> dict[str, dict[str, int]]:
    """Every field of every instance's `state` record, as stored (decode_counters)."""
    pipe = c.redis.pipeline(transaction=True)
    pipe.hgetall(c.keys.column("slot"))
    pipe.getrange(c.keys.column("state"), 0, -1)
    raw_slots, state = await pipe.execute()
    return decode_counters(raw_slots, state)


async def counters(c: Coordinator) -> dict[str, dict[str, int]]:
    """The COUNTER_COLUMNS as stored in Redis: name -> instance -> value."""
    decoded = await packed_counters(c)
    return {name: decoded[name] for name in COUNTER_COLUMNS}


async def live_reservations(c: Coordinator) -> dict[str, dict[str, Any]]:
    """Reservation records stored in Redis, decoded."""
    raw = await c.redis.hgetall(c.keys.column("reservations"))
    return {rid: json.loads(v) for rid, v in raw.items()}


async def assert_counters_match_reservations(c: Coordinator) -> None:
    """DESIGN.md §6, as stored (coordinator/invariants.py): every counter equals the
    live reservations in its phase, the index holds one entry per record, the pool's
    total is the sum of the counters, and the registry's columns agree."""
    problems = await pool_problems(c.redis, c.keys)
    assert not problems, "\n".join(problems)


async def wait_for(
    predicate: Callable[[], Awaitable[bool] | bool],
    timeout_s: float = 10.0,
    what: str = "condition",
) -> None:
    """Poll a condition until it holds; fail with a clear message at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def delete_pool(client: Any, prefix: str, pool: str) -> None:
    """Delete exactly the keys of one pool (never FLUSHDB a shared server)."""
    pattern = PoolKeys(prefix, pool).pattern()
    keys = [key async for key in client.scan_iter(match=pattern, count=500)]
    if keys:
        await client.delete(*keys)


@contextlib.contextmanager
def private_server() -> Iterator[EmbeddedRedis]:
    """A private Redis-compatible server on a fixed free port (skips the test without one).

    For tests that change server-wide settings (ACLs, SLOWLOG) or stop and restart it:
    `stop()` then `start()` brings it back empty on the same port.
    """
    try:
        server = EmbeddedRedis(port=free_port()).start()
    except ServerUnavailableError as exc:
        pytest.skip(f"no Redis-compatible server to start: {exc}")
    try:
        yield server
    finally:
        server.stop()


async def register_stale_instance(redis_url: str, pool: str, instance_id: str) -> None:
    """An instance whose engine stopped heartbeating a minute ago (as stored in Redis).

    Its last-seen time goes back in the column hash and in the packed record the
    nodes read (coordinator/packed.py), as a heartbeat a minute ago would have left it.
    """
    c = await Coordinator.connect(
        redis_url, pool=pool, node_id="setup", settings=Settings(), background=False
    )
    try:
        await c.register_instance(spec(instance_id, url="http://127.0.0.1:9"))
        seconds, micros = await c.redis.time()
        seen = int(seconds) * 1000 + int(micros) // 1000 - 60_000
        await c.redis.hset(c.keys.column("last_seen_ms"), instance_id, seen)
        slot = int(await c.redis.hget(c.keys.column("slot"), instance_id))
        record = pack_live(LiveRecord(seen)).decode("ascii")
        await c.redis.setrange(c.keys.column("live"), slot * LIVE_BYTES, record)
        await c.redis.zrem(c.keys.column("nodes"), "setup")  # leave no lease behind
    finally:
        await c.close()


@contextlib.asynccontextmanager
async def served(app: web.Application) -> AsyncIterator[str]:
    """`app` served on a free loopback port while the block runs: its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
