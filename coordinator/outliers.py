"""Passive health (outlier ejection) shared by every node of a pool: types and parsing.

The state lives in one Redis hash per pool (`PoolKeys.outliers`) and changes only
through `lua/record_outcome.lua`, so every node counts the same failures and avoids
the same ejected instances. See docs/reliability.md, "Failing engines".
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from coordinator.errors import InvalidArgumentError
from coordinator.packed import as_text

OUTCOME_STATES = (
    "ok",
    "counted",
    "ejected",
    "already",
    "capped",
    "cordoned",
    "uncordoned",
    "unknown",
)
RATE_WINDOW_MS = 60_000  # a node's exchanges older than this leave its failure shares
CONSECUTIVE_OFF = 1_000_000  # record_outcome's threshold when failures in a row never eject


@dataclass(frozen=True, slots=True)
class OutlierPolicy:
    """When an instance is ejected, and for how long (anchors: Envoy, nginx)."""

    consecutive_failures: int = 5  # Envoy consecutive_5xx; 0 = off
    failure_window_ms: int = 10_000  # nginx fail_timeout: failures further apart restart
    base_ejection_ms: int = 10_000  # first ejection; doubles with each repeat
    max_ejection_ms: int = 300_000  # Envoy max_ejection_time
    max_ejection_percent: float = 50.0  # Envoy max_ejection_percent, of the alive instances
    # Envoy failure_percentage_threshold and _request_volume: an instance whose share of
    # failures among a node's last `failure_volume` exchanges with it (within
    # RATE_WINDOW_MS) reaches `failure_percent` is ejected, failing in a row or not
    # (FailureShares). 0 = off.
    failure_percent: float = 20.0
    failure_volume: int = 20

    def __post_init__(self) -> None:
        for name in (
            "consecutive_failures",
            "failure_window_ms",
            "base_ejection_ms",
            "failure_volume",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(f"{name} must be an integer >= 0, got {value!r}")
        if self.failure_window_ms < 1 or self.base_ejection_ms < 1:
            raise InvalidArgumentError("failure_window_ms and base_ejection_ms must be >= 1")
        if (
            isinstance(self.max_ejection_ms, bool)
            or not isinstance(self.max_ejection_ms, int)
            or self.max_ejection_ms < self.base_ejection_ms
        ):
            raise InvalidArgumentError("max_ejection_ms must be an integer >= base_ejection_ms")
        pct = self.max_ejection_percent
        if isinstance(pct, bool) or not isinstance(pct, int | float) or not math.isfinite(pct):
            raise InvalidArgumentError("max_ejection_percent must be a number in 0..100")
        if not 0 <= pct <= 100:
            raise InvalidArgumentError("max_ejection_percent must be a number in 0..100")
        share = self.failure_percent
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 100:
            raise InvalidArgumentError("failure_percent must be a number in 0..100")
        if self.failure_percent > 0 and self.failure_volume < 1:
            raise InvalidArgumentError("failure_volume must be >= 1 with a failure_percent")

    @property
    def enabled(self) -> bool:
        """Whether failures can eject at all."""
        return self.consecutive_failures > 0 or self.failure_percent > 0


class FailureShares:
    """Each instance's last `failure_volume` exchanges with this node (within
    RATE_WINDOW_MS), judged against `failure_percent`: an engine that fails one request
    in three never fails five in a row for long, yet costs every third client a retry
    or a cut stream. Each node judges its own exchanges (no Redis call per request);
    the ejection it then records applies fleet-wide."""

    def __init__(self, policy: OutlierPolicy, kept: int = 4096) -> None:
        self._policy = policy
        self._kept = kept  # instances tracked at most; stale ones go first
        self._last: dict[str, deque[tuple[float, bool]]] = {}

    def add(self, instance_id: str, ok: bool, now_ms: float) -> float | None:
        """Count one exchange; the failure share in percent when it now ejects."""
        p = self._policy
        if p.failure_percent <= 0:
            return None
        last = self._last.get(instance_id)
        if last is None:
            if len(self._last) >= self._kept:
                self._drop_stale(now_ms)
            last = self._last[instance_id] = deque(maxlen=p.failure_volume)
        last.append((now_ms, ok))
        while last and now_ms - last[0][0] > RATE_WINDOW_MS:
            last.popleft()
        if ok or len(last) < p.failure_volume:
            return None
        share = 100.0 * sum(1 for _, good in last if not good) / len(last)
        return share if share >= p.failure_percent else None

    def forget(self, instance_id: str) -> None:
        """Start the instance's count again (it was ejected: it comes back clean)."""
        self._last.pop(instance_id, None)

    def _drop_stale(self, now_ms: float) -> None:
        self._last = {
            iid: last
            for iid, last in self._last.items()
            if last and now_ms - last[-1][0] <= RATE_WINDOW_MS
        }


@dataclass(frozen=True, slots=True)
class Outcome:
    """What recording one exchange's outcome did."""

    state: str  # one of OUTCOME_STATES
    consecutive_failures: int
    ejected_until_ms: int  # Redis time; in the past when the instance is not ejected
    ejections: int  # times ejected recently (the backoff exponent + 1)
    now_ms: int


@dataclass(frozen=True, slots=True)
class OutlierState:
    """One instance's passive-health record, judged at a Redis time."""

    instance_id: str
    consecutive_failures: int = 0
    last_failure_ms: int = 0
    ejected_until_ms: int = 0
    ejections: int = 0
    reason: str = ""
    cordon: str | None = None  # an operator's reason while the instance is cordoned

    def ejected(self, now_ms: int) -> bool:
        """Whether the instance is ejected at `now_ms` (Redis time)."""
        return self.ejected_until_ms > now_ms

    @property
    def cordoned(self) -> bool:
        """Whether an operator took the instance out of rotation (lua/record_outcome.lua)."""
        return self.cordon is not None

    def as_dict(self, now_ms: int) -> dict[str, Any]:
        """JSON-ready view at `now_ms` (what debug views and inspect show)."""
        ejected = self.ejected(now_ms)
        return {
            "ejected": ejected,
            "ejected_for_ms": max(0, self.ejected_until_ms - now_ms) if ejected else 0,
            "consecutive_failures": self.consecutive_failures,
            "ejections": self.ejections,
            "last_failure_reason": self.reason or None,
            "cordoned": self.cordoned,
            "cordon_reason": self.cordon or None,
        }


@dataclass(frozen=True, slots=True)
class OutlierView:
    """Every instance's passive-health record, and the Redis time it was read at."""

    now_ms: int
    states: dict[str, OutlierState]

    def ejected_ids(self, now_ms: int | None = None) -> frozenset[str]:
        """Ids ejected at `now_ms` (default: the time of the read)."""
        at = self.now_ms if now_ms is None else now_ms
        return frozenset(i for i, s in self.states.items() if s.ejected(at))

    def cordoned_ids(self) -> frozenset[str]:
        """Ids an operator cordoned: no node sends them new requests."""
        return frozenset(i for i, s in self.states.items() if s.cordoned)

    def state(self, instance_id: str) -> OutlierState:
        """The record of one instance (a clean one when it has none)."""
        return self.states.get(instance_id) or OutlierState(instance_id)


FIELDS = {
    "fails": "consecutive_failures",
    "last_fail_ms": "last_failure_ms",
    "until_ms": "ejected_until_ms",
    "ejections": "ejections",
    "reason": "reason",
    "cordon": "cordon",
}
TEXT_FIELDS = frozenset({"reason", "cordon"})


def parse_outliers(reply: list[Any]) -> OutlierView:
    """Decode {now_ms, flat hash}: read_outliers.lua's pages, joined."""
    now_ms, flat = int(reply[0]), reply[1]
    values: dict[str, dict[str, Any]] = {}
    for i in range(0, len(flat) - 1, 2):
        key = as_text(flat[i])
        iid, sep, name = key.rpartition(":")
        attr = FIELDS.get(name)
        if not sep or attr is None:
            continue
        raw = as_text(flat[i + 1])
        if attr in TEXT_FIELDS:
            values.setdefault(iid, {})[attr] = raw
            continue
        try:
            values.setdefault(iid, {})[attr] = int(float(raw))
        except ValueError:
            continue
    return OutlierView(now_ms, {iid: OutlierState(iid, **v) for iid, v in values.items()})
