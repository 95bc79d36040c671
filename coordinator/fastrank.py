"""Vectorized least_load ranking over the node's cache, for large pools.

`strategies.least_load` is the reference: a pure function over InstanceLoad rows.
Building those rows costs O(instances) Python objects per decision, so the hot path
keeps the cache in numpy columns instead, updates only the rows a view changed, and
ranks with array arithmetic; the result (order, totals, tie rotation) is identical to
the reference, which tests/library/test_fastrank.py checks on random pools. Of the top-k
candidates only the ids are taken; an InstanceLoad row and its Score are built when
read (a reservation reads the chosen one's).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping

import numpy as np
import numpy.typing as npt

from coordinator.models import (
    HINT_NAMES,
    MAX_PREDICTED_MS,
    Hint,
    InstanceLoad,
    InstanceRow,
    InstanceSpec,
    RequestShape,
)
from coordinator.pressure import instance_load
from coordinator.settings import Weights
from coordinator.snapshot import PoolCache
from coordinator.strategies import (
    INSTANTANEOUS,
    LAYERS,
    LIFECYCLE,
    PREDICTED,
    TIE_EPSILON,
    LazyLoads,
    Ranking,
    RoundRobin,
    Score,
)

Floats = npt.NDArray[np.float64]
Bools = npt.NDArray[np.bool_]
Positions = npt.NDArray[np.intp]
NAN = float("nan")
# Float columns, one entry per instance in id order. `due` is the Redis time the
# instance's predicted backlog ends (NaN when it cannot be predicted): what the
# reference derives from the timing model, the slot count and the two cursors,
# folded per row when the row changes, so a decision only subtracts `now`.
FLOAT_COLUMNS = (
    "inflight",
    "started",
    "pending",
    "decode",
    "last_seen",
    "weight",
    "prefill_per_token",
    "prefill_overhead",
    "due",
    *HINT_NAMES,
    *(f"{h}_at" for h in HINT_NAMES),
)


class ColumnarPool:
    """The cache's rows as numpy columns, in id order (the reference's tie order).

    Everything that depends only on the rows (not on `now` or the request) is kept
    per row and updated with the rows a view changed, so a decision costs a few
    array operations whatever the pool size.
    """

    # Below this many candidates one stable sort is cheaper than a partition.
    sort_all_below = 256

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.index: dict[str, int] = {}
        self._membership = -1
        self._cols: dict[str, Floats] = {}
        self._mixed: Bools = np.zeros(0, dtype=bool)
        self._room: Bools = np.zeros(0, dtype=bool)
        self._hinted = dict.fromkeys(HINT_NAMES, 0)  # rows holding each hint
        self._weighted = 0  # rows whose weight is not 1 (x / 1.0 is x: no division)
        # Rows that are not `mixed`, that have no room, whose `due` is unknown: while
        # all three are 0 and every row is alive, a decision needs no mask at all.
        self._not_mixed = self._no_room = self._unknown_due = 0
        # What each row's spec and hint columns were set from: a row rebuilt for a
        # counter change keeps both objects, and their columns stay as they are.
        self._set_from: list[tuple[InstanceSpec | None, dict[str, Hint] | None]] = []
        self._prefill: tuple[int, Floats] | None = None  # (prompt tokens, prefill ms)
        self._wmap: tuple[Weights, dict[str, float]] | None = None

    def sync(self, cache: PoolCache) -> None:
        """Bring the columns up to date with the cache: O(changed rows)."""
        if cache.membership != self._membership:
            self.ids = sorted(cache.rows)
            self.index = {iid: i for i, iid in enumerate(self.ids)}
            n = len(self.ids)
            self._cols = {name: np.full(n, NAN) for name in FLOAT_COLUMNS}
            self._mixed = np.zeros(n, dtype=bool)
            self._room = np.zeros(n, dtype=bool)
            self._hinted = dict.fromkeys(HINT_NAMES, 0)
            self._weighted = 0
            self._not_mixed = self._no_room = self._unknown_due = n  # as initialized
            self._set_from = [(None, None)] * n
            self._prefill = None
            self._membership = cache.membership
            dirty = set(self.ids)
        else:
            dirty = cache.dirty
        for iid in dirty:
            i = self.index.get(iid)
            row = cache.rows.get(iid)
            if i is not None and row is not None:
                self._set_row(i, row)
        cache.dirty = set()

    def _set_row(self, i: int, row: InstanceRow) -> None:
        c = self._cols
        spec = row.spec
        c["inflight"][i] = row.inflight
        c["started"][i] = row.started
        c["pending"][i] = row.pending_prefill
        c["decode"][i] = row.active_decode
        c["last_seen"][i] = row.last_seen_ms
        room = row.max_slots <= 0 or row.inflight < row.max_slots
        self._no_room += (not room) - (not self._room[i])
        self._room[i] = room
        # backlog = max(prefill_free, next_slot) of pressure.instance_load, as one time:
        # max(0, due - now) with due the later of the prefill cursor and, when no slot
        # is free, the earliest end; unknown without a timing model or an end.
        due = NAN
        if spec.has_timing:
            if room:
                due = float(row.prefill_free_at_ms)
            elif row.earliest_end_at_ms is not None:
                due = float(max(row.prefill_free_at_ms, row.earliest_end_at_ms))
        self._unknown_due += math.isnan(due) - math.isnan(c["due"][i])
        c["due"][i] = due
        old_spec, old_hints = self._set_from[i]
        self._set_from[i] = (spec, row.hints)
        if spec is not old_spec:
            self._weighted += (spec.weight != 1.0) - (
                old_spec is not None and old_spec.weight != 1.0
            )
            c["weight"][i] = spec.weight
            mixed = spec.role == "mixed"
            self._not_mixed += (not mixed) - (not self._mixed[i])
            self._mixed[i] = mixed
            per_token = spec.prefill_ms_per_token or 0.0
            overhead = spec.prefill_overhead_ms or 0.0
            if c["prefill_per_token"][i] != per_token or c["prefill_overhead"][i] != overhead:
                c["prefill_per_token"][i] = per_token
                c["prefill_overhead"][i] = overhead
                self._prefill = None
        if row.hints is old_hints:
            return
        for name in HINT_NAMES:
            hint = row.hints.get(name)
            at = c[f"{name}_at"]
            self._hinted[name] += (hint is not None) - (not math.isnan(at[i]))
            c[name][i] = NAN if hint is None else hint.value
            at[i] = NAN if hint is None else hint.at_ms

    def _weights(self, weights: Weights) -> dict[str, float]:
        """weights.as_dict(), kept while the same Weights object is passed."""
        if self._wmap is None or self._wmap[0] is not weights:
            self._wmap = (weights, weights.as_dict())
        return self._wmap[1]

    def rank_least_load(
        self,
        cache: PoolCache,
        now: int,
        weights: Weights,
        rr: RoundRobin,
        *,
        instance_ttl_ms: int,
        hint_ttl_ms: int,
        k: int,
        room_only: bool = False,
        request: RequestShape | None = None,
        sample: int = 0,
        rng: np.random.Generator | None = None,
    ) -> Ranking:
        """The reference least_load's first k candidates, their scores and its tie.

        `room_only` leaves out instances at max_slots, as if they were not eligible.
        With a `request`, the ttft_ms and prefill_ms components are scored as in the
        reference. With `sample` (and `rng`), at most that many eligible instances,
        drawn at random, are ranked: the reference's ranking of that subset.
        """
        self.sync(cache)
        c = self._cols
        n = len(self.ids)
        # Every row eligible (the usual case): no mask, and views instead of copies.
        every = (
            n > 0
            and self._not_mixed == 0
            and (not room_only or self._no_room == 0)
            and now - c["last_seen"].min() <= instance_ttl_ms
        )
        eligible: Positions | None = None
        sel: slice | Positions = slice(None)
        count = n
        if not every:
            mask = self._alive_mixed(now, instance_ttl_ms)
            if room_only:
                mask &= self._room
            count = int(np.count_nonzero(mask))
            if count == 0:
                return Ranking([], {}, "least_load")
            if count < n:
                eligible = np.flatnonzero(mask)
                sel = eligible
        if sample and count > sample and rng is not None:
            # Positions stay in id order: a stable sort by total is the (total, id) order.
            drawn = rng.choice(count, sample, replace=False)
            eligible = np.sort(drawn if eligible is None else eligible[drawn])
            sel, count = eligible, sample
        backlog = np.maximum(0.0, c["due"][sel] - now)  # NaN where unknown
        complete = {"inflight": True}
        values: dict[str, Floats] = {"inflight": c["inflight"][sel]}
        if eligible is None and self._unknown_due == 0:
            predicted = True
        else:
            predicted = int(np.count_nonzero(np.isnan(backlog))) == 0
        if predicted:
            values["pending_prefill"] = c["pending"][sel]
            values["active_decode"] = c["decode"][sel]
            values["backlog_ms"] = backlog
        ttft: Floats | None = None
        prefill: Floats | None = None
        if request is not None:
            prefill = self._prefill_ms(request)[sel]
            ttft = backlog + prefill
            if predicted:
                values["ttft_ms"] = ttft
                values["prefill_ms"] = prefill
        for name in PREDICTED:
            complete[name] = predicted and name in values
        for name in INSTANTANEOUS:
            complete[name] = False
            if self._hinted[name] < count:
                continue  # some candidate has no such hint at all
            hint = c[name][sel]
            # NaN (no hint) compares False: a missing hint is never fresh.
            fresh = np.maximum(0.0, now - c[f"{name}_at"][sel]) <= hint_ttl_ms
            if int(np.count_nonzero(fresh)) == count:
                complete[name] = True
                values[name] = hint
        used = [
            name
            for names in (LIFECYCLE, INSTANTANEOUS, PREDICTED)
            for name in names
            if complete[name]
        ]
        wmap = self._weights(weights)
        total: Floats | None = None
        # Valid weights may overflow to inf (as in the reference's float sums).
        with np.errstate(over="ignore", invalid="ignore"):
            for name in used:
                w = wmap[name]
                if w == 0.0:
                    continue  # adds 0.0: every value is finite
                term = values[name] if w == 1.0 else w * values[name]
                total = term if total is None else total + term
            if total is None:
                total = np.zeros(count)
            if self._weighted:
                total = total / c["weight"][sel]
            order, tied = self._top(total, rr, k)
        chosen = order if eligible is None else eligible[order]
        ids = [self.ids[i] for i in chosen.tolist()]
        totals = total[order].tolist()
        ttfts = ttft[order].tolist() if ttft is not None else None
        prefills = prefill[order].tolist() if prefill is not None else None
        rows = [cache.rows[iid] for iid in ids]  # as ranked: later views replace rows

        def load_of(j: int) -> InstanceLoad:
            return instance_load(
                rows[j], now, instance_ttl_ms=instance_ttl_ms, hint_ttl_ms=hint_ttl_ms
            )

        loads = LazyLoads(ids, load_of)

        def score(j: int) -> Score:
            load = loads[j]
            raw = _raw(
                load,
                None if ttfts is None else ttfts[j],
                None if prefills is None else prefills[j],
            )
            weighted = {name: wmap[name] * raw[name] for name in used}  # type: ignore[operator]
            sources = {
                layer: ("hints" if layer == "instantaneous" else "reservations")
                if any(n in used for n in names)
                else "missing"
                for layer, names in LAYERS.items()
            }
            # The score's own copy of the weights: the kept one is never handed out.
            return Score(load.id, totals[j], raw, weighted, sources, dict(wmap))

        return Ranking(loads, LazyScores(ids, score), "least_load", tied)

    def backlogs(
        self, cache: PoolCache, now: int, instance_ttl_ms: int, ids: Iterable[str]
    ) -> tuple[float | None, dict[str, float]]:
        """The least predicted backlog of any alive mixed instance, and the backlogs of
        `ids` (those known and alive), in ms: what the prefix hot-spot guard compares."""
        self.sync(cache)
        c = self._cols
        mask = self._alive_mixed(now, instance_ttl_ms)
        backlog = np.where(mask, np.maximum(0.0, c["due"] - now), NAN)
        known = backlog[~np.isnan(backlog)]
        floor = float(known.min()) if known.size else None
        out = {}
        for iid in ids:
            i = self.index.get(iid)
            if i is not None and not math.isnan(backlog[i]):
                out[iid] = float(backlog[i])
        return floor, out

    def bounded_loads(
        self, cache: PoolCache, now: int, instance_ttl_ms: int
    ) -> tuple[dict[str, float], dict[str, int]]:
        """Requests in flight and `started` counters per alive mixed instance: what the
        bounded-loads rule for hot prefixes compares (coordinator/prefix.py
        `idle_fleet_room`, `RecentStarts`)."""
        self.sync(cache)
        rows = np.flatnonzero(self._alive_mixed(now, instance_ttl_ms)).tolist()
        ids = [self.ids[i] for i in rows]
        inflight = self._cols["inflight"][rows].tolist()
        started = self._cols["started"][rows].astype(np.int64).tolist()
        return dict(zip(ids, inflight, strict=True)), dict(zip(ids, started, strict=True))

    def _alive_mixed(self, now: int, instance_ttl_ms: int) -> Bools:
        """The rows seen within the liveness TTL that serve both phases."""
        return (now - self._cols["last_seen"] <= instance_ttl_ms) & self._mixed

    def _prefill_ms(self, request: RequestShape) -> Floats:
        """InstanceSpec.prefill_ms of each row's uncached prompt, as a column (kept for
        the last prompt size until a timing model changes)."""
        tokens = request.prompt_tokens
        if self._prefill is None or self._prefill[0] != tokens:
            c = self._cols
            raw = c["prefill_overhead"] + c["prefill_per_token"] * float(tokens)
            column = np.where(raw > 0, np.minimum(np.ceil(raw), float(MAX_PREDICTED_MS)), 0.0)
            self._prefill = (tokens, column)
        column = self._prefill[1]
        if not request.cached_tokens:
            return column
        column = column.copy()
        c = self._cols
        for iid in request.cached_tokens:
            i = self.index.get(iid)
            if i is None:
                continue
            raw = c["prefill_overhead"][i] + c["prefill_per_token"][i] * float(
                request.uncached_on(iid)
            )
            column[i] = min(np.ceil(raw), float(MAX_PREDICTED_MS)) if raw > 0 else 0.0
        return column

    def _top(self, total: Floats, rr: RoundRobin, k: int) -> tuple[Positions, int]:
        """Positions of the first k: tied minimum rotated by rr, then (total, id) order;
        and the size of the tied minimum.

        Positions are in id order, so a stable sort by total is the (total, id) order,
        and the tied minimum is a prefix of it.
        """
        n = total.size
        best = total.min()
        lowest = total == best
        # `==` too: when every total is inf, inf - inf is NaN and nothing would tie.
        tied_mask = lowest | (total - best <= TIE_EPSILON)
        tied = int(np.count_nonzero(tied_mask))
        shift = rr.take() % tied
        if tied >= k:  # the first k are tied ones: sort only those
            if int(np.count_nonzero(lowest)) == tied:  # all equal (idle ones): id order
                ties = np.flatnonzero(lowest)
            else:
                ties = np.flatnonzero(tied_mask)
                ties = ties[np.argsort(total[ties], kind="stable")]
            return ties.take(np.arange(shift, shift + k), mode="wrap"), tied
        if n <= k or n < self.sort_all_below:
            ordered = np.argsort(total, kind="stable")[:k]
        else:
            cutoff = total[np.argpartition(total, k - 1)[k - 1]]
            # Every total up to the k-th smallest, equal ones included, in id order.
            near = np.flatnonzero(total <= cutoff)
            ordered = near[np.argsort(total[near], kind="stable")[:k]]
        if shift:
            ordered = np.concatenate((ordered[shift:tied], ordered[:shift], ordered[tied:]))
        return ordered, tied


class LazyScores(Mapping[str, Score]):
    """The candidates' scores, each built when first read: a reservation keeps only
    the chosen one's, while /debug/instance_loads reads them all."""

    def __init__(self, ids: list[str], build: Callable[[int], Score]) -> None:
        self._ids = ids  # k of them: a list search is cheaper than building a dict
        self._build = build
        self._built: dict[str, Score] = {}

    def __getitem__(self, iid: str) -> Score:
        score = self._built.get(iid)
        if score is None:
            try:
                j = self._ids.index(iid)
            except ValueError:
                raise KeyError(iid) from None
            score = self._built[iid] = self._build(j)
        return score

    def __iter__(self) -> Iterator[str]:
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


def _raw(load: InstanceLoad, ttft: float | None, prefill: float | None) -> dict[str, float | None]:
    """The reference's raw components of one candidate (strategies._raw_components),
    as floats; `ttft` and `prefill` are its ttft_ms and prefill_ms column values (None
    without a request)."""
    backlog = load.predicted_total_backlog_ms
    known = backlog is not None
    raw: dict[str, float | None] = {
        "inflight": float(load.inflight or 0),
        "engine_running": load.engine_running,
        "engine_waiting": load.engine_waiting,
        "queue_depth": load.queue_depth,
        "pending_prefill": float(load.pending_prefill_count or 0) if known else None,
        "active_decode": float(load.active_decode_count or 0) if known else None,
        "backlog_ms": float(backlog) if backlog is not None else None,
    }
    if ttft is not None:
        raw["ttft_ms"] = ttft if known else None
        raw["prefill_ms"] = prefill if known else None
    return raw
