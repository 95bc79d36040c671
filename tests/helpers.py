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


def lex_member(instance_id: str, end_at_ms: int, rid: str) -> str:
    """The per-instance index entry of a reservation (lua/_lib.lua lex_member)."""
    return f"{instance_id}|{int(end_at_ms):015d}|{rid}"


async def assert_counters_match_reservations(c: Coordinator) -> None:
    """DESIGN.md §6: every counter equals the live reservations in its phase; none < 0.

    Also `pending_prefill_ms` (the sum of prefill_ms of prefill-phase reservations)
    and the per-instance index (exactly one entry per record, on its instance and
    end time). Counters, records, epochs and the index are read in one MULTI/EXEC,
    so a concurrent script cannot fall between the reads (all of a pool's keys share
    one hash slot).
    """
    pipe = c.redis.pipeline(transaction=True)
    for name in (*COUNTER_COLUMNS, "pending_prefill_ms", "reservations", "epoch"):
        pipe.hgetall(c.keys.column(name))
    pipe.zrange(c.keys.column("by_instance"), 0, -1)
    *raw_counters, raw_pending_ms, raw_records, raw_epochs, index = await pipe.execute()
    stored = {
        name: {k: int(v) for k, v in raw.items()}
        for name, raw in zip(COUNTER_COLUMNS, raw_counters, strict=True)
    }
    stored_ms = {k: int(v) for k, v in raw_pending_ms.items()}
    records = {rid: json.loads(v) for rid, v in raw_records.items()}
    epochs = {k: int(v) for k, v in raw_epochs.items()}
    expected: dict[str, dict[str, int]] = {
        name: dict.fromkeys(epochs, 0) for name in COUNTER_COLUMNS
    }
    expected_ms = dict.fromkeys(epochs, 0)
    for rec in records.values():
        assert rec["instance"] in epochs, f"reservation on unknown instance: {rec}"
        assert rec["epoch"] == epochs[rec["instance"]], f"reservation of a void epoch: {rec}"
        expected["inflight"][rec["instance"]] += 1
        phase = "pending_prefill" if rec["phase"] == "prefill" else "active_decode"
        expected[phase][rec["instance"]] += 1
        if rec["phase"] == "prefill":
            expected_ms[rec["instance"]] += int(rec["prefill_ms"])
    for name in COUNTER_COLUMNS:
        assert all(v >= 0 for v in stored[name].values()), (name, stored[name])
        assert stored[name] == expected[name], (name, stored[name], expected[name])
    assert stored_ms == expected_ms, ("pending_prefill_ms", stored_ms, expected_ms)
    expected_index = {
        lex_member(rec["instance"], rec["end_at_ms"], rid) for rid, rec in records.items()
    }
    assert sorted(index) == sorted(expected_index), ("by_instance", index, expected_index)


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
