"""The `coordinator` command: one subcommand per module, loaded on demand."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from proxy_node.entry import LOG_FORMAT, add_log_level

# name -> (module, one-line help). Each module defines
#   add_arguments(parser: argparse.ArgumentParser) -> None
#   run(args: argparse.Namespace) -> int
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "bench": (
        "coordinator_cli.bench",
        "Run benchmarks: scheduling quality and coordination overhead.",
    ),
    "serve": ("proxy_node.serve", "Run one proxy node: service plane and control plane."),
    "demo": ("local_fleet.demo", "Start a local cluster and drive a bursty workload through it."),
    "cluster": ("local_fleet.cluster", "Run Redis, proxy nodes and mock engines locally."),
    "mock-engine": ("local_fleet.mock_engine", "Run a mock OpenAI-compatible inference engine."),
    "inspect": ("proxy_node.inspect", "Show a pool's instances, leases and reservations."),
    "cordon": (
        "proxy_node.cordon",
        "Take an engine instance out of rotation (and wait for it to drain), or put it back.",
    ),
}


def add_module_parsers(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    table: dict[str, tuple[str, str]],
    attribute: str,
) -> None:
    """One child parser per (module, help) entry; the module is stored under `attribute`."""
    for name, (module_name, help_text) in table.items():
        module = importlib.import_module(module_name)
        child = sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        module.add_arguments(child)
        child.set_defaults(**{attribute: module})


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (every subcommand with its flags)."""
    parser = argparse.ArgumentParser(
        prog="coordinator",
        description="Redis-backed load coordination for fleets of LLM inference proxy nodes.",
    )
    add_log_level(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_module_parsers(sub, SUBCOMMANDS, "_module")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `coordinator` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT)
    try:
        return int(args._module.run(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
