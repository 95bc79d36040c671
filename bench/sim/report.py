"""Run a simulation from a trace file and render it: markdown tables and JSON."""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.sim.simulator import STRATEGIES, Progress, SimConfig, StrategyResult, compare
from bench.sim.synthetic import load_requests, workload_name
from bench.sim.traces import offered_load, scale_to_utilization

BASELINE = "oracle"
# The latency metrics reported next to their ratio to the oracle, in table order.
RATIO_METRICS = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms")
# The targets for least_load's TTFT p99: (other strategy, largest ratio).
TARGETS = (("oracle", 1.25), ("local_least_inflight", 0.7), ("least_load_instantaneous", 0.8))


@dataclass(frozen=True, slots=True)
class SimRun:
    """One trace, one fleet, several strategies."""

    trace: str | None  # None: the built-in synthetic workload
    limit: int | None
    utilization: float | None  # the target; None = replayed as recorded
    offered: float  # offered load after scaling (the definition in traces.py)
    span_ms: float  # arrival span after scaling
    config: SimConfig
    results: list[StrategyResult]

    def result(self, strategy: str) -> StrategyResult | None:
        """The result of one strategy, if it ran."""
        return next((r for r in self.results if r.strategy == strategy), None)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready view, with ratios to the oracle and the target checks."""
        c = self.config
        return {
            "trace": self.trace,
            "limit": self.limit,
            "requests": self.results[0].requests if self.results else 0,
            "utilization_target": self.utilization,
            "offered_utilization": self.offered,
            "span_ms": self.span_ms,
            "config": {
                "instances": c.instances,
                "nodes": c.nodes,
                "hint_interval_ms": c.hint_interval_ms,
                "hint_ttl_ms": c.hint_ttl_ms,
                "expected_output": c.expected_output,
                "initial_expected_output": c.initial_expected_output,
                "max_slots": c.registered_max_slots,
                "seed": c.seed,
                "timing": {name: getattr(c.timing, name) for name in c.timing.__dataclass_fields__},
                "weights": c.weights.as_dict(),
            },
            "results": [r.as_dict() for r in self.results],
            "ratios_to_oracle": ratios(self.results),
            "targets": [
                {"vs": other, "limit": limit, "ratio": ratio, "met": met}
                for other, limit, ratio, met in target_checks(self.results)
            ],
        }


def run_trace(
    trace: str | Path | None,
    *,
    utilization: float | None = 0.8,
    limit: int | None = None,
    strategies: Sequence[str] = STRATEGIES,
    config: SimConfig | None = None,
    progress: Progress | None = None,
) -> SimRun:
    """Load a trace (None: the synthetic workload), scale it to `utilization` (None: as
    recorded) and compare strategies."""
    config = config or SimConfig()
    requests = load_requests(trace, limit, config.seed)
    if utilization is not None:
        requests = scale_to_utilization(requests, config.timing, config.capacity, utilization)
    offered = (
        offered_load(requests, config.timing, config.capacity) if len(requests) > 1 else math.nan
    )
    results = compare(requests, strategies, config, progress)
    span = requests[-1].arrival_ms - requests[0].arrival_ms
    name = None if trace is None else str(trace)
    return SimRun(name, limit, utilization, offered, span, config, results)


def ratios(results: Sequence[StrategyResult]) -> dict[str, dict[str, float]]:
    """Each strategy's metrics divided by the oracle's (empty without an oracle run)."""
    base = next((r for r in results if r.strategy == BASELINE), None)
    if base is None:
        return {}
    return {
        r.strategy: {name: _ratio(getattr(r, name), getattr(base, name)) for name in RATIO_METRICS}
        for r in results
    }


def target_checks(results: Sequence[StrategyResult]) -> list[tuple[str, float, float, bool]]:
    """(other, limit, least_load p99 / other p99, met) for each target both sides ran."""
    by_name = {r.strategy: r for r in results}
    mine = by_name.get("least_load")
    out: list[tuple[str, float, float, bool]] = []
    if mine is None:
        return out
    for other, limit in TARGETS:
        if other in by_name:
            ratio = _ratio(mine.ttft_p99_ms, by_name[other].ttft_p99_ms)
            out.append((other, limit, ratio, ratio <= limit))
    return out


def json_ready(value: Any) -> Any:
    """NaN (a metric with no sample) becomes None, recursively: JSON has no NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_ready(v) for v in value]
    return value


def _ratio(value: float, base: float) -> float:
    return value / base if base > 0 else math.nan


def _ms(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:,.0f}"


def _cell(value: float, base: float | None) -> str:
    if base is None or base <= 0 or math.isnan(value):
        return _ms(value)
    return f"{_ms(value)} ({value / base:.2f}x)"


def markdown_table(results: Sequence[StrategyResult]) -> str:
    """One row per strategy; latency cells carry their ratio to the oracle."""
    base = next((r for r in results if r.strategy == BASELINE), None)
    lines = [
        "| strategy | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | e2e p50 ms | e2e p99 ms "
        "| mean queue wait ms | imbalance | completed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        latencies = " | ".join(
            _cell(getattr(r, name), getattr(base, name) if base else None) for name in RATIO_METRICS
        )
        lines.append(
            f"| {r.strategy} | {latencies} | {_ms(r.queue_wait_mean_ms)} "
            f"| {r.imbalance:.3f} | {r.completed}/{r.requests} |"
        )
    return "\n".join(lines)


def markdown_targets(results: Sequence[StrategyResult]) -> str:
    """The issue's least_load targets, measured (reported, never asserted)."""
    lines = []
    for other, limit, ratio, met in target_checks(results):
        verdict = "met" if met else "missed"
        lines.append(
            f"- least_load TTFT p99 / {other} TTFT p99 = **{ratio:.2f}** "
            f"(target ≤ {limit:.2f}: {verdict})"
        )
    return "\n".join(lines)


def describe(run: SimRun) -> str:
    """One line of what was simulated."""
    c = run.config
    n = run.results[0].requests if run.results else 0
    util = "as recorded" if run.utilization is None else f"{run.utilization:g}"
    return (
        f"{n} requests from {workload_name(run.trace, c.seed)}"
        f"{f' (the first {run.limit})' if run.trace and run.limit and n >= run.limit else ''}, "
        f"utilization {util} "
        f"(offered {run.offered:.3f}, arrivals over {run.span_ms / 1000:,.1f} s), "
        f"{c.instances} instances, {c.nodes} nodes, hints every {c.hint_interval_ms:g} ms, "
        f"expected output `{c.expected_output}`, max_slots {c.registered_max_slots}, "
        f"seed {c.seed}"
    )


def markdown(run: SimRun, command: Sequence[str] | None = None) -> str:
    """A full markdown report of one run: what, the table, the targets, the command."""
    parts = [describe(run) + ".", "", markdown_table(run.results)]
    targets = markdown_targets(run.results)
    if targets:
        parts += ["", targets]
    if command:
        parts += ["", f"Regenerate: `{shlex.join(command)}`"]
    return "\n".join(parts)
