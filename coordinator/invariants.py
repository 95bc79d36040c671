"""The pool's invariants (DESIGN.md §6), checked against what Redis stores.

Every script keeps a pool's keys consistent with its reservation records: each
instance's packed `state` record counts exactly its live reservations (in flight, in
prefill, in decode, their prefill milliseconds, the earliest predicted end), the
per-instance index holds one entry per record, `meta`'s `inflight_total` is the sum
of the counters, and the registry's columns name the same instances. `pool_problems`
reads all of it in one MULTI/EXEC (a pool's keys share one hash slot, so no script
falls between the reads) and lists what does not hold.

It reads the whole pool: a tool for tests, the soak and an operator's check, not for
the request path (the fleet's own check is the bounded audit in lua/renew_lease.lua).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from coordinator.keys import PoolKeys
from coordinator.packed import StateRecord, as_text, state_by_instance


def lex_member(instance_id: str, epoch: int, end_at_ms: int, rid: str) -> str:
    """The per-instance index entry of a reservation (lua/_lib.lua lex_member)."""
    return f"{instance_id}#{int(epoch):010d}|{int(end_at_ms):015d}|{rid}"


async def pool_problems(redis: Any, keys: PoolKeys) -> list[str]:
    """Every invariant of the pool that does not hold as stored, one line each ([]
    when the pool is consistent). Records of a restarted or removed instance count
    nowhere and must be queued for sweeping (`voids`)."""
    pipe = redis.pipeline(transaction=True)
    for name in ("reservations", "epoch", "slot"):
        pipe.hgetall(keys.column(name))
    pipe.zrange(keys.column("by_instance"), 0, -1)
    # SSCAN, not SMEMBERS: redis-py's cluster transactions break on the latter's callback.
    pipe.sscan(keys.column("voids"), 0, count=1_000_000)
    pipe.get(keys.column("state"))
    pipe.hmget(keys.column("meta"), "inflight_total", "slots")
    pipe.zcard(keys.column("free_slots"))
    for name in ("spec", "max_slots", "last_seen_ms"):
        pipe.hlen(keys.column(name))
    replies = await pipe.execute()
    raw_records, raw_epochs, raw_slots, index, (_, raw_voids), state, meta, free = replies[:8]
    column_sizes = replies[8:]
    records = {as_text(rid): json.loads(v) for rid, v in raw_records.items()}
    epochs = {as_text(k): int(v) for k, v in raw_epochs.items()}
    slots = {as_text(k): int(v) for k, v in raw_slots.items()}
    voids = {as_text(v) for v in raw_voids}
    stored = state_by_instance(slots, state)
    total, allocated = (int(v or 0) for v in meta)
    problems: list[str] = []

    expected = {iid: _Counts() for iid in epochs}
    for rid, rec in records.items():
        iid = rec["instance"]
        if epochs.get(iid) != rec["epoch"]:
            if iid not in voids:
                problems.append(f"{rid}: a void reservation not queued for sweeping: {rec}")
            continue
        # A live record's slot (kept so transitions need no slot lookup) is its
        # instance's; -1 or none: written before records kept slots.
        if rec.get("slot", -1) >= 0 and rec["slot"] != slots.get(iid):
            problems.append(f"{rid}: record slot {rec['slot']}, {iid} holds {slots.get(iid)}")
        expected[iid].add(rec)
    if set(slots) != set(epochs):
        problems.append(f"slot names {sorted(slots)}, epoch {sorted(epochs)}")
    if allocated != len(slots) + free:
        problems.append(f"meta slots {allocated}, held {len(slots)} + free {free}")
    if column_sizes != [len(epochs)] * 3:
        problems.append(f"spec, max_slots, last_seen_ms hold {column_sizes}, not {len(epochs)}")
    for iid, want in expected.items():
        have = stored.get(iid)
        got = None if have is None else _Counts.stored(have)
        if got != want:
            problems.append(f"{iid}: state {got}, its reservations {want}")
    counted = sum(s.inflight for s in stored.values())
    if total != counted:
        problems.append(f"meta inflight_total {total}, the sum of state {counted}")
    if not voids and total != len(records):
        problems.append(f"meta inflight_total {total}, {len(records)} records and no voids")
    want_index = {
        lex_member(rec["instance"], rec["epoch"], rec["end_at_ms"], rid)
        for rid, rec in records.items()
    }
    have_index = {as_text(m) for m in index}
    if have_index != want_index:  # a sorted set: no member twice
        missing, extra = sorted(want_index - have_index), sorted(have_index - want_index)
        problems.append(f"by_instance lacks {missing}, has extra {extra}")
    return problems


@dataclass(slots=True)
class _Counts:
    """One instance's counters: as its reservations imply them, or as stored."""

    inflight: int = 0
    pending_prefill: int = 0
    active_decode: int = 0
    pending_prefill_ms: int = 0
    earliest_end_at_ms: int = 0

    @classmethod
    def stored(cls, record: StateRecord) -> _Counts:
        return cls(
            record.inflight,
            record.pending_prefill,
            record.active_decode,
            record.pending_prefill_ms,
            record.earliest_end_at_ms,
        )

    def add(self, rec: dict[str, Any]) -> None:
        """Count one live reservation record."""
        self.inflight += 1
        if rec["phase"] == "prefill":
            self.pending_prefill += 1
            self.pending_prefill_ms += int(rec["prefill_ms"])
        else:
            self.active_decode += 1
        end = int(rec["end_at_ms"])
        self.earliest_end_at_ms = min(self.earliest_end_at_ms or end, end)
