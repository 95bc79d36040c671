"""The anti-herding bounds a node sends with its candidates (lua/reserve.lua checks them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from coordinator.models import InstanceRow, InstanceSpec, RequestShape
from coordinator.settings import Weights


def guard_bounds(
    rows: Sequence[InstanceRow],
    request: RequestShape,
    weights: Weights,
    now_ms: int,
    prefill_ms: Sequence[int] | None = None,
) -> list[tuple[int, int, int]]:
    """Per candidate (its row as the node sees it, best first, at Redis time `now_ms`),
    the bounds lua/reserve.lua takes it within:

    - the most live and prefill-phase reservations it may have: what the node observed
      (plus its affinity slack; for the holder of a hot prefix, at most what the
      bounded loads allow it: `CachedTokens.most_inflight`), raised to the least it
      observed on any candidate ranked after it. A candidate that got busier is still the better choice while it
      is no busier than the alternatives the node knows;
    - when the weights rank on predicted TTFT (`ttft_ms` > 0), the latest its prefill
      may be busy until (`prefill_free_at_ms`, Redis ms; 0 = no bound): the start that
      keeps this request's predicted TTFT there (queued prefill ahead + its own uncached
      prefill) no longer than it saw there, raised to the shortest it saw on any
      candidate ranked after it, plus the prefill of as many requests of this one's
      size as the count bound lets it gain. Counts alone let a node with a view a few
      hundred ms old queue a short prompt behind a multi-second prefill another node
      just put on an instance that held one decoding request, the same count as the
      others; work the counts already allow for is not refused twice.

    `prefill_ms` is each row's predicted prefill of the request's uncached part
    (`row.spec.prefill_ms`), when the caller has computed them already."""
    bounds: list[tuple[int, int, int]] = []
    floor_inflight = floor_pending = -1  # -1: no later candidate yet
    floor_ttft: int | None = None
    cached = bool(request.cached_tokens)
    most: Mapping[str, int] = getattr(request.cached_tokens, "most_inflight", {})
    for j in range(len(rows) - 1, -1, -1):
        row = rows[j]
        slack = affinity_slack(row.spec, request, weights) if cached else 0
        inflight, pending = row.inflight + slack, row.pending_prefill + slack
        if row.id in most:  # a hot prefix's holder: within the bounded loads on Redis
            inflight, pending = min(inflight, most[row.id]), min(pending, most[row.id])
        if prefill_ms is not None:
            own = prefill_ms[j]
        else:
            own = row.spec.prefill_ms(
                request.uncached_on(row.id) if cached else request.prompt_tokens
            )
        ttft = max(now_ms, row.prefill_free_at_ms) - now_ms + own
        max_inflight = max(inflight, floor_inflight)
        max_free_at = 0
        if weights.ttft_ms > 0:
            # The requests the count bound lets it gain, each of this request's size.
            gained = (max_inflight - row.inflight) * own
            start = max(ttft, ttft if floor_ttft is None else floor_ttft) - own + gained
            max_free_at = now_ms + start
        bounds.append((max_inflight, max(pending, floor_pending), max_free_at))
        floor_inflight = inflight if floor_inflight < 0 else min(floor_inflight, inflight)
        floor_pending = pending if floor_pending < 0 else min(floor_pending, pending)
        floor_ttft = ttft if floor_ttft is None else min(floor_ttft, ttft)
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
