"""Run a subcommand module (`add_arguments` + `run`) as its own program.

`coordinator serve` and `python -m proxy_node` share one parser this way, and the
local fleet can start nodes without going through the CLI layer above it.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def add_log_level(parser: argparse.ArgumentParser) -> None:
    """The `--log-level` flag every program takes."""
    parser.add_argument(
        "--log-level", default="INFO", choices=LOG_LEVELS, help="logging level (default: INFO)"
    )


def standalone_main(
    prog: str,
    description: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    argv: Sequence[str] | None = None,
) -> int:
    """Parse `argv` with the module's flags plus `--log-level`, then run it."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_log_level(parser)
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT)
    try:
        return int(run(args))
    except KeyboardInterrupt:
        return 130
