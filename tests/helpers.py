"""Small helpers shared by tests: spec builders, counter checks, condition waits."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from coordinator import Coordinator, InstanceSpec, Settings
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


def lex_member(instance_id: str, epoch: int, end_at_ms: int, rid: str) -> str:
    """The per-instance index entry of a reservation (lua/_lib.lua lex_member)."""
    return f"{instance_id}#{int(epoch):010d}|{int(end_at_ms):015d}|{rid}"


async def assert_counters_match_reservations(c: Coordinator) -> None:
    """DESIGN.md §6: every counter equals the live reservations in its phase; none < 0.

    The counters are the packed `state` records (their only store): inflight,
    pending_prefill, active_decode, `pending_prefill_ms` (the sum of prefill_ms of
    prefill-phase reservations) and the earliest predicted end; the pool's
    `inflight_total` is their sum. Also the per-instance index (exactly one entry per
    record, on its instance, epoch and end time). Records of a restarted or removed
    instance count nowhere and must be queued for sweeping. Everything is read in one
    MULTI/EXEC, so a concurrent script cannot fall between the reads (all of a pool's
    keys share one hash slot).
    """
    pipe = c.redis.pipeline(transaction=True)
    for name in ("reservations", "epoch", "slot"):
        pipe.hgetall(c.keys.column(name))
    pipe.zrange(c.keys.column("by_instance"), 0, -1)
    # SSCAN, not SMEMBERS: redis-py's cluster transactions break on the latter's callback.
    pipe.sscan(c.keys.column("voids"), 0, count=1_000_000)
    pipe.getrange(c.keys.column("state"), 0, -1)
    pipe.hget(c.keys.column("meta"), "inflight_total")
    pipe.hget(c.keys.column("meta"), "slots")
    pipe.zcard(c.keys.column("free_slots"))
    for name in ("spec", "max_slots", "last_seen_ms"):
        pipe.hlen(c.keys.column(name))
    (
        raw_records,
        raw_epochs,
        raw_slots,
        index,
        (_, voids),
        state,
        total,
        allocated,
        free,
        *column_sizes,
    ) = await pipe.execute()
    stored = decode_counters(raw_slots, state)
    records = {rid: json.loads(v) for rid, v in raw_records.items()}
    epochs = {k: int(v) for k, v in raw_epochs.items()}
    expected: dict[str, dict[str, int]] = {
        name: dict.fromkeys(epochs, 0)
        for name in (*COUNTER_COLUMNS, "pending_prefill_ms", "earliest_end_at_ms")
    }
    for rec in records.values():
        iid = rec["instance"]
        if epochs.get(iid) != rec["epoch"]:
            assert iid in voids, f"void reservation not queued for sweeping: {rec}"
            continue
        # A live record's slot (kept so transitions need no slot lookup) is its
        # instance's; -1 or none: written before records kept slots.
        if rec.get("slot", -1) >= 0:
            assert rec["slot"] == int(raw_slots[iid]), ("record slot", rec, raw_slots[iid])
        expected["inflight"][iid] += 1
        phase = "pending_prefill" if rec["phase"] == "prefill" else "active_decode"
        expected[phase][iid] += 1
        if rec["phase"] == "prefill":
            expected["pending_prefill_ms"][iid] += int(rec["prefill_ms"])
        end = int(rec["end_at_ms"])
        earliest = expected["earliest_end_at_ms"]
        earliest[iid] = end if not earliest[iid] else min(earliest[iid], end)
    assert set(raw_slots) == set(epochs), ("slot", raw_slots, epochs)
    # The relations lua/renew_lease.lua's audit checks besides the counters: every
    # allocated slot is held or free, and each registry column names the same instances.
    assert int(allocated or 0) == len(raw_slots) + free, ("slots", allocated, raw_slots, free)
    assert column_sizes == [len(epochs)] * 3, ("spec, max_slots, last_seen_ms", column_sizes)
    for name, want in expected.items():
        assert stored[name] == want, (name, stored[name], want)
    # The pool's total, which reserve compares a candidate with, is the sum of `state`:
    # every record but the void ones, whose instances `voids` lists.
    assert int(total or 0) == sum(stored["inflight"].values()), ("inflight_total", total)
    assert voids or int(total or 0) == len(records), ("inflight_total", total, "no voids")
    expected_index = {
        lex_member(rec["instance"], rec["epoch"], rec["end_at_ms"], rid)
        for rid, rec in records.items()
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
