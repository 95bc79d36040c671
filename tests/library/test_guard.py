"""The bounds a node sends with its candidates (coordinator/guard.py), as pure math."""

from __future__ import annotations

from coordinator.guard import guard_bounds
from coordinator.models import InstanceRow, RequestShape
from coordinator.settings import Weights
from tests.helpers import spec

NOW = 1_000_000


def row(i: int, inflight: int, pending: int, free_at: int, per_token: float) -> InstanceRow:
    return InstanceRow(
        id=f"i{i}",
        spec=spec(i, prefill_ms_per_token=per_token, prefill_overhead_ms=5.0),
        epoch=1,
        last_seen_ms=NOW,
        max_slots=0,
        inflight=inflight,
        pending_prefill=pending,
        active_decode=inflight - pending,
        prefill_free_at_ms=free_at,
        earliest_end_at_ms=None,
    )


# Best first as a node ranked them: i0 idle and fast (own prefill of 100 tokens 10 ms),
# i1 busy until NOW + 20 (own 15 ms: TTFT 35), i2 until NOW + 5 (own 15: TTFT 20).
ROWS = [row(0, 0, 0, NOW - 50, 0.05), row(1, 2, 1, NOW + 20, 0.1), row(2, 1, 1, NOW + 5, 0.1)]


def test_bounds_are_what_the_node_saw_raised_to_the_best_alternative_after_it() -> None:
    bounds = guard_bounds(ROWS, RequestShape(100, 10), Weights.preset("ttft"), NOW)
    # Counts: own, raised to the least later (i0: 0 -> 1 live, 0 -> 1 prefilling).
    # Free-at: the start that keeps the TTFT within max(own, the shortest later), less
    # its own prefill, plus the prefill of the requests its count bound lets it gain:
    # i0 may start by NOW + 20 - 10 + 1 x 10, i1 by NOW + 35 - 15 (its own TTFT is the
    # longer; no gain), i2 by NOW + 20 - 15 (the last: its own).
    assert bounds == [(1, 1, NOW + 20), (2, 1, NOW + 20), (1, 1, NOW + 5)]


def test_weights_that_do_not_rank_on_ttft_send_no_free_at_bound() -> None:
    bounds = guard_bounds(ROWS, RequestShape(100, 10), Weights.preset("seed"), NOW)
    assert bounds == [(1, 1, 0), (2, 1, 0), (1, 1, 0)]


def test_a_cached_prefix_counts_only_the_uncached_prefill() -> None:
    """i1 holds 90 of the 100 tokens: its own prefill is 6 ms (TTFT 26), so it may
    gain requests (affinity slack) and its bound starts from the shorter prefill."""
    request = RequestShape(100, 10, {"i1": 90})
    bounds = guard_bounds(ROWS, request, Weights.preset("ttft"), NOW)
    slack = bounds[1][0] - 2
    assert slack > 0 and bounds[1][1] == 1 + slack
    assert bounds[1][2] == NOW + 26 - 6 + slack * 6  # the requests it may gain, at 6 ms
    assert bounds[0] == (1, 1, NOW + 20)  # the shortest later TTFT is still i2's 20


def test_a_hot_prefix_holder_is_bounded_by_its_share_whatever_its_slack() -> None:
    """The bounded loads' bound (CachedTokens.most_inflight) caps the holder's counts:
    the node's view may show it idle while other nodes just gave it requests."""
    from coordinator.prefix import CachedTokens

    plain = RequestShape(100, 10, {"i1": 90})
    capped = RequestShape(100, 10, CachedTokens({"i1": 90}, most_inflight={"i1": 1}))
    weights = Weights.preset("ttft")
    slack = guard_bounds(ROWS, plain, weights, NOW)[1]
    assert slack[0] > 2 and slack[1] > 1  # the slack alone lets it gain requests
    # Capped at 1 in flight, raised to the least later candidate's count (i2: 1).
    assert guard_bounds(ROWS, capped, weights, NOW)[1][:2] == (1, 1)


def test_a_tied_candidate_is_bounded_by_the_rest_of_the_tie() -> None:
    """The script visits a tie from the pool's turn, so any tied candidate may come
    first: each one's alternatives are the whole rest of the tie, not only the tied
    ones sent after it. Untied, the last of the two is raised to the third's count."""
    rows = [row(0, 2, 2, 0, 0.1), row(1, 2, 2, 0, 0.1), row(2, 4, 4, 0, 0.1)]
    seed = Weights.preset("seed")
    assert guard_bounds(rows, RequestShape(100, 10), seed, NOW) == [
        (2, 2, 0),
        (4, 4, 0),
        (4, 4, 0),
    ]
    assert guard_bounds(rows, RequestShape(100, 10), seed, NOW, ties=2) == [
        (2, 2, 0),
        (2, 2, 0),
        (4, 4, 0),
    ]
    # A tie of equal scores need not be one of equal counts (other layers, weights):
    # the last of the pool, with nothing after it, is raised to the one before it.
    unequal = [row(0, 3, 3, 0, 0.1), row(1, 2, 2, 0, 0.1)]
    assert guard_bounds(unequal, RequestShape(100, 10), seed, NOW, ties=2) == [
        (3, 3, 0),
        (3, 3, 0),
    ]
