"""What the code reads, for the checks of files that configure it from outside.

docker-compose.yml (tests/fleet/test_compose.py) and the Helm chart (tests/deploy)
set environment variables and command lines for the project's programs; both are
checked here against the code, never against a hand-written list.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

from coordinator.settings import Settings
from coordinator_cli.main import build_parser
from local_fleet.mock_engine import config as mock_engine

ROOT = Path(__file__).resolve().parents[1]
HOMES = ("coordinator", "proxy_node", "local_fleet", "bench")
NODE_HOMES = ("coordinator", "proxy_node")  # what a `coordinator serve` process runs
# A variable name as a string literal in the code: os.environ.get("COORD_POOL"), tables.
_ENV_LITERAL = re.compile(r"[\"'](COORD_[A-Z_]+|DEMO_[A-Z_]+|REDIS_URL)[\"']")


def environment_read_by(homes: Sequence[str]) -> set[str]:
    """Every variable the code of these homes reads (Settings knobs always included)."""
    names = {f"COORD_{f.name.upper()}" for f in fields(Settings)}  # Settings.from_env
    for home in homes:
        for source in sorted(ROOT.glob(f"{home}/**/*.py")):
            names.update(_ENV_LITERAL.findall(source.read_text()))
    if "local_fleet" in homes:
        names.update(mock_engine._env_name(flag) for flag, *_ in mock_engine._FLAGS)
    return names


def known_environment() -> set[str]:
    """Every variable the code reads: coordinator knobs, node flags, mock engine, demo."""
    return environment_read_by(HOMES)


def parse_command(argv: Sequence[str]) -> argparse.Namespace:
    """Parse a `coordinator` command line; SystemExit on an unknown flag or a bad value."""
    return build_parser().parse_args(list(argv))
