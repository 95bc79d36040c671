"""What the operator commands that work on a pool straight in Redis share
(`coordinator inspect`, `coordinator cordon`): their Redis and pool flags, and a
Coordinator that takes no node lease."""

from __future__ import annotations

import argparse
import os

from coordinator.connection import connect_redis
from coordinator.coordinator import Coordinator
from coordinator.settings import Settings
from proxy_node.config import DEFAULT_REDIS_URL


def add_pool_arguments(parser: argparse.ArgumentParser, pool_help: str) -> None:
    """`--redis-url` and `--pool`, defaulting from the environment as a node does."""
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("COORD_REDIS_URL") or os.environ.get("REDIS_URL", DEFAULT_REDIS_URL),
        help="Redis URL (env COORD_REDIS_URL or REDIS_URL)",
    )
    parser.add_argument(
        "--pool",
        default=os.environ.get("COORD_POOL", "default"),
        help=f"{pool_help} (env COORD_POOL)",
    )


def leaseless_coordinator(url: str, pool: str, node_id: str, settings: Settings) -> Coordinator:
    """A Coordinator on the pool, built directly: Coordinator.connect would take a node
    lease, and a command that only reads or marks the pool is no node."""
    return Coordinator(connect_redis(url, settings), pool=pool, node_id=node_id, settings=settings)
