"""Small helpers shared by tests: spec builders, counter checks, condition waits."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from coordinator import Coordinator, InstanceSpec
from coordinator.keys import PoolKeys

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


async def counters(c: Coordinator) -> dict[str, dict[str, int]]:
    """Counter columns as stored in Redis: column -> instance -> value."""
    out: dict[str, dict[str, int]] = {}
    for name in COUNTER_COLUMNS:
        raw = await c.redis.hgetall(c.keys.column(name))
        out[name] = {k: int(v) for k, v in raw.items()}
    return out


async def live_reservations(c: Coordinator) -> dict[str, dict[str, Any]]:
    """Reservation records stored in Redis, decoded."""
    raw = await c.redis.hgetall(c.keys.column("reservations"))
    return {rid: json.loads(v) for rid, v in raw.items()}


async def assert_counters_match_reservations(c: Coordinator) -> None:
    """DESIGN.md §6: every counter equals the live reservations in its phase; none < 0.

    Counters, records and epochs are read in one MULTI/EXEC, so a concurrent script
    cannot fall between the reads (all of a pool's keys share one hash slot).
    """
    pipe = c.redis.pipeline(transaction=True)
    for name in (*COUNTER_COLUMNS, "reservations", "epoch"):
        pipe.hgetall(c.keys.column(name))
    *raw_counters, raw_records, raw_epochs = await pipe.execute()
    stored = {
        name: {k: int(v) for k, v in raw.items()}
        for name, raw in zip(COUNTER_COLUMNS, raw_counters, strict=True)
    }
    records = {rid: json.loads(v) for rid, v in raw_records.items()}
    epochs = {k: int(v) for k, v in raw_epochs.items()}
    expected: dict[str, dict[str, int]] = {
        name: dict.fromkeys(epochs, 0) for name in COUNTER_COLUMNS
    }
    for rec in records.values():
        assert rec["instance"] in epochs, f"reservation on unknown instance: {rec}"
        assert rec["epoch"] == epochs[rec["instance"]], f"reservation of a void epoch: {rec}"
        expected["inflight"][rec["instance"]] += 1
        phase = "pending_prefill" if rec["phase"] == "prefill" else "active_decode"
        expected[phase][rec["instance"]] += 1
    for name in COUNTER_COLUMNS:
        assert all(v >= 0 for v in stored[name].values()), (name, stored[name])
        assert stored[name] == expected[name], (name, stored[name], expected[name])


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
