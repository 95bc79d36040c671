"""The packed per-instance records scripts keep in `state` and `live` (lua/_lib.lua).

Each pool keeps two strings with one fixed-width record per slot (an instance's
index, in the `slot` hash), so a node reads the whole pool's changing state in one
short reply and finds what changed by comparing records. A field is a fixed number
of base-128 digits, most significant first: every byte is 0..127, plain ASCII, so a
client that decodes replies as text gets them unchanged.

- `state` (27 bytes; every reservation transition rewrites it, and it is the only
  place these counters are kept): pending_prefill and active_decode (3 digits,
  saturating at 2,097,151; inflight is their sum), prefill_free_at_ms and
  earliest_end_at_ms (6 digits: Redis ms up to the year 2109; 0 = no live
  reservation), pending_prefill_ms (6 digits: the prefill work of the prefill-phase
  reservations), started (3 digits: the reservations ever placed on the slot, modulo
  STARTED_WRAP, zeroed with the slot: its growth over a few seconds is how many
  requests the whole fleet sent the instance then, `RecentStarts`);
- `live` (36 bytes; heartbeats rewrite it): last_seen_ms (6 digits), then per hint
  (engine_running, engine_waiting, queue_depth) its value × 1000 (4 digits,
  saturating at 268,435.455) and the Redis time it was reported (6 digits, 0 = never).

`redis-cli` shows last_seen_ms and the hints in their column hashes too (those stay
their source of truth); `coordinator inspect` decodes both records.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coordinator.models import HINT_NAMES, Hint

STATE_FIELDS = (3, 3, 6, 6, 6, 3)  # digits per field
STARTED_WRAP = 128**3  # `started` counts modulo this
LIVE_FIELDS = (6, *(n for _ in HINT_NAMES for n in (4, 6)))
STATE_BYTES = sum(STATE_FIELDS)
LIVE_BYTES = sum(LIVE_FIELDS)
HINT_SCALE = 1000.0  # hint values are stored in thousandths


@dataclass(frozen=True, slots=True)
class StateRecord:
    """One slot of `state`."""

    inflight: int = 0
    pending_prefill: int = 0
    active_decode: int = 0
    prefill_free_at_ms: int = 0
    earliest_end_at_ms: int = 0
    pending_prefill_ms: int = 0
    started: int = 0


@dataclass(frozen=True, slots=True)
class LiveRecord:
    """One slot of `live`."""

    last_seen_ms: int = 0
    hints: dict[str, Hint] = field(default_factory=dict)


def as_text(value: Any) -> str:
    """A reply value as text, whether the client decodes replies or not."""
    return value.decode() if isinstance(value, bytes) else str(value)


def as_bytes(value: Any) -> bytes:
    """A packed string from a reply, whether the client decodes replies or not."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("latin-1")
    return b""


def _digits(value: int, width: int) -> bytes:
    """`value` (saturated) as `width` base-128 digits, like lua/_lib.lua be()."""
    value = min(max(int(value), 0), 128**width - 1)
    return bytes((value >> (7 * (width - 1 - k))) & 0x7F for k in range(width))


NO_SLOT = 128**3 - 1  # a candidate's slot the node does not know
# A reserve candidate's bounds (lua/reserve.lua ARGV[13..]): slot, prefill_ms,
# decode_ms, max inflight, max pending_prefill, max prefill_free_at (digits each).
CANDIDATE_FIELDS = (3, 4, 4, 3, 3, 6)
CANDIDATE_BYTES = sum(CANDIDATE_FIELDS)
_CAPS = tuple(128**w - 1 for w in CANDIDATE_FIELDS[1:])  # each field after the slot, saturated


def pack_candidate(
    slot: int, prefill_ms: int, decode_ms: int, max_inflight: int, max_pending: int,
    max_free_at: int,
) -> bytes:  # fmt: skip
    """One reserve candidate's bounds as CANDIDATE_FIELDS base-128 digits, so the
    script parses no number: each value saturates at its width (bounds past a count's
    3 digits only ever pass, as the counters saturate there too), a slot that is not
    known (-1) or does not fit becomes NO_SLOT, and the script checks what it reads."""
    if not 0 <= slot < NO_SLOT:
        slot = NO_SLOT
    # The six as one integer of 23 7-bit digits, then each digit moved up into a byte
    # of its own in five mask-and-shift steps (digit k moves up k bits: by 16, 8, 4,
    # 2 and 1 where k has that bit): no loop over digits, for every candidate of
    # every request.
    n = slot
    for value, cap in zip(
        (prefill_ms, decode_ms, max_inflight, max_pending, max_free_at), _CAPS, strict=True
    ):
        n = n << cap.bit_length() | (cap if value > cap else value if value > 0 else 0)
    for step, mask in _SPREAD:
        n = (n & ~mask) | (n & mask) << step
    return n.to_bytes(CANDIDATE_BYTES, "big")


def _spread_masks(digits: int) -> tuple[tuple[int, int], ...]:
    """pack_candidate's steps, largest first: (shift, mask of the digits it moves),
    digit k sitting at bit 7k + k - (k mod 2 * shift) before the step (the larger
    shifts done), so no step moves a digit onto another."""
    steps = []
    step = 1
    while step < digits:
        steps.append(step)
        step *= 2
    out = []
    for step in reversed(steps):
        mask = 0
        for k in range(digits):
            if k & step:
                mask |= 0x7F << (8 * k - k % (2 * step))
        out.append((step, mask))
    return tuple(out)


_SPREAD = _spread_masks(CANDIDATE_BYTES)


def pack_live(record: LiveRecord) -> bytes:
    """One `live` record, as heartbeat.lua writes it (for tools that edit liveness)."""
    values = [record.last_seen_ms]
    for name in HINT_NAMES:
        hint = record.hints.get(name)
        values += [round(hint.value * HINT_SCALE), hint.at_ms] if hint else [0, 0]
    return b"".join(_digits(v, w) for v, w in zip(values, LIVE_FIELDS, strict=True))


def _fields(blob: bytes, offset: int, widths: tuple[int, ...]) -> list[int]:
    out = []
    for width in widths:
        v = 0
        for byte in blob[offset : offset + width]:
            v = v * 128 + byte
        out.append(v)
        offset += width
    return out


def unpack_state(blob: bytes, slot: int) -> StateRecord:
    """The `state` record of one slot (zeros past the end of the string)."""
    offset = slot * STATE_BYTES
    if slot < 0 or offset + STATE_BYTES > len(blob):
        return StateRecord()
    pending, decode, free_at, earliest, pending_ms, started = _fields(blob, offset, STATE_FIELDS)
    return StateRecord(pending + decode, pending, decode, free_at, earliest, pending_ms, started)


def state_by_instance(raw_slots: Mapping[Any, Any], state: Any) -> dict[str, StateRecord]:
    """Every registered instance's `state` record: `raw_slots` is the `slot` hash as
    read (instance -> slot), `state` the `state` string (read in one MULTI with it)."""
    blob = as_bytes(state)
    return {as_text(iid): unpack_state(blob, int(slot)) for iid, slot in raw_slots.items()}


def unpack_live(blob: bytes, slot: int) -> LiveRecord:
    """The `live` record of one slot (zeros past the end of the string)."""
    offset = slot * LIVE_BYTES
    if slot < 0 or offset + LIVE_BYTES > len(blob):
        return LiveRecord()
    values = _fields(blob, offset, LIVE_FIELDS)
    hints = {
        name: Hint(values[1 + 2 * k] / HINT_SCALE, values[2 + 2 * k])
        for k, name in enumerate(HINT_NAMES)
        if values[2 + 2 * k]
    }
    return LiveRecord(values[0], hints)


def changed_slots(old: bytes, new: bytes, itemsize: int) -> list[int]:
    """Slots whose record differs between two packed strings (or exists in one only)."""
    n_old, n_new = len(old) // itemsize, len(new) // itemsize
    common = min(n_old, n_new)
    a = np.frombuffer(old, dtype=np.uint8, count=common * itemsize).reshape(common, itemsize)
    b = np.frombuffer(new, dtype=np.uint8, count=common * itemsize).reshape(common, itemsize)
    diff: list[int] = np.flatnonzero((a != b).any(axis=1)).tolist()
    return [*diff, *range(common, max(n_old, n_new))]
