"""Engine hints count beyond the fleet's own reservations (lua/_lib.lua
store_hint_args, coordinator/models.py beyond_reservations, the simulator's mirror):
the score adds the reservations themselves, so a raw engine count would weigh each of
the fleet's requests twice, and a report scraped during a burst would keep an idle
instance looking busy until the next scrape."""

from __future__ import annotations

from bench.sim.shared_state import SharedState
from coordinator import Coordinator
from coordinator.models import InstanceSpec, beyond_reservations
from coordinator.settings import Weights
from coordinator.strategies import RoundRobin, least_load
from tests.conftest import MakeCoordinator
from tests.helpers import spec


def test_reservations_count_against_running_first_then_waiting() -> None:
    both = {"engine_running": 5.0, "engine_waiting": 2.0, "queue_depth": 4.0}
    assert beyond_reservations(both, 3) == {
        "engine_running": 2.0,
        "engine_waiting": 2.0,
        "queue_depth": 4.0,  # the fleet's own count: unchanged
    }
    assert beyond_reservations(both, 6) == {**both, "engine_running": 0.0, "engine_waiting": 1.0}
    assert beyond_reservations(both, 9)["engine_waiting"] == 0.0  # never below 0
    assert beyond_reservations({"engine_waiting": 2.0}, 1) == {"engine_waiting": 1.0}
    assert beyond_reservations({"engine_running": 2.5}, 1) == {"engine_running": 1.5}
    assert beyond_reservations(both, 0) == both


async def rows_read_afresh(make: MakeCoordinator, node: str) -> dict[str, object]:
    """The instances' loads as a node that reads the pool afresh sees them."""
    reader = await make(node)
    return {row.id: row for row in (await reader.snapshot()).rows}


async def test_stored_hints_are_beyond_the_reservations_and_raw_ones_stay_readable(
    make_coordinator: MakeCoordinator,
) -> None:
    c = await make_coordinator("n1")
    await c.register_instance(spec(0))
    for _ in range(3):
        await c.reserve(10, 10)
    await c.heartbeat_instance("i0", {"engine_running": 5, "engine_waiting": 2})
    row = (await rows_read_afresh(make_coordinator, "n2"))["i0"]
    assert (row.engine_running, row.engine_waiting) == (2.0, 2.0)  # type: ignore[attr-defined]
    # What the engine said stays in the hints hash, for redis-cli.
    hints = c.keys.column("hints")
    assert await c.redis.hget(hints, "i0:engine_running") == "5"
    assert await c.redis.hget(hints, "i0:engine_running_beyond") == "2"
    # A report the reservations explain whole leaves nothing; so does the scraper's.
    await c.store_hints("i0", {"engine_running": 3, "engine_waiting": 0, "queue_depth": 1})
    row = (await rows_read_afresh(make_coordinator, "n3"))["i0"]
    assert (row.engine_running, row.engine_waiting, row.queue_depth) == (0.0, 0.0, 1.0)  # type: ignore[attr-defined]
    # The simulator's mirror agrees.
    mirror = SharedState()
    mirror.register(InstanceSpec(id="i0", url="http://127.0.0.1:9000"), 0)
    for k in range(3):
        mirror.reserve(f"r{k}", "n1", "i0", 10, 10, 1, 1, 0)
    mirror.heartbeat("i0", 0, {"engine_running": 5, "engine_waiting": 2})
    assert {k: h.value for k, h in mirror.row("i0").hints.items()} == {
        "engine_running": 2.0,
        "engine_waiting": 2.0,
    }


async def test_a_report_from_a_finished_burst_does_not_make_its_instance_look_busy(
    make_coordinator: MakeCoordinator,
) -> None:
    """The burst's two requests ran when the engine was scraped; both have ended since.
    With raw hints i0 would rank below the idle i1 until the next scrape."""
    c: Coordinator = await make_coordinator("n1")
    await c.register_instance(spec(0))
    burst = [await c.reserve(10, 10) for _ in range(2)]
    assert {res.instance_id for res in burst} == {"i0"}
    await c.store_hints("i0", {"engine_running": 2, "engine_waiting": 0})
    await c.register_instance(spec(1))
    await c.store_hints("i1", {"engine_running": 0, "engine_waiting": 0})
    for res in burst:
        await c.release(res.rid)
    rows = await rows_read_afresh(make_coordinator, "n2")
    ranking = least_load(list(rows.values()), Weights(), RoundRobin())  # type: ignore[arg-type]
    totals = {iid: score.total for iid, score in ranking.scores.items()}
    assert totals["i0"] == totals["i1"]
