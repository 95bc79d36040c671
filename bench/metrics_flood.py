"""A flood of /metrics scrapes on a node's public service plane: what it costs the
shared Redis and the node's other requests, this checkout against another commit.

Each round starts, for each code in turn, one `coordinator serve` node of that code
(its own private Redis, 2 mock engines and `--instances` registered in all, kept alive
by a long instance TTL), then measures two phases of `--seconds` each: idle, and with
`--scrapers` clients each sending GET /metrics again as soon as its last answer came.
In both, a prober sends GET /healthz every 20 ms: its latency is what any request
to the node waits for the event loop. Redis commands are INFO commandstats calls
(scripts' own commands included) per second. Medians over rounds; the codes
alternate within a round, so noise on this shared machine lands on both. Loopback
only; every cluster stops by itself.

    python bench/metrics_flood.py --against REF [--rounds 3] [--instances 64 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.against import add_against, resolve_against, tree_of  # noqa: E402
from bench.docs import add_write_docs, write_section  # noqa: E402
from coordinator import Coordinator, InstanceSpec  # noqa: E402
from local_fleet.cluster import LocalCluster, free_port_block  # noqa: E402

PROBE_EVERY_S = 0.02
POOL = "flood"


@dataclass
class Phase:
    """One phase's figures."""

    scrapes_per_s: float
    redis_per_s: float
    healthz_p50_ms: float
    healthz_p99_ms: float


async def measure(url: str, redis_url: str, scrapers: int, seconds: float) -> Phase:
    """`scrapers` clients scraping /metrics back to back for `seconds`, beside a prober."""
    from redis.asyncio import Redis

    redis = Redis.from_url(redis_url)
    scrapes, latencies = 0, []
    async with aiohttp.ClientSession() as http:
        await redis.config_resetstat()
        stop = time.monotonic() + seconds

        async def scraper() -> None:
            nonlocal scrapes
            while time.monotonic() < stop:
                async with http.get(url + "/metrics") as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"/metrics answered {resp.status}")
                scrapes += 1

        async def prober() -> None:
            while time.monotonic() < stop:
                sent = time.perf_counter()
                async with http.get(url + "/healthz") as resp:
                    await resp.read()
                latencies.append((time.perf_counter() - sent) * 1000)
                await asyncio.sleep(PROBE_EVERY_S)

        await asyncio.gather(prober(), *(scraper() for _ in range(scrapers)))
        stats = await redis.info("commandstats")
    await redis.aclose()
    latencies.sort()
    commands = sum(int(row["calls"]) for row in stats.values())
    return Phase(
        scrapes / seconds,
        commands / seconds,
        statistics.median(latencies),
        latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
    )


async def wait_alive(url: str, count: int, timeout_s: float = 60.0) -> None:
    """Until the node sees `count` alive instances (its view has read every spec)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while True:
            async with http.get(url + "/healthz") as resp:
                if (await resp.json())["alive_instances"] == count:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the node never saw {count} alive instances")
            await asyncio.sleep(0.1)


async def one_run(
    tree: str | None, instances: int, scrapers: int, seconds: float
) -> tuple[Phase, Phase]:
    """The idle and the flooded phase on a fresh cluster whose node runs `tree`'s code
    (None: this checkout's)."""
    # Registered instances stay alive; the node imports the code of `tree` (main()
    # runs from a directory with no code, which `python -m` would put first).
    env = {"COORD_INSTANCE_TTL_MS": "3600000", "PYTHONPATH": tree or str(ROOT)}
    cluster = LocalCluster(
        nodes=1, engines=2, base_port=free_port_block(1, 2), pool=POOL, node_env=env
    ).start()
    try:
        assert cluster.redis_url is not None
        adder = await Coordinator.connect(
            cluster.redis_url, pool=POOL, node_id="bench-adder", background=False
        )
        try:
            for i in range(instances - cluster.engines):
                await adder.register_instance(
                    InstanceSpec(id=f"extra-{i}", url=f"http://127.0.0.1:{20000 + i}")
                )
        finally:
            await adder.close()
        url = cluster.node_urls[0]
        await wait_alive(url, instances)
        idle = await measure(url, cluster.redis_url, 0, seconds)
        flood = await measure(url, cluster.redis_url, scrapers, seconds)
        return idle, flood
    finally:
        cluster.stop()


def median_phase(phases: list[Phase]) -> Phase:
    return Phase(
        *(statistics.median(getattr(p, f) for p in phases) for f in Phase.__dataclass_fields__)
    )


def render(
    results: dict[tuple[str, int], list[tuple[Phase, Phase]]], args: argparse.Namespace, took: float
) -> str:
    lines = [
        "## A flood of /metrics scrapes",
        "",
        f"Generated by `python bench/metrics_flood.py --against {args.against_name} --rounds "
        f"{args.rounds} --instances {' '.join(map(str, args.instances))} --scrapers "
        f"{args.scrapers} --seconds {args.seconds:g}` in {took:.0f} s. One node (its own "
        "private Redis, 2 mock engines, the other instances registered and kept alive); "
        f"idle, then {args.scrapers} clients scraping its public /metrics back to back; a "
        f"prober's GET /healthz every {PROBE_EVERY_S * 1000:.0f} ms shows what any request "
        "waits for the node's event loop. Redis commands: INFO commandstats calls per "
        f"second, scripts' own commands included. Medians of {args.rounds} rounds, the "
        "codes alternating within each.",
        "",
        "| code | instances | phase | scrapes served /s | Redis commands /s "
        "| /healthz p50 ms | /healthz p99 ms |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for (code, n), runs in results.items():
        for phase, picked in (("idle", 0), ("flood", 1)):
            m = median_phase([run[picked] for run in runs])
            lines.append(
                f"| {code} | {n:,} | {phase} | {m.scrapes_per_s:,.0f} | {m.redis_per_s:,.0f} "
                f"| {m.healthz_p50_ms:.1f} | {m.healthz_p99_ms:.1f} |"
            )
    lines += [
        "",
        "Rendering once per GET let every scrape read the whole pool from Redis and "
        "render every instance's series in a thread of its own. Now one render runs at "
        "a time, every scrape waiting shares the next one (each still gets a render "
        "that started after it came), and the next render starts no sooner than 50 ms, "
        "and three times the last render's length, after it (proxy_node/scrape.py). A "
        "single render still holds the GIL while it runs: at 10,000 instances, about "
        "0.75 s, during which the node's other requests wait longer.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_against(parser)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each code, alternating")
    parser.add_argument("--instances", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--scrapers", type=int, default=32, help="concurrent scraping clients")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each phase")
    add_write_docs(parser)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.scrapers < 1 or args.seconds <= 0:
        parser.error("--rounds and --scrapers must be >= 1, --seconds > 0")
    if any(n < 2 for n in args.instances):
        parser.error("--instances must be >= 2 (the cluster's 2 mock engines)")
    ref = resolve_against(parser, args.against)
    args.against_name = args.against or ref[:10]
    started = time.monotonic()
    results: dict[tuple[str, int], list[tuple[Phase, Phase]]] = {}
    with tree_of(ref) as other, tempfile.TemporaryDirectory() as elsewhere:
        os.chdir(elsewhere)
        for r in range(args.rounds):
            for n in args.instances:
                for code, tree in ((args.against_name, other), ("this", None)):
                    print(f"round {r + 1}/{args.rounds}: {code}, {n} instances", flush=True)
                    run = asyncio.run(one_run(tree, n, args.scrapers, args.seconds))
                    results.setdefault((code, n), []).append(run)
        os.chdir(ROOT)
    text = render(results, args, time.monotonic() - started)
    print(text)
    if args.write_docs:
        write_section("metrics-flood", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
