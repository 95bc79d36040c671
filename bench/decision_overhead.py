"""Decision cost (snapshot + score + reserve) against instance and node count.

Each node is its own OS process with its own Coordinator; every node runs full
request cycles (reserve, mark_first_token, release) and times only the reserve
call (snapshot refresh when due + scoring + the reserve script). A plain PING is
timed in the same loop, so every ratio compares numbers taken side by side.

    coordinator bench overhead            # private embedded server
    coordinator bench overhead --quick    # fewer decisions, for a smoke run

`python bench/decision_overhead.py` is the same benchmark with the same flags.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from redis import Redis as SyncRedis

from bench.docs import add_write_docs, checkout_root, write_section
from bench.pool import register_idle_pool
from coordinator import Coordinator, Settings
from local_fleet.embedded import EmbeddedRedis
from local_fleet.pools import delete_pool
from local_fleet.stats import nearest_rank

# A long lease: the bench runs no lease loop, and a node past its lease must re-assert.
SETTINGS = Settings(
    instance_ttl_ms=600_000, heartbeat_interval_ms=1_000, redis_timeout_ms=2_000, lease_ms=600_000
)
COMMAND = "coordinator bench overhead"


async def _node(url: str, pool: str, node: str, decisions: int, max_age: int) -> dict[str, Any]:
    settings = SETTINGS.with_(snapshot_max_age_ms=max_age)
    c = await Coordinator.connect(url, pool=pool, node_id=node, settings=settings, background=False)
    await c.refresh()
    live: list[str] = []
    decide, ping = [], []
    for k in range(decisions):
        t0 = time.perf_counter()
        res = await c.reserve(512, 128)
        decide.append(time.perf_counter() - t0)
        live.append(res.rid)
        c.first_token_soon(res.rid)
        if len(live) > 8:  # keep a steady state of live reservations per node
            c.release_soon(live.pop(0))
        if k % 2 == 0:
            t0 = time.perf_counter()
            await c.redis.ping()
            ping.append(time.perf_counter() - t0)
    for rid in live:
        c.release_soon(rid)
    await c.flush_carried()
    await c.close()
    return {"decide": decide, "ping": ping}


def _node_process(args: tuple[str, str, str, int, int]) -> dict[str, Any]:
    return asyncio.run(_node(*args))


def evalsha_calls(client: SyncRedis) -> int:
    """Total EVALSHA + EVAL calls the server has executed."""
    stats = client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))


def run_case(url: str, instances: int, nodes: int, decisions: int, max_age: int) -> dict[str, Any]:
    """One (instances, nodes) point: every node process runs `decisions` cycles."""
    pool = f"bench-{instances}-{nodes}-{max_age}-{int(time.time() * 1000) % 100000}"
    asyncio.run(register_idle_pool(url, pool, instances, SETTINGS, max_slots=64))
    client = SyncRedis.from_url(url)
    try:
        before = evalsha_calls(client)
        ctx = mp.get_context("spawn")
        with ctx.Pool(nodes) as workers:
            results = workers.map(
                _node_process, [(url, pool, f"n{k}", decisions, max_age) for k in range(nodes)]
            )
        calls = evalsha_calls(client) - before
    finally:
        client.close()
        delete_pool(url, pool, SETTINGS.key_prefix)
    decide = [x for r in results for x in r["decide"]]
    ping = [x for r in results for x in r["ping"]]
    return {
        "instances": instances,
        "nodes": nodes,
        "max_age": max_age,
        "p50": nearest_rank(decide, 0.5) * 1e6,
        "p99": nearest_rank(decide, 0.99) * 1e6,
        "ping": statistics.median(ping) * 1e6,
        "calls_per_request": calls / (decisions * nodes),
    }


def cases() -> list[tuple[int, int, int]]:
    """(instances, nodes, snapshot_max_age_ms) of the grid."""
    default = Settings().snapshot_max_age_ms
    grid = [(n, 1, default) for n in (16, 64, 256, 1024)]
    grid += [(n, 1, 0) for n in (16, 64, 256, 1024)]
    grid += [(n, k, default) for k in (3, 8) for n in (16, 1024)]
    return grid


def server_version(url: str | None, server: EmbeddedRedis | None) -> str:
    """A short description of the server used."""
    return server.version.split(" sha=")[0] if server is not None else f"server at {url}"


def render(rows: list[dict[str, Any]], decisions: int, server: str, command: str = COMMAND) -> str:
    """The markdown table with ratios to the round trip and to 16 instances."""
    base = {(r["nodes"], r["max_age"]): r["p50"] for r in rows if r["instances"] == 16}
    lines = [
        "## Decision overhead (snapshot + score + reserve)",
        "",
        f"`{command} --write-docs` — "
        f"{decisions} decisions per node per case, each node its own process, {server}. "
        f"`max_age` is `snapshot_max_age_ms`: {Settings().snapshot_max_age_ms} (default) "
        "decides on the node's view of the packed pool state (kept by the records its "
        "replies carry) when it was current that recently; 0 reads it before every decision "
        "(two round trips).",
        "",
        "| instances | nodes | max_age ms | p50 µs | p99 µs | PING p50 µs | p50 / PING | "
        "p50 / p50@16 | Redis calls per request |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['instances']} | {r['nodes']} | {r['max_age']} | {r['p50']:.0f} | "
            f"{r['p99']:.0f} | {r['ping']:.0f} | {r['p50'] / r['ping']:.2f} | "
            f"{r['p50'] / base[(r['nodes'], r['max_age'])]:.2f} | "
            f"{r['calls_per_request']:.2f} |"
        )
    lines += ["", "![decision cost](img/decision_cost.png)", ""]
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]]) -> None:
    """docs/img/decision_cost.png: p50 and p99 against instance count."""
    root = checkout_root()
    if root is None:
        print("no source checkout with docs/: no plot", file=sys.stderr)
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for k, age in sorted({(r["nodes"], r["max_age"]) for r in rows}):
        pts = sorted(
            (r["instances"], r["p50"], r["p99"])
            for r in rows
            if r["nodes"] == k and r["max_age"] == age
        )
        xs = [p[0] for p in pts]
        ax.plot(xs, [p[1] for p in pts], marker="o", label=f"p50, {k} node(s), max_age {age}")
    ping = statistics.median(r["ping"] for r in rows)
    ax.axhline(ping, color="grey", linestyle="--", label="PING round trip (median)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("instances in the pool")
    ax.set_ylabel("decision latency (µs)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    ax.set_title("Decision cost vs fleet size")
    out = root / "docs" / "img" / "decision_cost.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `bench overhead` (and of bench/decision_overhead.py)."""
    parser.add_argument("--redis-url", help="use this server instead of a private one")
    parser.add_argument("--decisions", type=int, default=1500, help="per node and case")
    parser.add_argument("--quick", action="store_true", help="300 decisions per node")
    add_write_docs(parser, "docs/benchmarks.md and docs/img/")
    parser.set_defaults(overhead_command=COMMAND)


def run(args: argparse.Namespace) -> int:
    """Run the grid, print the table; with --write-docs, write docs/benchmarks.md and the plot."""
    decisions = 300 if args.quick else args.decisions
    if decisions < 1:
        print("error: --decisions must be >= 1", file=sys.stderr)
        return 2
    server = None if args.redis_url else EmbeddedRedis().start()
    url: str = args.redis_url if server is None else server.url
    try:
        rows = []
        grid = cases()
        for i, (n, k, age) in enumerate(grid, 1):
            row = run_case(url, n, k, decisions, age)
            rows.append(row)
            print(
                f"[{i}/{len(grid)}] instances={n} nodes={k} max_age={age}ms "
                f"p50={row['p50']:.0f}us p99={row['p99']:.0f}us ping={row['ping']:.0f}us",
                file=sys.stderr,
            )
    finally:
        if server is not None:
            server.stop()
    table = render(
        rows,
        decisions,
        server_version(url if server is None else None, server),
        args.overhead_command,
    )
    print(table)
    if args.write_docs:
        write_section("decision", table)
        plot(rows)
    return 0


def main(
    argv: Sequence[str] | None = None, command: str = "python bench/decision_overhead.py"
) -> int:
    """The standalone script: same flags, the table names `command` as its generator."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    parser.set_defaults(overhead_command=command)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
