"""Herding: K nodes fire simultaneous bursts at idle, identical instances.

Each node is its own OS process with its own Coordinator; all nodes wait on one
barrier, then each fires its burst at once (asyncio.gather). The ideal spread of
K*B reservations over M instances has max - min <= 1. `local_least_inflight` is the
nginx least_conn behaviour: each node counts only its own requests.

    coordinator bench herding               # 4 nodes x 8 requests onto 16 instances
    coordinator bench herding --trials 50 --nodes 8 --burst 16 --instances 32

`python bench/herding.py` is the same benchmark with the same flags.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from bench.docs import add_write_docs, write_section
from bench.pool import register_idle_pool
from coordinator import Coordinator, Settings
from coordinator.strategies import RoundRobin, eligible, least_load
from local_fleet.embedded import EmbeddedRedis
from local_fleet.pools import delete_pool

STRATEGIES = ("least_load", "power_of_two", "round_robin", "local_least_inflight")
SETTINGS = Settings(instance_ttl_ms=600_000, redis_timeout_ms=5_000)
COMMAND = "coordinator bench herding"


async def _burst(
    url: str, pool: str, node: str, burst: int, strategy: str, barrier: Any
) -> list[str]:
    c = await Coordinator.connect(url, pool=pool, node_id=node, settings=SETTINGS, background=False)
    await c.refresh()
    snap = await c.snapshot()
    await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
    if strategy == "local_least_inflight":
        await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
        # The node's own counters only: every node starts from an all-idle view.
        own: Counter[str] = Counter()
        rr = RoundRobin()
        chosen = []
        for _ in range(burst):
            rows = [
                replace(
                    r,
                    inflight=own[r.id],
                    predicted_total_backlog_ms=None,
                    engine_running=None,
                    engine_waiting=None,
                    queue_depth=None,
                )
                for r in eligible(snap.rows)
            ]
            pick = least_load(rows, SETTINGS.weights, rr).ranked[0].id
            own[pick] += 1
            chosen.append(pick)
    else:
        results = await asyncio.gather(
            *(c.reserve(256, 64, strategy=strategy) for _ in range(burst))
        )
        chosen = [r.instance_id for r in results]
        # Hold every reservation until all nodes are done, so the tally is the spread
        # of concurrently held reservations.
        await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
        for r in results:
            await c.release(r.rid)
    await c.close()
    return chosen


def _node(args: tuple[str, str, str, int, str, Any]) -> list[str]:
    return asyncio.run(_burst(*args))


def trial(url: str, strategy: str, nodes: int, burst: int, instances: int, n: int) -> int:
    """One burst; returns max - min of reservations per instance."""
    pool = f"herd-{strategy}-{n}-{int(time.time() * 1000) % 1000000}"
    asyncio.run(register_idle_pool(url, pool, instances, SETTINGS))
    ctx = mp.get_context("spawn")
    try:
        with ctx.Manager() as manager, ctx.Pool(nodes) as workers:
            barrier = manager.Barrier(nodes)
            picks = workers.map(
                _node, [(url, pool, f"n{k}", burst, strategy, barrier) for k in range(nodes)]
            )
    finally:
        delete_pool(url, pool, SETTINGS.key_prefix)
    return spread(
        [p for node_picks in picks for p in node_picks],
        [f"inst-{i:04d}" for i in range(instances)],
    )


def spread(picks: Iterable[str], ids: Sequence[str]) -> int:
    """Most minus fewest picks over the instances `ids` (ids never picked count 0;
    picks of no listed id, such as '' for a failed request, are ignored)."""
    counts = Counter(picks)
    per_instance = [counts.get(i, 0) for i in ids]
    return max(per_instance) - min(per_instance)


def measure(url: str, nodes: int, burst: int, instances: int, trials: int) -> dict[str, list[int]]:
    """max - min per trial, for every strategy (progress on stderr)."""
    spreads: dict[str, list[int]] = {}
    for strategy in STRATEGIES:
        spreads[strategy] = [
            trial(url, strategy, nodes, burst, instances, n) for n in range(trials)
        ]
        print(f"{strategy}: max-min per trial {spreads[strategy]}", file=sys.stderr)
    return spreads


def render(
    spreads: dict[str, list[int]],
    nodes: int,
    burst: int,
    instances: int,
    trials: int,
    command: str = COMMAND,
) -> str:
    """The markdown section: one row per strategy."""
    lines = [
        "## Herding (simultaneous bursts onto idle, identical instances)",
        "",
        f"`{command} --write-docs --nodes {nodes} --burst {burst} "
        f"--instances {instances} --trials {trials}` — each node its own process, "
        "released from one barrier. Ideal: max - min <= 1.",
        "",
        "| strategy | mean max-min | worst max-min | trials with max-min <= 1 |",
        "|---|---:|---:|---:|",
    ]
    for strategy, values in spreads.items():
        ideal = sum(1 for v in values if v <= 1)
        lines.append(
            f"| {strategy} | {statistics.mean(values):.2f} | {max(values)} | "
            f"{ideal}/{len(values)} |"
        )
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `bench herding` (and of bench/herding.py)."""
    parser.add_argument(
        "--redis-url",
        help="use this server (default: %(default)s, a private embedded server)",
    )
    parser.add_argument(
        "--nodes",
        type=int,
        default=4,
        help="node processes bursting at once (default: %(default)s)",
    )
    parser.add_argument(
        "--burst", type=int, default=8, help="requests per node per burst (default: %(default)s)"
    )
    parser.add_argument(
        "--instances",
        type=int,
        default=16,
        help="idle, identical instances in the pool (default: %(default)s)",
    )
    parser.add_argument(
        "--trials",
        type=int,
        default=10,
        help="bursts per strategy; the table reports mean and worst (default: %(default)s)",
    )
    add_write_docs(parser)
    parser.set_defaults(herding_command=COMMAND)


def run(args: argparse.Namespace) -> int:
    """Run every strategy, print and record the table."""
    if min(args.nodes, args.burst, args.instances, args.trials) < 1:
        print("error: --nodes, --burst, --instances and --trials must be >= 1", file=sys.stderr)
        return 2
    server = None if args.redis_url else EmbeddedRedis().start()
    url: str = args.redis_url if server is None else server.url
    try:
        spreads = measure(url, args.nodes, args.burst, args.instances, args.trials)
    finally:
        if server is not None:
            server.stop()
    table = render(
        spreads, args.nodes, args.burst, args.instances, args.trials, args.herding_command
    )
    print(table)
    if args.write_docs:
        write_section("herding", table)
    return 0


def main(argv: Sequence[str] | None = None, command: str = "python bench/herding.py") -> int:
    """The standalone script: same flags, the table names `command` as its generator."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    parser.set_defaults(herding_command=command)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
