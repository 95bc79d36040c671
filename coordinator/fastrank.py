"""Vectorized least_load ranking over the node's cache, for large pools.

`strategies.least_load` is the reference: a pure function over InstanceLoad rows.
Building those rows costs O(instances) Python objects per decision, so the hot path
keeps the cache in numpy columns instead, updates only the rows a view changed, and
ranks with array arithmetic; the result (order, totals, tie rotation) is identical to
the reference, which tests/library/test_fastrank.py checks on random pools. Only the top-k
candidates are materialized as InstanceLoad rows with their Score objects.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from coordinator.models import (
    HINT_NAMES,
    MAX_PREDICTED_MS,
    InstanceLoad,
    InstanceRow,
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
    RoundRobin,
    Score,
)

Floats = npt.NDArray[np.float64]
NAN = float("nan")


def _backlog(c: dict[str, Floats], sel: slice | npt.NDArray[np.intp], now: int) -> Floats:
    """predicted_total_backlog_ms of the selected rows (NaN without a timing model)."""
    timed = c["timed"][sel] == 1.0
    infl = c["inflight"][sel]
    prefill_free = np.where(timed, np.maximum(0.0, c["prefill_free_at"][sel] - now), NAN)
    max_slots = c["max_slots"][sel]
    has_room = (max_slots <= 0) | (infl < max_slots)
    end = c["earliest_end"][sel]
    next_slot = np.where(
        has_room, 0.0, np.where(timed & ~np.isnan(end), np.maximum(0.0, end - now), NAN)
    )
    return np.maximum(prefill_free, next_slot)  # NaN if either is NaN


class ColumnarPool:
    """The cache's rows as numpy columns, in id order (the reference's tie order)."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.index: dict[str, int] = {}
        self._membership = -1
        self._cols: dict[str, Floats] = {}

    def sync(self, cache: PoolCache) -> None:
        """Bring the columns up to date with the cache: O(changed rows)."""
        if cache.membership != self._membership:
            self.ids = sorted(cache.rows)
            self.index = {iid: i for i, iid in enumerate(self.ids)}
            n = len(self.ids)
            names = (
                "inflight",
                "pending",
                "decode",
                "prefill_free_at",
                "earliest_end",
                "max_slots",
                "last_seen",
                "timed",
                "mixed",
                "weight",
                "prefill_per_token",
                "prefill_overhead",
                *HINT_NAMES,
                *(f"{h}_at" for h in HINT_NAMES),
            )
            self._cols = {name: np.full(n, NAN) for name in names}
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
        c["inflight"][i] = row.inflight
        c["pending"][i] = row.pending_prefill
        c["decode"][i] = row.active_decode
        c["prefill_free_at"][i] = row.prefill_free_at_ms
        c["earliest_end"][i] = NAN if row.earliest_end_at_ms is None else row.earliest_end_at_ms
        c["max_slots"][i] = row.max_slots
        c["last_seen"][i] = row.last_seen_ms
        c["timed"][i] = 1.0 if row.spec.has_timing else 0.0
        c["mixed"][i] = 1.0 if row.spec.role == "mixed" else 0.0
        c["weight"][i] = row.spec.weight
        c["prefill_per_token"][i] = row.spec.prefill_ms_per_token or 0.0
        c["prefill_overhead"][i] = row.spec.prefill_overhead_ms or 0.0
        for name in HINT_NAMES:
            hint = row.hints.get(name)
            c[name][i] = NAN if hint is None else hint.value
            c[f"{name}_at"][i] = NAN if hint is None else hint.at_ms

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
    ) -> tuple[list[InstanceLoad], dict[str, Score]]:
        """The reference least_load's first k candidates and their scores.

        `room_only` leaves out instances at max_slots, as if they were not eligible.
        With a `request`, the ttft_ms and prefill_ms components are scored as in the
        reference.
        """
        self.sync(cache)
        c = self._cols
        inflight, pending = c["inflight"], c["pending"]
        mask = (now - c["last_seen"] <= instance_ttl_ms) & (c["mixed"] == 1.0)
        if room_only:
            mask &= (c["max_slots"] <= 0) | (inflight < c["max_slots"])
        eligible = np.flatnonzero(mask)
        if eligible.size == 0:
            return [], {}
        # Every row eligible (the usual case): views instead of fancy-indexed copies.
        sel: slice | npt.NDArray[np.intp] = (
            slice(None) if eligible.size == len(self.ids) else eligible
        )
        infl = inflight[sel]
        backlog = _backlog(c, sel, now)
        known_pred = ~np.isnan(backlog)
        values: dict[str, Floats] = {
            "inflight": infl,
            "pending_prefill": np.where(known_pred, pending[sel], NAN),
            "active_decode": np.where(known_pred, c["decode"][sel], NAN),
            "backlog_ms": backlog,
        }
        if request is not None:
            prefill = np.where(known_pred, self._prefill_ms(c, sel, eligible, request), NAN)
            values["ttft_ms"] = backlog + prefill
            values["prefill_ms"] = prefill
        for name in INSTANTANEOUS:
            at = c[f"{name}_at"][sel]
            missing = np.isnan(at)
            if missing.all():
                values[name] = at  # all NaN: the hint is nowhere
                continue
            fresh = ~missing & (np.maximum(0.0, now - at) <= hint_ttl_ms)
            values[name] = np.where(fresh, c[name][sel], NAN)
        used = [
            name
            for names in (LIFECYCLE, INSTANTANEOUS, PREDICTED)
            for name in names
            if name in values and not np.isnan(values[name]).any()
        ]
        wmap = weights.as_dict()
        total = np.zeros(eligible.size)
        # Valid weights may overflow to inf (as in the reference's float sums).
        with np.errstate(over="ignore", invalid="ignore"):
            for name in used:
                total = total + wmap[name] * values[name]
            total = total / c["weight"][eligible]
            order = self._top(total, eligible, rr, k)
        chosen = eligible[order]
        sources = {
            layer: ("hints" if layer == "instantaneous" else "reservations")
            if any(n in used for n in names)
            else "missing"
            for layer, names in LAYERS.items()
        }
        loads: list[InstanceLoad] = []
        scores: dict[str, Score] = {}
        picked = {name: values[name][order].tolist() for name in wmap if name in values}
        totals = total[order].tolist()
        for j, i in enumerate(chosen.tolist()):
            iid = self.ids[i]
            row = cache.rows[iid]
            loads.append(
                instance_load(row, now, instance_ttl_ms=instance_ttl_ms, hint_ttl_ms=hint_ttl_ms)
            )
            raw = {name: None if math.isnan(v[j]) else v[j] for name, v in picked.items()}
            weighted = {name: wmap[name] * picked[name][j] for name in used}
            scores[iid] = Score(iid, totals[j], raw, weighted, dict(sources), wmap)
        return loads, scores

    def backlogs(
        self, cache: PoolCache, now: int, instance_ttl_ms: int, ids: Iterable[str]
    ) -> tuple[float | None, dict[str, float]]:
        """The least predicted backlog of any alive mixed instance, and the backlogs of
        `ids` (those known and alive), in ms: what the prefix hot-spot guard compares."""
        self.sync(cache)
        c = self._cols
        mask = (now - c["last_seen"] <= instance_ttl_ms) & (c["mixed"] == 1.0)
        backlog = np.where(mask, _backlog(c, slice(None), now), NAN)
        known = backlog[~np.isnan(backlog)]
        floor = float(known.min()) if known.size else None
        out = {}
        for iid in ids:
            i = self.index.get(iid)
            if i is not None and not math.isnan(backlog[i]):
                out[iid] = float(backlog[i])
        return floor, out

    def _prefill_ms(
        self,
        c: dict[str, Floats],
        sel: slice | npt.NDArray[np.intp],
        eligible: npt.NDArray[np.intp],
        request: RequestShape,
    ) -> Floats:
        """InstanceSpec.prefill_ms of each candidate's uncached prompt, as a column."""
        tokens = np.full(eligible.size, float(request.prompt_tokens))
        for iid in request.cached_tokens:  # few entries: O(log n) each
            i = self.index.get(iid)
            if i is None:
                continue
            j = int(np.searchsorted(eligible, i))
            if j < eligible.size and eligible[j] == i:
                tokens[j] = request.uncached_on(iid)
        raw = c["prefill_overhead"][sel] + c["prefill_per_token"][sel] * tokens
        return np.where(raw > 0, np.minimum(np.ceil(raw), float(MAX_PREDICTED_MS)), 0.0)

    @staticmethod
    def _top(total: Floats, eligible: npt.NDArray[np.intp], rr: RoundRobin, k: int) -> list[int]:
        """Positions of the first k: tied minimum rotated by rr, then (total, id) order."""
        best = float(total.min())
        # `==` too: when every total is inf, inf - inf is NaN and nothing would tie.
        tied = np.flatnonzero((total == best) | (total - best <= TIE_EPSILON))
        tied = tied[np.lexsort((eligible[tied], total[tied]))]
        shift = rr.take() % tied.size
        head = [int(p) for p in np.concatenate((tied[shift:], tied[:shift]))[:k]]
        need = k - len(head)
        if need <= 0:
            return head
        rest_mask = np.ones(total.size, dtype=bool)
        rest_mask[tied] = False
        rest = np.flatnonzero(rest_mask)
        if rest.size > need:
            part = np.argpartition(total[rest], need - 1)[:need]
            # argpartition may split equal totals arbitrarily; widen to every equal value.
            cutoff = total[rest][part].max()
            rest = rest[total[rest] <= cutoff]
        rest = rest[np.lexsort((eligible[rest], total[rest]))][:need]
        return head + [int(p) for p in rest]
