"""Passive health on the node: report each exchange's outcome, avoid ejected instances.

The shared state is the pool's outlier hash in Redis (coordinator/outliers.py,
lua/record_outcome.lua): every node counts into it and every node avoids what it
ejects. A node keeps a copy, refreshed every `REFRESH_S` and by its own reports, so
selection needs no extra round trip; a success is reported only for an instance the
copy shows failing, so a healthy pool costs no Redis call per request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any

from coordinator import Coordinator
from coordinator.errors import CoordinatorError
from coordinator.outliers import FailureShares, OutlierPolicy, OutlierView
from coordinator.tasks import raise_if_cancelling
from proxy_node.metrics import NodeMetrics

log = logging.getLogger(__name__)

REFRESH_S = 1.0  # how stale this node's view of other nodes' ejections may get


class PassiveHealth:
    """This node's view of the pool's outlier state, and its reporter."""

    def __init__(self, coordinator: Coordinator, policy: OutlierPolicy, metrics: NodeMetrics):
        self.coordinator = coordinator
        self.policy = policy
        self.metrics = metrics
        self.view = OutlierView(0, {})
        self._read_mono = time.monotonic()
        self.shares = FailureShares(policy)  # this node's recent exchanges per instance

    def _now_ms(self) -> int:
        """Redis time now, extrapolated from the last read."""
        return self.view.now_ms + int((time.monotonic() - self._read_mono) * 1000)

    def ejected_ids(self) -> frozenset[str]:
        """Instances ejected now, as far as this node knows."""
        if not self.policy.enabled:
            return frozenset()
        return self.view.ejected_ids(self._now_ms())

    def cordoned_ids(self) -> frozenset[str]:
        """Instances an operator cordoned, as far as this node knows (whatever the
        policy: a cordon is no failure)."""
        return self.view.cordoned_ids()

    async def cordon(self, instance_id: str, reason: str = "", *, lift: bool = False) -> None:
        """Cordon (or with `lift`, put back) an instance fleet-wide; this node's view
        takes it at once, the others' within REFRESH_S (Coordinator.cordon raises)."""
        await self.coordinator.cordon(instance_id, reason, lift=lift)
        self._note(instance_id, cordon=None if lift else reason)

    def _note(self, instance_id: str, **changes: Any) -> None:
        """Take what this node just wrote of an instance's record into its view."""
        states = dict(self.view.states)
        states[instance_id] = replace(self.view.state(instance_id), **changes)
        self.view = OutlierView(self._now_ms(), states)

    def failing(self, instance_id: str) -> bool:
        """Whether the instance has failures on record (so a success must be reported)."""
        state = self.view.states.get(instance_id)
        return state is not None and state.consecutive_failures > 0

    def _apply(self, view: OutlierView) -> None:
        self.view = view
        self._read_mono = time.monotonic()

    async def refresh(self) -> OutlierView:
        """Read the pool's outlier state from Redis (the cached copy when Redis is away)."""
        try:
            self._apply(await self.coordinator.read_outliers())
        except CoordinatorError as exc:
            log.debug("reading the outlier state failed: %s", exc)
        return self.view

    async def report(self, instance_id: str, ok: bool, reason: str = "") -> None:
        """Count one exchange's outcome fleet-wide (never raises; logs an ejection)."""
        if not self.policy.enabled:
            return
        share = self.shares.add(instance_id, ok, time.monotonic() * 1000)
        if ok and not self.failing(instance_id):
            return
        if not ok:
            self.metrics.upstream_failures.labels(reason).inc()
        stored = reason  # what operators see as the last failure's reason
        if share is not None:
            stored = f"{reason}; {share:.0f}% of the last {self.policy.failure_volume} failed"
        try:
            outcome = await self.coordinator.record_outcome(
                instance_id, ok, self.policy, stored, rate=share is not None
            )
        except CoordinatorError as exc:
            log.debug("recording the outcome of %s failed: %s", instance_id, exc)
            return
        if outcome.state in ("ejected", "already"):
            self.shares.forget(instance_id)  # back from its ejection, it starts clean
        self._note(
            instance_id,
            consecutive_failures=outcome.consecutive_failures,
            ejected_until_ms=outcome.ejected_until_ms,
            ejections=outcome.ejections,
            reason=stored or self.view.state(instance_id).reason,
        )
        if share is not None:
            why = (
                f"{share:.0f}% of its last {self.policy.failure_volume} exchanges through "
                "this node failed"
            )
        else:
            why = f"{outcome.consecutive_failures} consecutive failures"
        if outcome.state == "ejected":
            self.metrics.ejections.inc()
            log.warning(
                "ejected instance %s for %d ms after %s (last: %s); ejection %d in a row",
                instance_id,
                outcome.ejected_until_ms - outcome.now_ms,
                why,
                reason,
                outcome.ejections,
            )
        elif outcome.state == "capped":
            log.warning(
                "instance %s stays in after %s: %g%% of the pool is ejected already "
                "(--eject-max-percent)",
                instance_id,
                why,
                self.policy.max_ejection_percent,
            )

    async def refresh_loop(self) -> None:
        """Refresh the view every REFRESH_S until cancelled."""
        while True:
            await self.refresh()
            raise_if_cancelling()  # redis-py may have swallowed our cancel (coordinator.tasks)
            await asyncio.sleep(REFRESH_S)
