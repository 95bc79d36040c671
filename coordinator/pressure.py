"""The pressure model: raw stored state plus the Redis time -> InstanceLoad."""

from __future__ import annotations

from coordinator.models import HINT_NAMES, InstanceLoad, InstanceRow


def instance_load(
    row: InstanceRow,
    now_ms: int,
    *,
    instance_ttl_ms: int,
    hint_ttl_ms: int,
    predicted: bool = True,
) -> InstanceLoad:
    """Derive every *_in_ms field from `now_ms` (Redis time), per DESIGN.md §3.

    `predicted=False` (degraded mode) blanks the predicted layer: without Redis the
    fleet-wide prefill cursor is unknown, and a guess would be worse than nothing.
    """
    spec = row.spec
    timed = predicted and spec.has_timing
    prefill_free = max(0, row.prefill_free_at_ms - now_ms) if timed else None
    next_slot: int | None
    if row.max_slots <= 0 or row.inflight < row.max_slots:
        next_slot = 0
    elif timed and row.earliest_end_at_ms is not None:
        next_slot = max(0, row.earliest_end_at_ms - now_ms)
    else:
        next_slot = None
    backlog = (
        max(prefill_free, next_slot) if prefill_free is not None and next_slot is not None else None
    )
    ages: dict[str, int] = {}
    running = waiting = depth = None
    if row.hints:
        fresh: dict[str, float | None] = dict.fromkeys(HINT_NAMES)
        for name, hint in row.hints.items():
            age = max(0, now_ms - hint.at_ms)
            ages[name] = age
            if age <= hint_ttl_ms:
                fresh[name] = hint.value
        running = fresh["engine_running"]
        waiting = fresh["engine_waiting"]
        depth = fresh["queue_depth"]
    seen_age = now_ms - row.last_seen_ms
    # Positional, in field order: a decision builds k of these.
    return InstanceLoad(
        row.id,
        spec.url,
        spec.role,
        spec.weight,
        row.epoch,
        seen_age <= instance_ttl_ms,
        max(0, seen_age),
        row.max_slots,
        row.inflight,
        row.pending_prefill,
        row.active_decode,
        next_slot,
        prefill_free,
        backlog,
        running,
        waiting,
        depth,
        ages,
        spec,
        row.timing,
    )
