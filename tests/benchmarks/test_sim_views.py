"""A simulated node decides on its own view of the shared state (NodeView), as a real
node's PoolCache holds it: peers' changes arrive with the next whole read, its own
with its scripts' replies, hints with a liveness read (issue 16's live deviation)."""

from __future__ import annotations

from bench.sim.shared_state import NodeView, SharedState
from bench.sim.simulator import SimConfig, Simulation
from bench.sim.traces import TraceRequest
from tests.helpers import spec


def _state() -> SharedState:
    state = SharedState()
    for k in range(2):
        state.register(spec(k), 0)
    return state


def test_a_view_sees_a_peers_reservation_only_when_it_reads_again() -> None:
    state = _state()
    view = NodeView(state, max_age_ms=1000, live_refresh_ms=2000)
    view.ensure(0)
    state.reserve("peer", "n2", "i0", 100, 10, 15, 100, 10)
    view.ensure(500)  # 500 ms old: still fit to decide on
    assert view.rows["i0"].inflight == 0
    # Its own reserve's reply: that instance's record now, peers' work included.
    state.reserve("own", "n1", "i0", 100, 10, 15, 100, 600)
    view.patch("i0")
    assert view.rows["i0"].inflight == 2
    state.reserve("peer2", "n2", "i1", 100, 10, 15, 100, 700)
    view.ensure(1000)
    assert view.rows["i1"].inflight == 0
    view.ensure(1001)  # older than max_age_ms: read again
    assert view.rows["i1"].inflight == 1
    # The reserve script's check of an unforced candidate, on the state as it is.
    assert state.within("i1", 1, 1) and not state.within("i1", 0, 1)
    assert not state.within("i0", 2, 1) and state.inflight("i0") == 2
    assert state.row("i1").prefill_free_at_ms == 715  # peer2's prefill, from 700


def test_hints_reach_a_view_only_with_a_liveness_read() -> None:
    state = _state()
    view = NodeView(state, max_age_ms=1000, live_refresh_ms=2000)
    view.ensure(0)
    state.heartbeat("i0", 100, {"engine_running": 3})
    view.read(1500)  # a whole read without liveness (a 'stale' reply)
    assert view.rows["i0"].hints == {} and view.rows["i0"].inflight == 0
    view.ensure(1999)
    assert view.rows["i0"].hints == {}
    view.ensure(2000)  # liveness due
    assert view.rows["i0"].hints["engine_running"].value == 3


def test_views_of_age_zero_are_the_state_at_every_decision() -> None:
    requests = [TraceRequest(i, 40.0 * i, 500 + 100 * (i % 7), 5 + i % 3) for i in range(60)]

    def reads(config: SimConfig) -> list[int]:
        sim = Simulation(requests, "least_load", config)
        sim.run()
        return [node.view.reads for node in sim.nodes if node.view is not None]

    fresh = reads(SimConfig(instances=3, nodes=2, snapshot_max_age_ms=0, live_refresh_ms=0))
    assert fresh == [30, 30]  # one read per decision: 60 arrivals over 2 nodes
    # Views kept a second: one read per second of a node's decisions (80 ms apart).
    aged = reads(SimConfig(instances=3, nodes=2, snapshot_max_age_ms=1000, live_refresh_ms=2000))
    assert all(2 <= n <= 4 for n in aged), aged
