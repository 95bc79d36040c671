"""A node whose view is behind the pool: lua/reserve.lua still takes the least busy.

Nodes read each other's reservations only every so often, so a node's view counts at
most what Redis holds. The bounds a node sends (coordinator/guard.py) compare each
candidate with the ones ranked after it; the script must also compare it with the
ones it visited before it and passed over. A two-node burst found the gap: one node,
behind by one on its first candidate and by two on its second, took the second, with
4 live reservations, over the first, with 3 (3, 4, 4, 5 on four instances).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator import InstanceSpec
from coordinator.guard import guard_bounds
from coordinator.models import InstanceRow, RequestShape
from coordinator.packed import pack_candidate
from coordinator.settings import Weights
from tests.conftest import MakeCoordinator
from tests.helpers import counters, spec

INSTANCES = 4
MOST = 4  # live reservations per instance before the decision


# The seed's weights send no free-at bound; the default `ttft` preset sends one. With
# no prefill predicted anywhere (every TTFT the same) both rank on counts.
PRESETS = ("seed", "ttft")


def _spec(i: int) -> InstanceSpec:
    return spec(i, prefill_ms_per_token=0.0, prefill_overhead_ms=0.0)


def _row(i: int, inflight: int) -> InstanceRow:
    return InstanceRow(
        id=f"i{i}",
        spec=_spec(i),
        epoch=1,
        last_seen_ms=0,
        max_slots=0,
        inflight=inflight,
        pending_prefill=inflight,
        active_decode=0,
        prefill_free_at_ms=0,
        earliest_end_at_ms=None,
    )


def _candidates(views: list[int], preset: str, now_ms: int) -> tuple[int, list[object]]:
    """The tie and the candidate pairs as a node ranks on counts (fewest first; the
    tied ones in slot order, as Coordinator._slot_ordered sends them) with the bounds
    it sends under the preset's weights at Redis time `now_ms`."""
    rows = sorted((_row(i, v) for i, v in enumerate(views)), key=lambda r: (r.inflight, r.id))
    ties = sum(row.inflight == rows[0].inflight for row in rows)
    ties = ties if ties >= 2 else 0
    request = RequestShape(10, 10)
    bounds = guard_bounds(rows, request, Weights.preset(preset), now_ms, ties=ties)
    args: list[object] = []
    for row, (max_inflight, max_pending, max_free_at) in zip(rows, bounds, strict=True):
        slot = int(row.id[1:])  # registered in this order
        prefill = row.spec.prefill_ms(request.prompt_tokens)
        args += [row.id, pack_candidate(slot, prefill, 100, max_inflight, max_pending, max_free_at)]
    return ties, args


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    live=st.lists(st.integers(0, MOST), min_size=INSTANCES, max_size=INSTANCES),
    behind=st.lists(st.integers(0, MOST), min_size=INSTANCES, max_size=INSTANCES),
    turn=st.integers(-1, INSTANCES - 1),
)
@pytest.mark.parametrize("preset", PRESETS)
async def test_a_view_behind_still_takes_an_instance_with_the_fewest_reservations(
    make_coordinator: MakeCoordinator, preset: str, live: list[int], behind: list[int], turn: int
) -> None:
    """Whatever the pool holds, however far behind the node's view is on each
    instance, and wherever the pool's turn round a tie stands (meta tie_last: the
    walk visits tied candidates from the slot after it), the reserve takes one with
    the fewest live reservations now: with every TTFT the same, a burst from any
    number of nodes stays within one. (Where TTFTs differ, one with fewer
    reservations behind a longer prefill queue need not be the better choice.)"""
    c = await make_coordinator("n1")
    everyone = {f"i{i}" for i in range(INSTANCES)}
    for i in range(INSTANCES):
        await c.register_instance(_spec(i))  # again each example: keeps the counters
    held = [
        await c.reserve(10, 10, exclude=everyone - {f"i{i}"})
        for i, n in enumerate(live)
        for _ in range(n)
    ]
    try:
        views = [max(0, n - lag) for n, lag in zip(live, behind, strict=True)]
        await c.redis.hset(c.keys.column("meta"), "tie_last", turn)
        seconds, micros = await c.redis.time()
        ties, candidates = _candidates(views, preset, seconds * 1000 + micros // 1000)
        header = ["r-stale", "n1", 10, 10, 0, 0, 600_000, 600_000, "", INSTANCES, ties, ""]
        reply = await c._direct_call("reserve", [*header, *candidates], (c.keys.node_rids("n1"),))
        assert reply[0] == "ok", reply
        assert live[int(reply[1][1:])] == min(live), (live, views, reply[1])
    finally:
        await c.release("r-stale")
        for reservation in held:
            await c.release(reservation.rid)
    assert sum((await counters(c))["inflight"].values()) == 0
