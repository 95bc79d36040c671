"""Discrete-event simulation of proxy nodes, shared reservations and engines.

`coordinator bench sim` (bench/sim/cli.py) and bench/sim_report.py drive it.
"""

from __future__ import annotations

from bench.sim.report import SimRun, run_trace
from bench.sim.shared_state import SharedState
from bench.sim.simulator import STRATEGIES, SimConfig, StrategyResult, compare, simulate
from bench.sim.traces import TraceError, TraceRequest, load_trace, scale_to_utilization

__all__ = [
    "STRATEGIES",
    "SharedState",
    "SimConfig",
    "SimRun",
    "StrategyResult",
    "TraceError",
    "TraceRequest",
    "compare",
    "load_trace",
    "run_trace",
    "scale_to_utilization",
    "simulate",
]
