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
    ties: int = 0,
) -> list[tuple[int, int, int]]:
    """Per candidate (its row as the node sees it, best first, at Redis time `now_ms`),
    the bounds lua/reserve.lua takes it within:

    - the most live and prefill-phase reservations it may have: what the node observed
      (plus its affinity slack; for the holder of a hot prefix, at most what the
      bounded loads allow it: `CachedTokens.most_inflight`), raised to the least it
      observed on any candidate ranked after it. A candidate that got busier is still
      the better choice while it is no busier than the alternatives the node knows;
    - when the weights rank on predicted TTFT (`ttft_ms` > 0), the latest its prefill
      may be busy until (`prefill_free_at_ms`, Redis ms; 0 = no bound): the start that
      keeps this request's predicted TTFT there (queued prefill ahead + its own uncached
      prefill) no longer than it saw there, raised to the shortest it saw on any
      candidate ranked after it, plus the prefill of as many requests of this one's
      size as the count bound lets it gain. Counts alone let a node with a view a few
      hundred ms old queue a short prompt behind a multi-second prefill another node
      just put on an instance that held one decoding request, the same count as the
      others; work the counts already allow for is not refused twice.

    The first `ties` rows (when 2 or more) tie for best: the script visits them from
    the pool's turn, in any order, so each one's alternatives are all the others.

    `prefill_ms` is each row's predicted prefill of the request's uncached part
    (`row.spec.prefill_ms`), when the caller has computed them already."""
    bounds: list[tuple[int, int, int]] = []
    floor_inflight = floor_pending = -1  # -1: no later candidate yet
    floor_ttft: int | None = None
    tied = ties if ties >= 2 else 0
    # For each tied row: what the node saw of it, and the floors after it.
    tie: list[tuple[int, int, int, int, int, int, int | None]] = []
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
        if j < tied:
            tie.append((inflight, pending, ttft, own, floor_inflight, floor_pending, floor_ttft))
        bounds.append(
            _bound(row, inflight, pending, ttft, own, floor_inflight, floor_pending, floor_ttft,
                   weights, now_ms)
        )  # fmt: skip
        floor_inflight = inflight if floor_inflight < 0 else min(floor_inflight, inflight)
        floor_pending = pending if floor_pending < 0 else min(floor_pending, pending)
        floor_ttft = ttft if floor_ttft is None else min(floor_ttft, ttft)
    bounds.reverse()
    if tied:
        # The tied ones sent before it are its alternatives too (in a tie of equal
        # counts, this changes the last one's bounds only).
        tie.reverse()
        before_inflight, before_pending, before_ttft = tie[0][:3]
        for j in range(1, tied):
            inflight, pending, ttft, own, after_inflight, after_pending, after_ttft = tie[j]
            least_inflight = (
                before_inflight if after_inflight < 0 else min(after_inflight, before_inflight)
            )
            least_pending = (
                before_pending if after_pending < 0 else min(after_pending, before_pending)
            )
            least_ttft = before_ttft if after_ttft is None else min(after_ttft, before_ttft)
            if (least_inflight, least_pending, least_ttft) != tie[j][4:]:
                bounds[j] = _bound(
                    rows[j],
                    inflight,
                    pending,
                    ttft,
                    own,
                    least_inflight,
                    least_pending,
                    least_ttft,
                    weights,
                    now_ms,
                )
            before_inflight = min(before_inflight, inflight)
            before_pending = min(before_pending, pending)
            before_ttft = min(before_ttft, ttft)
    return bounds


def _bound(
    row: InstanceRow,
    inflight: int,
    pending: int,
    ttft: int,
    own: int,
    floor_inflight: int,
    floor_pending: int,
    floor_ttft: int | None,
    weights: Weights,
    now_ms: int,
) -> tuple[int, int, int]:
    """One candidate's bounds from what the node saw of it (its counts with slack, its
    predicted TTFT and own prefill) and the least it saw on its alternatives (-1 and
    None: it has none)."""
    max_inflight = max(inflight, floor_inflight)
    max_free_at = 0
    if weights.ttft_ms > 0:
        # The requests the count bound lets it gain, each of this request's size.
        gained = (max_inflight - row.inflight) * own
        start = max(ttft, ttft if floor_ttft is None else floor_ttft) - own + gained
        max_free_at = now_ms + start
    return max_inflight, max(pending, floor_pending), max_free_at


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
