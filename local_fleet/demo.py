"""`coordinator demo`: a local cluster under a bursty streaming workload, explained.

Starts the local cluster (embedded Redis unless REDIS_URL is set), sends a seeded,
bursty stream of chat requests round-robin through every node for --duration
seconds, shows progress every second, then prints per-instance results, how the
least_load pressure evolved, and where to look next.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from redis.exceptions import RedisError

from coordinator.connection import redact
from coordinator.errors import CoordinatorError
from local_fleet.cluster import LocalCluster, add_fleet_arguments
from local_fleet.embedded import EmbeddedRedis, ServerUnavailableError, find_server_binary
from local_fleet.stats import nearest_rank

POOL = "demo"
WORDS = "the fleet reserves every request in redis so no node herds onto one engine".split()


@dataclass(frozen=True)
class Targets:
    """Where the workload goes: node service URLs and one control-plane URL."""

    node_urls: list[str]
    control_urls: list[str]

    @property
    def nodes(self) -> int:
        """Number of nodes."""
        return len(self.node_urls)


@dataclass
class Result:
    """What the client saw of one request."""

    status: int
    instance: str
    ttft_s: float | None
    e2e_s: float
    error: str = ""


@dataclass
class Workload:
    """Seeded bursty arrivals: a base rate with periodic bursts."""

    duration_s: float
    base_rps: float
    burst_rps: float
    burst_every_s: float = 6.0
    burst_len_s: float = 2.0
    seed: int = 7
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def rate(self, t: float) -> float:
        """Arrival rate at time t (requests/s)."""
        return self.burst_rps if (t % self.burst_every_s) < self.burst_len_s else self.base_rps

    def arrivals(self) -> list[float]:
        """Arrival times in [0, duration), by thinning a Poisson process."""
        peak = max(self.base_rps, self.burst_rps)
        t, out = 0.0, list[float]()
        while True:
            t += self.rng.expovariate(peak)
            if t >= self.duration_s:
                return out
            if self.rng.random() < self.rate(t) / peak:
                out.append(t)

    def body(self) -> dict[str, Any]:
        """A chat request with a random prompt size and output cap."""
        words = int(min(4000, self.rng.lognormvariate(5.0, 1.0)))
        prompt = " ".join(self.rng.choice(WORDS) for _ in range(max(1, words)))
        return {
            "model": "mock",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": self.rng.randint(16, 160),
            "stream": True,
        }


async def send(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Result:
    """One streaming request; TTFT is the first SSE data chunk."""
    start = time.perf_counter()
    ttft = None
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            instance = response.headers.get("X-Instance-Id", "?")
            async for line in response.content:
                if ttft is None and line.startswith(b"data:"):
                    ttft = time.perf_counter() - start
            return Result(response.status, instance, ttft, time.perf_counter() - start)
    except (TimeoutError, aiohttp.ClientError) as exc:
        return Result(0, "?", ttft, time.perf_counter() - start, type(exc).__name__)


async def sample_pressure(session: aiohttp.ClientSession, control: str) -> dict[str, Any]:
    """One /debug/instance_loads document (empty on error)."""
    try:
        async with session.get(f"{control}/debug/instance_loads") as response:
            return dict(await response.json())
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return {}


async def drive(cluster: Targets | LocalCluster, workload: Workload, out: Any) -> dict[str, Any]:
    """Replay the workload through every node; print progress each second."""
    arrivals = workload.arrivals()
    results: list[Result] = []
    samples: list[tuple[float, dict[str, Any]]] = []
    timeout = aiohttp.ClientTimeout(total=120)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.monotonic()
        tasks: list[asyncio.Task[None]] = []

        async def one(i: int) -> None:
            results.append(
                await send(session, cluster.node_urls[i % cluster.nodes], workload.body())
            )

        next_report = 1.0
        for i, at in enumerate(arrivals):
            while (now := time.monotonic() - start) < at:
                if now >= next_report:
                    doc = await sample_pressure(session, cluster.control_urls[0])
                    samples.append((now, doc))
                    print(progress(now, workload.duration_s, i, results, doc), file=out, flush=True)
                    next_report += 1.0
                await asyncio.sleep(min(at - now, max(0.0, next_report - now), 0.05))
            tasks.append(asyncio.create_task(one(i)))
        while any(not t.done() for t in tasks):
            now = time.monotonic() - start
            if now >= next_report:
                doc = await sample_pressure(session, cluster.control_urls[0])
                samples.append((now, doc))
                print(
                    progress(now, workload.duration_s, len(arrivals), results, doc)
                    + "  (draining)",
                    file=out,
                    flush=True,
                )
                next_report += 1.0
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)
    return {"results": results, "samples": samples, "sent": len(arrivals)}


def progress(
    now: float, duration: float, sent: int, results: list[Result], doc: dict[str, Any]
) -> str:
    """One progress line: time, requests, and each instance's inflight."""
    done = len(results)
    failed = sum(1 for r in results if r.status != 200)
    loads = " ".join(
        f"{row['id']}={row.get('inflight', 0)}"
        for row in sorted(doc.get("instances", []), key=lambda r: str(r["id"]))
    )
    return (
        f"[{now:5.1f}s/{duration:.0f}s] sent {sent:4d} done {done:4d} failed {failed} "
        f"| inflight {loads}"
    )


def report(run: dict[str, Any], redis_url: str | None = None, own_cluster: bool = True) -> str:
    """The final tables, and where to look next (`redis_url`: the demo's external Redis)."""
    results: list[Result] = run["results"]
    lines = ["", "Per-instance results (client-side, ms):", ""]
    header = f"{'instance':<12}{'requests':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'e2e p50':>10}{'e2e p99':>10}"
    lines += [header, "-" * len(header)]
    by_instance: dict[str, list[Result]] = {}
    for r in results:
        by_instance.setdefault(r.instance, []).append(r)
    for name in [*sorted(by_instance), "ALL"]:
        group = results if name == "ALL" else by_instance[name]
        ok = [r for r in group if r.status == 200]
        ttft = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
        e2e = [r.e2e_s * 1000 for r in ok]
        lines.append(
            f"{name:<12}{len(group):>9}{nearest_rank(ttft, 0.5):>10.0f}{nearest_rank(ttft, 0.99):>10.0f}"
            f"{nearest_rank(e2e, 0.5):>10.0f}{nearest_rank(e2e, 0.99):>10.0f}"
        )
    failed = [r for r in results if r.status != 200]
    lines.append("")
    lines.append(
        f"{len(results)} requests, {len(results) - len(failed)} ok, {len(failed)} failed"
        + (f" ({', '.join(sorted({r.error or str(r.status) for r in failed}))})" if failed else "")
    )
    lines += ["", "least_load pressure over time (inflight / score total, from node-0):", ""]
    samples = run["samples"]
    ids = sorted({str(row["id"]) for _, doc in samples for row in doc.get("instances", [])})
    lines.append(f"{'t (s)':>6}  " + "".join(f"{i:>16}" for i in ids))
    step = max(1, len(samples) // 12)
    for t, doc in samples[::step]:
        rows = {str(r["id"]): r for r in doc.get("instances", [])}
        cells = []
        for i in ids:
            row = rows.get(i)
            score = (row or {}).get("least_load_score") or {}
            total = score.get("total")
            cells.append(
                f"{(row or {}).get('inflight', '-')!s:>6} / "
                f"{'-' if total is None else f'{total:.2f}':>6}"
            )
        lines.append(f"{t:>6.1f}  " + "".join(f"{c:>16}" for c in cells))
    lines += ["", *next_steps(redis_url, own_cluster)]
    return "\n".join(lines)


def next_steps(redis_url: str | None, own_cluster: bool = True) -> list[str]:
    """Where to look next: the demo's own cluster is gone by the time this is read."""
    if not own_cluster:
        return [
            "The cluster at --targets keeps running: look at it with",
            "  GET  <control>/debug/instance_loads   the snapshot and scores selection uses",
            "  coordinator inspect --redis-url URL --pool POOL   (its Redis URL and pool)",
        ]
    if redis_url is None:
        gone = (
            "The demo's cluster and its private Redis have stopped, so there is nothing "
            "left to look at."
        )
        url = "URL"
    else:
        gone = (
            f"The demo's cluster has stopped and its pool's keys were deleted from "
            f"{redact(redis_url)}, so an inspect now shows an empty pool."
        )
        url = redact(redis_url)
    return [
        gone,
        "To look around, start a cluster that stays up: `coordinator cluster --pool demo`",
        "prints its Redis URL and ports; then, with URL being that Redis URL:",
        "  GET  <control>/debug/instance_loads   the snapshot and scores selection uses",
        "  GET  <control>/debug/reservations     live reservations (no payloads)",
        "  GET  <node>/metrics                   Prometheus metrics",
        f"  redis-cli -u {url} HGETALL 'lc:{{demo}}:reservations'   the shared records, as stored",
        f"  coordinator inspect --redis-url {url} --pool demo   the pool at a glance",
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `coordinator demo`."""
    parser.add_argument(
        "--duration", type=float, default=30.0, help="seconds of load (at most 600)"
    )
    add_fleet_arguments(parser, base_port=18001)
    parser.add_argument("--base-rps", type=float, default=6.0, help="arrival rate between bursts")
    parser.add_argument("--burst-rps", type=float, default=30.0, help="arrival rate in bursts")
    parser.add_argument("--seed", type=int, default=7, help="workload seed")
    parser.add_argument(
        "--targets",
        default=os.environ.get("DEMO_TARGETS"),
        help="comma-separated node URLs of a running cluster to drive instead of starting "
        "one (env DEMO_TARGETS)",
    )
    parser.add_argument(
        "--control",
        default=os.environ.get("DEMO_CONTROL"),
        help="control-plane URL sampled for pressure with --targets (env DEMO_CONTROL)",
    )


def run(args: argparse.Namespace) -> int:
    """Start the cluster (or use --targets), drive the workload, print the report."""
    if not 0 < args.duration <= 600:
        print("--duration must be in (0, 600] seconds", file=sys.stderr)
        return 2
    workload = Workload(args.duration, args.base_rps, args.burst_rps, seed=args.seed)
    if args.targets:
        nodes = [u.strip().rstrip("/") for u in args.targets.split(",") if u.strip()]
        control = (args.control or nodes[0]).rstrip("/")
        outcome = _drive(Targets(nodes, [control]), workload, args.duration)
        return _report(outcome, None, own_cluster=False)
    cluster = LocalCluster(
        nodes=args.nodes,
        engines=args.engines,
        base_port=args.base_port,
        redis_url=args.redis_url,
        speed=args.speed,
        pool=POOL,
    )
    try:
        server = (
            f"Redis at {redact(args.redis_url)}"
            if args.redis_url
            else f"a private Redis-compatible server ({private_server()})"
        )
        print(
            f"starting a local cluster: {args.nodes} nodes, {args.engines} mock engines, "
            f"{server}...",
            flush=True,
        )
        cluster.start()
    except (RuntimeError, ValueError, ServerUnavailableError) as exc:
        print(f"cluster failed to start: {exc}", file=sys.stderr)
        return 1
    try:
        print(cluster.describe(), flush=True)
        outcome = _drive(cluster, workload, args.duration)
    finally:
        cluster.stop()
        if args.redis_url:
            # The demo's pool is its own: leave nothing of it in someone's Redis.
            try:
                cluster.delete_pool()
            except (RedisError, OSError, CoordinatorError) as exc:
                print(f"could not delete the demo's keys: {exc}", file=sys.stderr)
    return _report(outcome, args.redis_url)


def private_server() -> str:
    """The binary a private server would run, with its version."""
    server = EmbeddedRedis(binary=find_server_binary())
    return f"{server.binary}, {server.version_line}"


def _drive(targets: Targets | LocalCluster, workload: Workload, duration: float) -> dict[str, Any]:
    print(f"\ndriving a bursty streaming workload for {duration:.0f}s...", flush=True)
    return asyncio.run(drive(targets, workload, sys.stdout))


def _report(outcome: dict[str, Any], redis_url: str | None, own_cluster: bool = True) -> int:
    print(report(outcome, redis_url, own_cluster), flush=True)
    failed = sum(1 for r in outcome["results"] if r.status != 200)
    return 0 if failed == 0 else 1
