"""The vectorized ranker must equal the reference least_load on any pool state."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.fastrank import ColumnarPool
from coordinator.models import Hint, InstanceLoad, InstanceRow, InstanceSpec, RequestShape
from coordinator.pressure import instance_load
from coordinator.settings import Weights
from coordinator.snapshot import PoolCache
from coordinator.strategies import TIE_EPSILON, RoundRobin, eligible, least_load

NOW = 1_000_000
TTL, HINT_TTL = 10_000, 5_000

hint = st.one_of(
    st.none(),
    st.builds(
        Hint,
        st.sampled_from([0.0, 1.0, 2.0, 3.5]),
        st.sampled_from([NOW, NOW - 100, NOW - HINT_TTL, NOW - HINT_TTL - 1]),
    ),
)


@st.composite
def rows(draw: st.DrawFn) -> list[InstanceRow]:
    n = draw(st.integers(1, 12))
    return [draw(row(i)) for i in range(n)]


@st.composite
def row(draw: st.DrawFn, i: int) -> InstanceRow:
    """Instance `i` in any state: role, weight, timing, counters, liveness, hints."""
    timed = draw(st.booleans())
    spec = InstanceSpec(
        id=f"i{i:02d}",
        url="http://127.0.0.1:1",
        role=draw(st.sampled_from(["mixed", "mixed", "mixed", "prefill"])),
        weight=draw(st.sampled_from([1.0, 1.0, 2.0])),
        prefill_ms_per_token=draw(st.sampled_from([0.1, 0.37, 2.0])) if timed else None,
        prefill_overhead_ms=draw(st.sampled_from([None, 0.0, 12.5])) if timed else None,
        decode_ms_per_token=10.0 if timed else None,
    )
    inflight = draw(st.integers(0, 4))
    pending = draw(st.integers(0, inflight))
    hints = {}
    for name in ("engine_running", "engine_waiting", "queue_depth"):
        h = draw(hint)
        if h is not None:
            hints[name] = h
    return InstanceRow(
        id=spec.id,
        spec=spec,
        epoch=1,
        last_seen_ms=draw(st.sampled_from([NOW, NOW - TTL, NOW - TTL - 1])),
        max_slots=draw(st.sampled_from([0, 2, 4])),
        inflight=inflight,
        pending_prefill=pending,
        active_decode=inflight - pending,
        prefill_free_at_ms=NOW + draw(st.sampled_from([-50, 0, 30, 120])),
        earliest_end_at_ms=draw(st.sampled_from([None, NOW - 5, NOW + 40])),
        hints=hints,
    )


WEIGHTS = st.sampled_from(
    [
        Weights(),
        Weights(backlog_ms=0.0),
        Weights(inflight=0.0),
        # Valid weights whose totals overflow to inf on some or every candidate.
        Weights(engine_waiting=1e300, inflight=1.7e308, pending_prefill=1.7e308),
        Weights(inflight=1.7e308, backlog_ms=1.7e308),
        Weights(ttft_ms=1.0),
        Weights(ttft_ms=1.0, backlog_ms=0.0, inflight=0.01, pending_prefill=0.0),
        Weights(ttft_ms=0.2, prefill_ms=0.2, backlog_ms=0.0),
        Weights(prefill_ms=1.0, inflight=0.0),
    ]
)
REQUESTS = st.one_of(
    st.none(),
    st.builds(
        RequestShape,
        st.sampled_from([0, 1, 197, 4096]),
        st.sampled_from([1, 384]),
        st.dictionaries(
            st.sampled_from([f"i{i:02d}" for i in range(14)]),
            st.sampled_from([-3, 0, 64, 197, 5000]),
            max_size=4,
        ),
    ),
)


def pool_cache(pool_rows: list[InstanceRow]) -> PoolCache:
    """A node's view holding these rows."""
    cache = PoolCache()
    cache.rows = {r.id: r for r in pool_rows}
    cache.membership = 1
    return cache


def eligible_loads(pool_rows: list[InstanceRow], room_only: bool) -> list[InstanceLoad]:
    """The rows the reference least_load ranks (with room, when `room_only`)."""
    adjusted = [instance_load(r, NOW, instance_ttl_ms=TTL, hint_ttl_ms=HINT_TTL) for r in pool_rows]
    return [
        r
        for r in eligible(adjusted)
        if not room_only or r.max_slots <= 0 or (r.inflight or 0) < r.max_slots
    ]


def assert_ranks_like_reference(
    columns: ColumnarPool,
    cache: PoolCache,
    rr_start: int,
    k: int,
    weights: Weights,
    request: RequestShape | None,
    room_only: bool,
    drawn: list[int] | None = None,
) -> None:
    """The fast ranking of the cache's rows equals the reference on the same rows; with
    `drawn` (positions among the eligible rows), on those of them a sample of
    len(drawn) takes when there are more eligible rows."""
    pool_rows = list(cache.rows.values())
    fast_rr, ref_rr = RoundRobin(rr_start), RoundRobin(rr_start)
    sample = len(drawn) if drawn else 0
    ranking = columns.rank_least_load(
        cache,
        NOW,
        weights,
        fast_rr,
        instance_ttl_ms=TTL,
        hint_ttl_ms=HINT_TTL,
        k=k,
        room_only=room_only,
        request=request,
        sample=sample,
        rng=Drawn(drawn) if drawn else None,  # type: ignore[arg-type]
    )
    candidates = eligible_loads(pool_rows, room_only)
    if drawn and len(candidates) > sample:
        candidates = [candidates[j] for j in sorted(drawn)]
    ref = least_load(candidates, weights, ref_rr, request=request)
    fast, fast_scores = ranking.ranked, ranking.scores
    assert [r.id for r in fast] == [r.id for r in ref.ranked[:k]]
    assert (ranking.tied, ranking.strategy) == (ref.tied, ref.strategy)
    assert list(fast) == ref.ranked[:k]
    assert ranking.for_reserve(k)[0] == [r.id for r in ref.ranked[:k]]
    for r in fast:
        assert fast_scores[r.id] == ref.scores[r.id]
    assert fast_rr.counter == ref_rr.counter


# A pool, the rotation's start, k, the weights, the request and room_only.
RANKED = (rows(), st.integers(0, 20), st.integers(1, 6), WEIGHTS, REQUESTS, st.booleans())


@settings(max_examples=300, deadline=None)
@given(*RANKED, st.booleans())
def test_fast_ranking_equals_reference(
    pool_rows: list[InstanceRow],
    rr_start: int,
    k: int,
    weights: Weights,
    request: RequestShape | None,
    room_only: bool,
    partition: bool,
) -> None:
    cache = pool_cache(pool_rows)
    columns = ColumnarPool()
    if partition:  # the large-pool path: a partition, then a sort of the few first
        columns.sort_all_below = 0
    assert_ranks_like_reference(columns, cache, rr_start, k, weights, request, room_only)


class Drawn:
    """A stand-in for numpy's Generator whose choice() draws these positions."""

    def __init__(self, positions: list[int]) -> None:
        self.positions = positions

    def choice(self, count: int, size: int, replace: bool) -> np.ndarray:
        assert size == len(self.positions) < count and not replace
        return np.array(self.positions)


@settings(max_examples=200, deadline=None)
@given(*RANKED, st.permutations(range(12)), st.integers(1, 11))
def test_sampled_ranking_equals_reference_on_the_drawn_rows(
    pool_rows: list[InstanceRow],
    rr_start: int,
    k: int,
    weights: Weights,
    request: RequestShape | None,
    room_only: bool,
    order: list[int],
    size: int,
) -> None:
    """A sample (a view far behind: Settings.stale_sample) ranks exactly the drawn
    eligible rows, as the reference ranks them; with no more eligible rows than the
    sample, all of them."""
    count = len(eligible_loads(pool_rows, room_only))
    drawn = [j for j in order if j < count][: min(size, max(count - 1, 1))]
    assert_ranks_like_reference(
        ColumnarPool(),
        pool_cache(pool_rows),
        rr_start,
        k,
        weights,
        request,
        room_only,
        drawn or None,
    )


@st.composite
def edits(draw: st.DrawFn) -> tuple[list[InstanceRow], list[list[InstanceRow]]]:
    """A pool, then rounds of changed rows (same ids): counters, timing, hints, roles;
    some keep their spec and hints objects, as a row rebuilt for a counter change does."""
    pool_rows = draw(rows())
    current = list(pool_rows)
    rounds = []
    for _ in range(draw(st.integers(1, 3))):
        changed = []
        for i in draw(st.sets(st.integers(0, len(pool_rows) - 1))):
            new = draw(row(i))
            if draw(st.booleans()):
                new = replace(new, spec=current[i].spec)
            if draw(st.booleans()):
                new = replace(new, hints=current[i].hints)
            current[i] = new
            changed.append(new)
        rounds.append(changed)
    return pool_rows, rounds


@settings(max_examples=200, deadline=None)
@given(edits(), st.integers(1, 6), WEIGHTS, REQUESTS, st.booleans())
def test_columns_kept_across_changes_rank_like_reference(
    changes: tuple[list[InstanceRow], list[list[InstanceRow]]],
    k: int,
    weights: Weights,
    request: RequestShape | None,
    room_only: bool,
) -> None:
    """What the columns keep between decisions (derived per row, the prefill column of
    the last prompt size, hint counts) follows every changed row."""
    pool_rows, rounds = changes
    cache = pool_cache(pool_rows)
    columns = ColumnarPool()
    assert_ranks_like_reference(columns, cache, 0, k, weights, request, room_only)
    for rr_start, changed in enumerate(rounds, 1):
        for r in changed:
            cache.rows[r.id] = r
            cache.dirty.add(r.id)
        assert_ranks_like_reference(columns, cache, rr_start, k, weights, request, room_only)


def test_incremental_sync_tracks_changes() -> None:
    cache = PoolCache()
    spec = InstanceSpec(id="a", url="http://127.0.0.1:1")
    row = InstanceRow("a", spec, 1, NOW, 0, 0, 0, 0, NOW, None)
    cache.rows = {
        "a": row,
        "b": InstanceRow(
            "b", InstanceSpec(id="b", url="http://127.0.0.1:2"), 1, NOW, 0, 1, 1, 0, NOW, None
        ),
    }
    cache.membership = 1
    columns = ColumnarPool()
    rr = RoundRobin()
    first = columns.rank_least_load(
        cache, NOW, Weights(), rr, instance_ttl_ms=TTL, hint_ttl_ms=HINT_TTL, k=1
    ).ranked
    assert first[0].id == "a"
    cache.rows["a"] = InstanceRow("a", spec, 1, NOW, 0, 5, 5, 0, NOW, None)
    cache.dirty.add("a")
    second = columns.rank_least_load(
        cache, NOW, Weights(), rr, instance_ttl_ms=TTL, hint_ttl_ms=HINT_TTL, k=1
    ).ranked
    assert second[0].id == "b"
    assert cache.dirty == set()


def test_every_total_inf_ranks_like_the_reference() -> None:
    """engine_waiting=1e300 with huge hints: every total is inf, and all of them tie."""
    pool_rows = []
    for i in range(3):
        spec = InstanceSpec(id=f"i{i}", url="http://127.0.0.1:1")
        hints = {"engine_waiting": Hint(1e300, NOW)}
        pool_rows.append(InstanceRow(spec.id, spec, 1, NOW, 0, i, 0, i, NOW, None, hints))
    cache = PoolCache()
    cache.rows = {r.id: r for r in pool_rows}
    cache.membership = 1
    weights = Weights(engine_waiting=1e300)
    adjusted = [instance_load(r, NOW, instance_ttl_ms=TTL, hint_ttl_ms=HINT_TTL) for r in pool_rows]
    columns = ColumnarPool()
    firsts = set()
    for start in range(3):
        ranking = columns.rank_least_load(
            cache, NOW, weights, RoundRobin(start), instance_ttl_ms=TTL, hint_ttl_ms=HINT_TTL, k=3
        )
        fast, fast_scores = ranking.ranked, ranking.scores
        ref = least_load(eligible(adjusted), weights, RoundRobin(start))
        assert ranking.tied == ref.tied == 3
        assert [r.id for r in fast] == [r.id for r in ref.ranked]
        assert all(fast_scores[r.id].total == float("inf") for r in fast)
        firsts.add(fast[0].id)
    assert firsts == {"i0", "i1", "i2"}, "tied at inf: the rotation spreads the choice"


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from([0.3, 0.1 + 0.2, 0.3 + 1e-9, 1.0, 7.5, float("inf")]), min_size=1),
    st.integers(0, 50),
    st.integers(1, 8),
    st.booleans(),
)
def test_top_k_orders_like_the_reference(
    totals: list[float], rr_start: int, k: int, partition: bool
) -> None:
    """Ties within TIE_EPSILON that are not equal sort by (total, id) before rotating."""
    columns = ColumnarPool()
    if partition:
        columns.sort_all_below = 0
    known = sorted(range(len(totals)), key=lambda p: (totals[p], p))
    best = totals[known[0]]
    tied = [p for p in known if totals[p] == best or totals[p] - best <= TIE_EPSILON]
    shift = rr_start % len(tied)
    expected = (tied[shift:] + tied[:shift] + known[len(tied) :])[:k]
    with np.errstate(invalid="ignore"):  # inf - inf, as in rank_least_load
        top, tied_count = columns._top(np.array(totals), RoundRobin(rr_start), k)
    assert top.tolist() == expected
    assert tied_count == len(tied)
