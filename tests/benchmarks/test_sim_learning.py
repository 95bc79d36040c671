"""The simulator's mixed fleet: instances of different true speeds, registered with no
timing or with one wrong shared timing; the nodes learn each one's speed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.sim.simulator import SimConfig, Simulation, simulate
from bench.sim.synthetic import SyntheticWorkload, synthetic_requests
from bench.sim.traces import scale_to_utilization
from coordinator.settings import Weights

SPEEDS = (0.5, 1.0, 2.0)


@pytest.mark.parametrize("registered", ["none", "shared"])
def test_least_load_learns_every_instance_speed(registered: str) -> None:
    config = SimConfig(
        instances=6,
        nodes=3,
        speeds=SPEEDS,
        registered_timing=registered,
        learn=True,
        expected_output="true",
        weights=Weights.preset("ttft"),
    )
    requests = scale_to_utilization(
        synthetic_requests(1500, 0), config.timing, config.capacity, 0.8
    )
    sim = Simulation(requests, "least_load", config)
    result = sim.run()
    assert result.completed == len(requests)
    for k, spec in enumerate(sim.specs):
        true = config.engine_timing(k).prefill_ms_per_token
        source = sim.state.row(spec.id).timing
        assert source is not None and source.prefill == "learned", spec.id
        assert spec.prefill_ms_per_token == pytest.approx(true, rel=0.15), spec.id
    # The 0.5x instances get less work than the 2x ones: the learned speeds are used.
    slow, fast = result.assigned[0], result.assigned[2]
    assert slow < fast


def test_without_learning_an_unregistered_fleet_predicts_with_the_defaults() -> None:
    config = SimConfig(instances=3, speeds=SPEEDS, registered_timing="none")
    requests = synthetic_requests(50, 0)
    sim = Simulation(requests, "least_load", config)
    sim.run()
    assert {sim.state.row(s.id).timing.prefill for s in sim.specs} == {"default"}  # type: ignore[union-attr]
    assert {s.prefill_ms_per_token for s in sim.specs} == {config.timing.prefill_ms_per_token}


def test_capacity_counts_speeds() -> None:
    assert SimConfig(instances=4, speeds=SPEEDS).capacity == 0.5 + 1 + 2 + 0.5
    assert replace(SimConfig(), instances=3).capacity == 3
    with pytest.raises(ValueError):
        SimConfig(speeds=(0.0,))
    with pytest.raises(ValueError):
        SimConfig(registered_timing="maybe")


def test_slow_instances_are_not_overloaded_while_they_have_few_samples() -> None:
    """Issue 15's code-trace miss, on a synthetic trace of the same shape (long prompts,
    short outputs, bursts): under load only wait-free requests teach prefill, so the
    slow instances stay below `min_samples` for long. Predicted with the pool's average
    (the fast ones' speed) they looked fast and took the p99 (1.33x the oracle before
    the fix); scaled by their own few samples, least_load stays near the oracle."""
    config = SimConfig(
        instances=6,
        nodes=3,
        speeds=SPEEDS,
        registered_timing="none",
        learn=True,
        expected_output="true",
        weights=Weights.preset("ttft"),
        # Fresh views: this is about what the score predicts with, not how old the
        # rows it ranks are (NodeView; with the nodes' default ages least_load's p99
        # here is ~1.33x the oracle's).
        snapshot_max_age_ms=0,
        live_refresh_ms=0,
    )
    workload = SyntheticWorkload(
        prompt_median=2000, output_median=16, prompt_range=(16, 4096), output_range=(1, 384)
    )
    requests = scale_to_utilization(workload.requests(2000, 0), config.timing, config.capacity, 0.8)
    sim = Simulation(requests, "least_load", config)
    p99 = {s: simulate(requests, s, config).ttft_p99_ms for s in ("oracle", "local_least_inflight")}
    p99["least_load"] = sim.run().ttft_p99_ms
    assert p99["least_load"] <= 1.2 * p99["oracle"], p99
    assert p99["least_load"] <= 0.7 * p99["local_least_inflight"], p99
    # What the score saw for the slowest 1%: their instance's prefill speed, not a
    # borrowed one (the pool average had them at well under half the true ms/token).
    tail = sim.tail()
    assert tail.requests == 20 and sum(tail.by_speed.values()) == 20
    assert sum(tail.sources.values()) == 20 and set(tail.sources) <= {"learned", "scaled"}
    assert 0.75 <= tail.predicted_over_true <= 1.25, tail
