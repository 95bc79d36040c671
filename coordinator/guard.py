"""The anti-herding bounds a node sends with its candidates (lua/reserve.lua checks them)."""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.models import InstanceRow, InstanceSpec, RequestShape
from coordinator.settings import Weights


def guard_bounds(
    rows: Sequence[InstanceRow], request: RequestShape, weights: Weights
) -> list[tuple[int, int]]:
    """Per candidate (its row as the node sees it, best first), the most live and
    prefill-phase reservations it may have when the reserve script looks and still be
    taken: what the node observed (plus its affinity slack), raised to the least it
    observed on any candidate ranked after it. A candidate that got busier is still
    the better choice while it is no busier than the alternatives the node knows."""
    bounds: list[tuple[int, int]] = []
    floor_inflight = floor_pending = -1  # -1: no later candidate yet
    for row in reversed(rows):
        slack = affinity_slack(row.spec, request, weights)
        inflight, pending = row.inflight + slack, row.pending_prefill + slack
        bounds.append((max(inflight, floor_inflight), max(pending, floor_pending)))
        floor_inflight = inflight if floor_inflight < 0 else min(floor_inflight, inflight)
        floor_pending = pending if floor_pending < 0 else min(floor_pending, pending)
    bounds.reverse()
    return bounds


def affinity_slack(spec: InstanceSpec, request: RequestShape, weights: Weights) -> int:
    """Requests a candidate may gain before reserve passes it over: what its cache
    credit outweighs in the score. The script skips a candidate that got busier since
    the view was read (anti-herding); without this, any other node's request to the
    instance holding a conversation's prefix would send the next turn away."""
    cached = request.cached_on(spec.id)
    if not cached:
        return 0
    per_request = weights.inflight + weights.pending_prefill
    saved_ms = spec.prefill_ms(request.prompt_tokens) - spec.prefill_ms(
        request.prompt_tokens - cached
    )
    if per_request <= 0 or saved_ms <= 0:
        return 0
    return int(saved_ms * (weights.ttft_ms + weights.prefill_ms) / per_request)
