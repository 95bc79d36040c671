"""`coordinator bench sim`: replay a trace through the simulator, compare strategies."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence

from bench.sim.report import json_ready, markdown, run_trace
from bench.sim.simulator import (
    ALL_STRATEGIES,
    EXPECTED_OUTPUT_MODES,
    REGISTERED_TIMING,
    STRATEGIES,
    SimConfig,
)
from bench.sim.synthetic import DEFAULT_REQUESTS
from bench.sim.traces import TraceError
from coordinator.errors import InvalidArgumentError
from coordinator.settings import DEFAULT_WEIGHTS, Settings, Weights


def strategy_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type: a comma list of names from `choices`, or 'all'."""

    def parse(text: str) -> list[str]:
        names = [s.strip() for s in text.split(",") if s.strip()]
        if names == ["all"]:
            return list(choices)
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown strategies {unknown}; choose from {', '.join(choices)} or 'all'"
            )
        return names

    return parse


_strategies = strategy_list(ALL_STRATEGIES)


def _weights(text: str) -> Weights:
    try:
        return Weights.parse(text)
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """--trace and --utilization, the same for `bench sim` and `bench live`."""
    parser.add_argument(
        "--trace",
        default=None,
        help="trace file: Azure CSV or JSONL (see the README for public traces); default: "
        "the built-in synthetic workload (bench/sim/synthetic.py), drawn from --seed",
    )
    parser.add_argument(
        "--utilization",
        type=float,
        default=0.8,
        help="scale inter-arrival times to this offered load (0 = replay as recorded); "
        "see bench/sim/traces.py for the capacity definition",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `bench sim`."""
    add_workload_arguments(parser)
    parser.add_argument("--instances", type=int, default=8, help="engine instances")
    parser.add_argument("--nodes", type=int, default=3, help="proxy nodes (arrivals round-robin)")
    parser.add_argument(
        "--hint-interval-ms",
        type=float,
        default=1000.0,
        help="engine hints (num_running/num_waiting) are scraped this often",
    )
    parser.add_argument(
        "--hint-ttl-ms",
        type=int,
        default=Settings().hint_ttl_ms,
        help="hints older than this count as missing",
    )
    parser.add_argument(
        "--strategies",
        type=_strategies,
        default=list(STRATEGIES),
        help=f"comma list from {', '.join(ALL_STRATEGIES)} (or 'all'); default: "
        f"{', '.join(STRATEGIES)}",
    )
    parser.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=0,
        help="each engine's prefix cache in tokens, for traces with hash_ids (0 = none); "
        "the prefix strategies need it",
    )
    parser.add_argument(
        "--limit",
        type=int,
        default=None,
        help=f"use the first N requests (synthetic workload: N requests, default {DEFAULT_REQUESTS})",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of every random choice")
    parser.add_argument(
        "--expected-output",
        choices=EXPECTED_OUTPUT_MODES,
        default="avg",
        help="output length reserved: avg = each node's running average of completed "
        "outputs (what the proxy knows), true = the trace's (an oracle)",
    )
    parser.add_argument(
        "--max-slots",
        type=int,
        default=-1,
        help="max_slots each instance registers (-1 = the engine's max_batch, 0 = unlimited)",
    )
    parser.add_argument(
        "--weights",
        type=_weights,
        default=None,
        help="least_load weights: [preset,]name=value,... (presets: seed, ttft); unnamed "
        f"ones keep the preset's, the seed's when none is named; default: {DEFAULT_WEIGHTS}, "
        "as `coordinator serve`",
    )
    add_heterogeneity_arguments(parser)
    parser.add_argument(
        "--learn",
        action="store_true",
        help="nodes learn each instance's timing from traffic (coordinator/timing.py)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def speed_list(text: str) -> tuple[float, ...]:
    """`0.5,1,2` -> true speeds per instance (cycled)."""
    try:
        speeds = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"speeds must be numbers, got {text!r}") from None
    if not speeds or any(not (v > 0 and math.isfinite(v)) for v in speeds):
        raise argparse.ArgumentTypeError(f"speeds must be finite and > 0, got {text!r}")
    return speeds


def add_heterogeneity_arguments(parser: argparse.ArgumentParser) -> None:
    """--speeds and --registered-timing, the same for `bench sim` and `bench live`."""
    parser.add_argument(
        "--speeds",
        type=speed_list,
        default=(),
        help="true engine speeds, cycled over the instances, e.g. 0.5,1,2 (default: all 1); "
        "utilization is measured against the fleet's summed speed",
    )
    parser.add_argument(
        "--registered-timing",
        choices=REGISTERED_TIMING,
        default="exact",
        help="what instances register: exact = their true timing, none = nothing "
        "(learned from traffic), shared = the 1x engine's timing for every speed",
    )


def command(args: argparse.Namespace) -> list[str]:
    """The canonical command line that reproduces a run (defaults left out)."""
    cmd = ["coordinator", "bench", "sim"]
    if args.trace is not None:
        cmd += ["--trace", str(args.trace)]
    cmd += ["--utilization", f"{args.utilization:g}"]
    if args.instances != 8:
        cmd += ["--instances", str(args.instances)]
    if args.nodes != 3:
        cmd += ["--nodes", str(args.nodes)]
    if args.hint_interval_ms != 1000.0:
        cmd += ["--hint-interval-ms", f"{args.hint_interval_ms:g}"]
    if args.hint_ttl_ms != Settings().hint_ttl_ms:
        cmd += ["--hint-ttl-ms", str(args.hint_ttl_ms)]
    if list(args.strategies) != list(STRATEGIES):
        cmd += ["--strategies", ",".join(args.strategies)]
    if args.limit is not None:
        cmd += ["--limit", str(args.limit)]
    cmd += ["--seed", str(args.seed)]
    if args.expected_output != "avg":
        cmd += ["--expected-output", args.expected_output]
    if args.max_slots != -1:
        cmd += ["--max-slots", str(args.max_slots)]
    if args.prefix_cache_tokens:
        cmd += ["--prefix-cache-tokens", str(args.prefix_cache_tokens)]
    if args.speeds:
        cmd += ["--speeds", ",".join(f"{v:g}" for v in args.speeds)]
    if args.registered_timing != "exact":
        cmd += ["--registered-timing", args.registered_timing]
    if args.learn:
        cmd += ["--learn"]
    weights = args.weights or Weights.preset(DEFAULT_WEIGHTS)
    if weights != Weights.preset(DEFAULT_WEIGHTS):
        # Spelled against the seed, which is what --weights without a preset starts from.
        seed = Weights().as_dict()
        changed = {k: v for k, v in weights.as_dict().items() if v != seed[k]}
        cmd += ["--weights", ",".join(f"{k}={v:g}" for k, v in changed.items()) or "seed"]
    return cmd


def run(args: argparse.Namespace) -> int:
    """Simulate, then print the comparison table (or JSON)."""
    try:
        config = SimConfig(
            instances=args.instances,
            nodes=args.nodes,
            hint_interval_ms=args.hint_interval_ms,
            hint_ttl_ms=args.hint_ttl_ms,
            expected_output=args.expected_output,
            max_slots=args.max_slots,
            seed=args.seed,
            weights=args.weights or Weights.preset(DEFAULT_WEIGHTS),
            prefix_cache_tokens=args.prefix_cache_tokens,
            speeds=args.speeds,
            registered_timing=args.registered_timing,
            learn=args.learn,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()

    def progress(strategy: str, done: int, total: int) -> None:
        elapsed = time.monotonic() - started
        print(
            f"sim: {strategy} {100 * done // total}% ({done}/{total}) {elapsed:.1f}s",
            file=sys.stderr,
            flush=True,
        )

    try:
        result = run_trace(
            args.trace,
            utilization=args.utilization or None,
            limit=args.limit,
            strategies=args.strategies,
            config=config,
            progress=None if args.quiet else progress,
        )
    except (TraceError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(json_ready(result.as_dict()), indent=2, allow_nan=False))
    else:
        print(markdown(result, command(args)))
    return 0
