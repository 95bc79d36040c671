"""`coordinator bench`: benchmarks, one module per sub-subcommand, loaded on demand."""

from __future__ import annotations

import argparse

from coordinator_cli.main import add_module_parsers

# name -> (module, one-line help). Each module defines
#   add_arguments(parser: argparse.ArgumentParser) -> None
#   run(args: argparse.Namespace) -> int
BENCHES: dict[str, tuple[str, str]] = {
    "sim": (
        "bench.sim.cli",
        "Simulate every strategy over a trace (discrete-event, deterministic).",
    ),
    "live": (
        "bench.live",
        "Replay a trace slice through a real local cluster per strategy; compare with the sim.",
    ),
    "herding": (
        "bench.herding",
        "Simultaneous bursts from K node processes onto idle instances: the spread.",
    ),
    "overhead": (
        "bench.decision_overhead",
        "Decision cost (snapshot + score + reserve) against instance and node count.",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One nested subparser per benchmark."""
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    add_module_parsers(sub, BENCHES, "_bench_module")


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark."""
    return int(args._bench_module.run(args))
