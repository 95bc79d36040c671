"""The node-side cache of a pool, kept current by incremental deltas from Redis."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from coordinator.models import Hint, InstanceLoad, InstanceRow, InstanceSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A pool's pressure at one Redis time: exactly what selection scores."""

    now_ms: int
    version: int
    rows: list[InstanceLoad]
    coordination: str = "ok"

    def by_id(self) -> dict[str, InstanceLoad]:
        """Rows keyed by instance id."""
        return {row.id: row for row in self.rows}


@dataclass
class PoolCache:
    """Rows of one pool as of `version`; every script reply carries a delta for it.

    Deltas may arrive out of order (concurrent calls); a row is applied only when its
    per-instance version is not older than the cached one, so order does not matter.
    """

    run_id: str = ""
    version: int = 0
    now_ms: int = 0
    refreshed_mono: float = 0.0
    rows: dict[str, InstanceRow] = field(default_factory=dict)
    _specs: dict[str, InstanceSpec] = field(default_factory=dict)
    rows_applied: int = 0  # rows decoded from deltas since start (for benchmarks)
    dirty: set[str] = field(default_factory=set)  # ids changed since the ranker last synced
    # Version of each tombstone applied, so a late reply cannot resurrect the row.
    _removed: dict[str, int] = field(default_factory=dict)
    _stale: bool = False
    membership: int = 0  # bumps whenever an id is added or removed

    def since(self) -> tuple[int, str]:
        """Arguments for the next delta request."""
        return self.version, self.run_id

    def apply(self, reply: list[Any]) -> None:
        """Merge a delta reply {run_id, version, now, full, rows} into the cache."""
        run_id, version, now_ms, full, rows = reply
        run_id = _text(run_id)
        if run_id != self.run_id:
            # Redis lost the pool (restart, failover to an empty replica): start over.
            self.rows.clear()
            self._removed.clear()
            self.membership += 1
            self.run_id = run_id
            self.version = 0
            # Another server (a failover) may run a clock behind the old one: the
            # highest time seen belongs to the old run.
            self.now_ms = 0
            if not int(full):
                return
        for raw in rows:
            self._apply_row(raw)
        self.version = max(self.version, int(version))
        self.now_ms = max(self.now_ms, int(now_ms))
        self.refreshed_mono = time.monotonic()
        self._stale = False

    def _apply_row(self, raw: list[Any]) -> None:
        iid = _text(raw[0])
        self.rows_applied += 1
        current = self.rows.get(iid)
        if raw[1] is None:
            removed_version = int(raw[2]) if len(raw) > 2 else 0
            if current is not None and removed_version >= current.version:
                del self.rows[iid]
                self.membership += 1
            self._removed[iid] = max(removed_version, self._removed.get(iid, 0))
            return
        version = int(raw[10])
        if current is not None and version < current.version:
            return
        if version <= self._removed.get(iid, -1):
            return
        spec_json = _text(raw[1])
        spec = self._specs.get(spec_json)
        if spec is None:
            try:
                spec = InstanceSpec.from_dict(json.loads(spec_json))
            except (ValueError, TypeError, OverflowError, RecursionError) as exc:
                # A row that got into Redis past validation (written directly, or by
                # an older version) must not break selection: leave it out.
                if self.rows.pop(iid, None) is not None:
                    self.membership += 1
                log.warning("ignoring instance %r: invalid stored spec (%s)", iid, exc)
                return
            self._specs[spec_json] = spec
            if len(self._specs) > 4 * max(64, len(self.rows)):
                self._specs.clear()
                self._specs[spec_json] = spec
        hints: dict[str, Hint] = {}
        for i in range(11, len(raw) - 2, 3):
            hints[_text(raw[i])] = Hint(float(raw[i + 1]), int(raw[i + 2]))
        earliest = int(raw[9])
        if current is None:
            self.membership += 1
        self.dirty.add(iid)
        self.rows[iid] = InstanceRow(
            id=iid,
            spec=spec,
            epoch=int(raw[2]),
            last_seen_ms=int(raw[3]),
            max_slots=int(raw[4]),
            inflight=int(raw[5]),
            pending_prefill=int(raw[6]),
            active_decode=int(raw[7]),
            prefill_free_at_ms=int(raw[8]),
            earliest_end_at_ms=None if earliest < 0 else earliest,
            version=version,
            hints=hints,
        )

    def invalidate(self) -> None:
        """Force the next decision to re-read (after a change that carried no delta)."""
        self._stale = True

    def estimated_now_ms(self) -> int:
        """Redis time now, extrapolated from the last reply with the local monotonic clock."""
        return self.now_ms + int((time.monotonic() - self.refreshed_mono) * 1000)

    def age_ms(self) -> float:
        """Milliseconds since the last delta was applied (infinite once invalidated)."""
        if self._stale:
            return float("inf")
        return (time.monotonic() - self.refreshed_mono) * 1000


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
