"""bench/scaling.py's stall scenario at a tiny scale: long work runs in bounded steps.

No timing is asserted: the durations the benchmark reports depend on the machine.
What must hold anywhere is the shape of the work: reaping and sweeping take several
calls of at most one step (coordinator.coordinator.REAP_STEP, SWEEP_STEP) each, a re-assert
restores one reservation per call, a new node reads a big pool's specs in steps
(SPEC_READ_STEP), and a timing flush merges TIMING_STEP instances' samples per call.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

from bench.scaling import Scale, _stalls
from coordinator.coordinator import REAP_STEP, SPEC_READ_STEP, SWEEP_STEP, TIMING_STEP
from local_fleet.embedded import EmbeddedRedis
from tests.helpers import private_server

pytestmark = pytest.mark.real


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    """A private server: the scenario changes SLOWLOG settings."""
    with private_server() as server:
        yield server


async def test_stall_scenario_runs_long_work_in_bounded_steps(server: EmbeddedRedis) -> None:
    scale = Scale(
        instances=2 * SWEEP_STEP + 50,
        reservations=5 * SWEEP_STEP,
        dead_node=2 * SWEEP_STEP + 100,
        one_instance=2 * SWEEP_STEP + 100,
        reassert=40,
        churned=300,
        spec_changes=10,
        releases=20,
    )
    ops = {x["op"].split(".")[0]: x for x in await _stalls(server.url, scale)}
    assert set(ops) == {"a", "b", "c", "d", "e", "f0", "f", "g", "h"}
    # A new node reads every spec in steps of at most SPEC_READ_STEP instances.
    assert ops["a"]["steps"]["read_specs"] >= math.ceil(scale.instances / SPEC_READ_STEP)
    # The dead node's reservations go in steps of REAP_STEP (the scenario checks all went).
    assert ops["c"]["steps"] == {"reap_node": math.ceil(scale.dead_node / REAP_STEP)}
    # Unregister voids at once and sweeps one step; the lease loop sweeps the rest.
    assert ops["d"]["steps"]["unregister"] == 1
    assert ops["d"]["steps"]["sweep"] >= math.ceil(scale.one_instance / SWEEP_STEP) - 1
    # A timing flush with samples of every instance merges TIMING_STEP of them per call.
    assert ops["g"]["steps"]["merge_timing"] >= math.ceil(scale.instances / TIMING_STEP)
    # Every instance's failure record is read a page per call.
    assert ops["h"]["steps"]["read_outliers"] > 1
    # Re-assert: one restore per reservation made while degraded.
    assert ops["e"]["steps"]["restore"] == scale.reassert
    # After churn the small pool is read in one step each, as before it.
    assert ops["f"]["steps"] == ops["f0"]["steps"] == {"read_state": 1, "read_specs": 1}
    assert ops["f"]["keys"]["spec"] == 10
    assert ops["f"]["keys"]["retired"] == 0
