"""Selection strategies: pure functions from snapshot rows to a ranked choice.

They know nothing of HTTP or Redis. The round-robin state is a small object the
caller keeps per pool; randomness comes from a `random.Random` the caller owns.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import overload

from coordinator.models import InstanceLoad, RequestShape
from coordinator.settings import Weights

LIFECYCLE = ("inflight",)
INSTANTANEOUS = ("engine_running", "engine_waiting", "queue_depth")
# ttft_ms (backlog + this request's own uncached prefill) and prefill_ms (that prefill
# alone: the engine time the request adds to the candidate, which every request
# queued behind it there waits for) exist only when the ranking is given the request
# (RequestShape); without one they are never components.
PREDICTED = ("pending_prefill", "active_decode", "backlog_ms", "ttft_ms", "prefill_ms")
LAYERS = {"lifecycle": LIFECYCLE, "instantaneous": INSTANTANEOUS, "predicted": PREDICTED}
TIE_EPSILON = 1e-9


@dataclass(slots=True)
class RoundRobin:
    """A per-pool rotation for round_robin and for breaking ties.

    By default the rotation is a counter taken modulo the size of the tie: in the
    fleet's normal mode the reserve script walks a tie round the pool by slot anyway
    (`Ranking.for_reserve`), and the node only picks which candidates to send. With
    `turns`, each turn starts at the first id after the one the previous turn started
    with: a node ranking on its own counts (degraded mode) changes the tie from call
    to call, and a counter modulo its size then favours some members and starves
    others (one engine of four got 5% of the requests). `counter` is also where the
    first turn starts (a node's own offset, so nodes do not all start alike).
    """

    counter: int = 0
    turns: bool = False
    last: str | None = None  # with `turns`: the id the previous turn started with

    def take(self) -> int:
        """Return the current position and advance."""
        value = self.counter
        self.counter += 1
        return value

    def turn(self, ids: Sequence[str]) -> int:
        """Where a turn over `ids` (sorted, at least one) starts: the first after
        `last`, wrapping round (the first turn: at the counter); noted as `last`."""
        if self.last is None:
            k = self.take() % len(ids)
        else:
            k = bisect.bisect_right(ids, self.last)
            if k == len(ids):
                k = 0
        self.last = ids[k]
        return k


@dataclass(frozen=True, slots=True)
class Score:
    """An explainable least_load score of one candidate."""

    instance_id: str
    total: float | None
    components: dict[str, float | None]
    weighted_components: dict[str, float]
    sources: dict[str, str]
    weights: dict[str, float]

    def as_dict(self) -> dict[str, object]:
        """JSON-ready view."""
        return {
            "instance_id": self.instance_id,
            "total": self.total,
            "components": self.components,
            "weighted_components": self.weighted_components,
            "sources": self.sources,
            "weights": self.weights,
        }


class LazyLoads(Sequence[InstanceLoad]):
    """Ranked rows, each built when first read.

    A reservation needs the candidates' ids and one row (the chosen one's, for its
    score); building the other k - 1 InstanceLoad rows was a third of a decision's
    ranking. `/debug/instance_loads` reads them all.
    """

    def __init__(self, ids: list[str], build: Callable[[int], InstanceLoad]) -> None:
        self.ids = ids
        self._build = build
        self._built: dict[int, InstanceLoad] = {}

    @overload
    def __getitem__(self, index: int) -> InstanceLoad: ...

    @overload
    def __getitem__(self, index: slice) -> list[InstanceLoad]: ...

    def __getitem__(self, index: int | slice) -> InstanceLoad | list[InstanceLoad]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self.ids)))]
        j = range(len(self.ids))[index]  # IndexError and negative indices as a list's
        load = self._built.get(j)
        if load is None:
            load = self._built[j] = self._build(j)
        return load

    def __len__(self) -> int:
        return len(self.ids)


def ranked_ids(ranked: Sequence[InstanceLoad]) -> list[str]:
    """The ids of ranked rows in order, without building lazy ones."""
    if isinstance(ranked, LazyLoads):
        return ranked.ids
    return [row.id for row in ranked]


@dataclass(frozen=True, slots=True)
class Ranking:
    """Candidates best-first, with the score of every candidate that was scored."""

    ranked: Sequence[InstanceLoad]
    scores: Mapping[str, Score] = field(default_factory=dict)
    strategy: str = "least_load"
    # How many candidates lead tied for the best score (the rotated tied minimum): the
    # score cannot tell them apart. 1 when the ranking knows of no tie.
    tied: int = 1

    @property
    def choice(self) -> InstanceLoad | None:
        """The best candidate, or None when there is none."""
        return self.ranked[0] if self.ranked else None

    def for_reserve(self, k: int) -> tuple[list[str], int]:
        """The ids of the first k candidates for reserve.lua, and how many of them
        lead tied.

        The script walks a least_load tie in one turn round the pool (lua/reserve.lua
        ARGV[11]), where each node's own rotation would send several nodes' concurrent
        or successive picks to the same idle instance. Other strategies' orders are
        kept as ranked (0 ties).
        """
        candidates = ranked_ids(self.ranked)[:k]
        ties = min(self.tied, len(candidates)) if self.strategy == "least_load" else 0
        return candidates, ties if ties >= 2 else 0


def crowded_last(
    rank_without: Callable[[frozenset[str]], Ranking], crowded: frozenset[str], k: int
) -> tuple[list[str], int, Mapping[str, Score]]:
    """The first k candidates for reserve (`Ranking.for_reserve`), those of `crowded`
    after the others, each part as ranked; how many lead tied; and the scores of
    both parts. `rank_without(ids)` ranks the candidates but those `ids`.

    A hot prefix's request passes the instances over their share by (coordinator/
    prefix.py CachedTokens.crowded), but keeps them as the last candidates: reserve's
    walk, on Redis's counts, falls back on them when every other got busier than the
    node saw. Leaving them out would hand a node whose view shows one instance within
    its share (one that just became the least routed at every node) a single
    candidate, forced on it whatever its load now."""
    ranking = rank_without(crowded)
    first, ties = ranking.for_reserve(k)
    if not crowded or len(first) >= k:
        return first, ties, ranking.scores
    others = rank_without(frozenset(first))
    rest, rest_ties = others.for_reserve(k - len(first))
    return first + rest, ties if first else rest_ties, {**others.scores, **ranking.scores}


def eligible(rows: Sequence[InstanceLoad], role: str = "mixed") -> list[InstanceLoad]:
    """Alive rows that can serve a whole request (role `mixed` by default)."""
    return [r for r in rows if r.alive and r.role == role]


def _raw_components(row: InstanceLoad, request: RequestShape | None) -> dict[str, float | None]:
    raw: dict[str, float | None] = {
        "inflight": row.inflight,
        "engine_running": row.engine_running,
        "engine_waiting": row.engine_waiting,
        "queue_depth": row.queue_depth,
        "pending_prefill": row.pending_prefill_count
        if row.predicted_total_backlog_ms is not None
        else None,
        "active_decode": row.active_decode_count
        if row.predicted_total_backlog_ms is not None
        else None,
        "backlog_ms": row.predicted_total_backlog_ms,
    }
    if request is not None:
        uncached = request.uncached_on(row.id)
        raw["ttft_ms"] = row.predicted_ttft_ms(uncached)
        raw["prefill_ms"] = (
            None if row.predicted_total_backlog_ms is None else row.spec.prefill_ms(uncached)
        )
    return raw


def score_rows(
    rows: Sequence[InstanceLoad],
    weights: Weights,
    *,
    use_hints: bool = True,
    use_predicted: bool = True,
    request: RequestShape | None = None,
) -> dict[str, Score]:
    """Score candidates with the three-layer least_load model.

    With a `request`, the predicted layer gains `ttft_ms`: the candidate's backlog
    plus its own predicted prefill of the request's uncached prompt tokens, and
    `prefill_ms`: that prefill alone. `ttft_ms` is what this request waits; the
    prefill is also engine time every later request on the candidate waits behind,
    so a candidate holding the prompt's prefix is worth more than the wait it saves.

    A component enters the totals only when it is known for every candidate whose
    lifecycle is known, so candidates are always compared on the same terms: one
    instance with a stale hint drops that hint for the whole decision rather than
    looking artificially idle (missing is never zero).
    """
    raws = {row.id: _raw_components(row, request) for row in rows}
    known = [raw for raw in raws.values() if raw["inflight"] is not None]
    allowed = set(LIFECYCLE)
    if use_hints:
        allowed.update(INSTANTANEOUS)
    if use_predicted:
        allowed.update(PREDICTED)
    used = [
        name
        for names in LAYERS.values()
        for name in names
        if name in allowed and known and all(raw.get(name) is not None for raw in known)
    ]
    weight_map = weights.as_dict()
    layer_sources = {}
    for layer, names in LAYERS.items():
        if any(name in used for name in names):
            layer_sources[layer] = "hints" if layer == "instantaneous" else "reservations"
        else:
            layer_sources[layer] = "missing"
    scores: dict[str, Score] = {}
    for row in rows:
        raw = raws[row.id]
        if raw["inflight"] is None:
            scores[row.id] = Score(
                row.id, None, raw, {}, {k: "missing" for k in LAYERS}, weight_map
            )
            continue
        weighted = {name: weight_map[name] * float(raw[name] or 0.0) for name in used}
        total = sum(weighted.values()) / row.weight
        scores[row.id] = Score(row.id, total, raw, weighted, dict(layer_sources), weight_map)
    return scores


def _rank_by_score(
    rows: Sequence[InstanceLoad], scores: dict[str, Score], rr: RoundRobin
) -> tuple[list[InstanceLoad], int]:
    """Order by total; the tied minimum rotates (rr); unknown totals go last (rotated
    when no total is known). Also returns the size of the tied minimum (1 when none is
    known)."""
    if not rows:
        return [], 1
    known = sorted(
        (r for r in rows if scores[r.id].total is not None),
        key=lambda r: (scores[r.id].total, r.id),
    )
    unknown = sorted((r for r in rows if scores[r.id].total is None), key=lambda r: r.id)
    if not known:
        return _turn(unknown, rr), 1
    best = scores[known[0].id].total or 0.0

    def ties(total: float) -> bool:
        # `==` too: when every total is inf, inf - inf is NaN and nothing would tie.
        return total == best or total - best <= TIE_EPSILON

    tied = [r for r in known if ties(scores[r.id].total or 0.0)]
    rest = known[len(tied) :]
    if rr.turns:  # a turn goes by id (a counter's rotation keeps the (total, id) order)
        tied.sort(key=lambda r: r.id)
    return _turn(tied, rr) + rest + unknown, len(tied)


def _turn(items: list[InstanceLoad], rr: RoundRobin) -> list[InstanceLoad]:
    """`items` from where rr's rotation starts (its counter, or with `turns` its
    turn), wrapping round."""
    if not items:
        return items
    # A counter's rotation needs no ids: a large tie's list of them costs a decision.
    k = rr.turn([r.id for r in items]) if rr.turns else rr.take() % len(items)
    return items[k:] + items[:k]


def least_load(
    rows: Sequence[InstanceLoad],
    weights: Weights,
    rr: RoundRobin,
    *,
    use_hints: bool = True,
    use_predicted: bool = True,
    request: RequestShape | None = None,
) -> Ranking:
    """Rank candidates by the least_load score (DESIGN.md §3), best first."""
    scores = score_rows(
        rows, weights, use_hints=use_hints, use_predicted=use_predicted, request=request
    )
    ranked, tied = _rank_by_score(rows, scores, rr)
    return Ranking(ranked, scores, "least_load", tied)


def round_robin(
    rows: Sequence[InstanceLoad],
    weights: Weights,
    rr: RoundRobin,
    request: RequestShape | None = None,
) -> Ranking:
    """Rotate through the candidates in id order; scores are attached for explanation."""
    ordered = sorted(rows, key=lambda r: r.id)
    scores = score_rows(rows, weights, request=request)
    return Ranking(_turn(ordered, rr), scores, "round_robin")


def power_of_two(
    rows: Sequence[InstanceLoad],
    weights: Weights,
    rr: RoundRobin,
    rng: random.Random,
    request: RequestShape | None = None,
) -> Ranking:
    """Sample two candidates at random, then rank them by least_load score."""
    sample = rng.sample(list(rows), 2) if len(rows) > 2 else list(rows)
    scores = score_rows(sample, weights, request=request)
    return Ranking(_rank_by_score(sample, scores, rr)[0], scores, "power_of_two")


def rank(
    name: str,
    rows: Sequence[InstanceLoad],
    weights: Weights,
    rr: RoundRobin,
    rng: random.Random,
    request: RequestShape | None = None,
) -> Ranking:
    """Dispatch to a strategy by name."""
    if name == "least_load":
        return least_load(rows, weights, rr, request=request)
    if name == "round_robin":
        return round_robin(rows, weights, rr, request)
    if name == "power_of_two":
        return power_of_two(rows, weights, rr, rng, request)
    raise ValueError(f"unknown strategy {name!r}")
