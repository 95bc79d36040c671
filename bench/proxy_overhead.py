"""Proxy overhead: TTFT through one node minus TTFT direct to the same engine.

Three processes on loopback: a zero-latency streaming engine, one proxy node
(`coordinator serve`, the real command) and this client. Direct and proxied
requests alternate (the order flips every pair), so both see the same machine
noise. Then a closed loop measures the requests/s the node sustains, and INFO
commandstats gives the Redis round trips per proxied request.

    python bench/proxy_overhead.py                     # private embedded Redis
    python bench/proxy_overhead.py --requests 5000 --concurrency 64
    python bench/proxy_overhead.py --redis-url redis://127.0.0.1:6379/0
    python bench/proxy_overhead.py --write-docs        # also rewrite its docs section
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
import uuid
from contextlib import suppress
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from redis import Redis as SyncRedis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench.docs import add_write_docs, write_section
from local_fleet.embedded import EmbeddedRedis, free_port
from local_fleet.pools import delete_pool

CHUNKS = 4  # SSE chunks per answer; TTFT is the first one
TIMING = {"prefill_ms_per_token": 0.001, "prefill_overhead_ms": 0.1, "decode_ms_per_token": 0.01}
BODY = {
    "model": "bench",
    "messages": [{"role": "user", "content": "say something"}],
    "max_tokens": CHUNKS,
    "stream": True,
}


# ---------------------------------------------------------------------- the engine


def _sse_chunk(i: int) -> bytes:
    doc = {
        "id": "b",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "bench",
        "choices": [{"index": 0, "delta": {"content": f"t{i}"}, "finish_reason": None}],
    }
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


CHUNK_BYTES = [_sse_chunk(i) for i in range(CHUNKS)]


async def _engine_handler(request: web.Request) -> web.StreamResponse:
    await request.read()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for chunk in CHUNK_BYTES:
        await response.write(chunk)
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def serve_engine(port: int) -> None:
    """Run the zero-latency engine (in its own process) until killed."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _engine_handler)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# ---------------------------------------------------------------------- measuring


def pct(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def ttft_ms(session: aiohttp.ClientSession, url: str) -> float:
    """One streamed request: ms from send to the first body chunk (body read to the end)."""
    started = time.perf_counter()
    async with session.post(url, json=BODY) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {await resp.text()}")
        await resp.content.readany()
        first = time.perf_counter()
        await resp.read()
    return (first - started) * 1000


async def wait_up(
    session: aiohttp.ClientSession, url: str, instances: int = 0, timeout_s: float = 20.0
) -> None:
    """Poll a node's /healthz until it answers with `instances` alive (bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with session.get(url) as resp:
                if resp.status == 200 and (await resp.json())["alive_instances"] >= instances:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


async def heartbeats(session: aiohttp.ClientSession, control: str, ids: list[str]) -> None:
    """Keep the registered ids alive (every second, well inside the instance TTL)."""
    while True:
        await asyncio.sleep(1.0)
        for iid in list(ids):
            async with session.post(f"{control}/{iid}/heartbeat") as resp:
                await resp.read()


def lua_commands() -> set[str]:
    """Commands the coordinator's Lua scripts run inside Redis (not round trips)."""
    lua = Path(__file__).resolve().parent.parent / "coordinator" / "lua"
    names: set[str] = set()
    for path in lua.glob("*.lua"):
        names.update(m.lower() for m in re.findall(r"redis\.call\('([A-Za-z]+)'", path.read_text()))
    return names


def redis_calls(client: SyncRedis) -> dict[str, int]:
    """Calls per command since the server started (INFO itself excluded)."""
    stats: dict[str, Any] = client.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): int(value["calls"])
        for name, value in stats.items()
        if name not in ("cmdstat_info",)
    }


async def closed_loop(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Requests/s completed by `args.concurrency` clients looping for `args.seconds`."""
    done = 0
    failed = 0
    deadline = time.perf_counter() + args.seconds
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client() -> None:
            nonlocal done, failed
            while time.perf_counter() < deadline:
                async with session.post(url, json=BODY) as resp:
                    await resp.read()
                    if resp.status == 200:
                        done += 1
                    else:
                        failed += 1

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - started
    if failed:
        raise RuntimeError(f"{failed} requests to {url} failed")
    return {"rps": done / elapsed, "requests": done}


def run(args: argparse.Namespace, redis_url: str) -> dict[str, Any]:
    """Start the engine and the node as processes, measure, stop them, clean the pool."""
    ports = free_port(), free_port(), free_port()
    pool = f"bench-{uuid.uuid4().hex[:8]}"
    procs = [
        subprocess.Popen([sys.executable, __file__, "--serve-engine", str(ports[0])]),
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "proxy_node",
                "--log-level",
                "WARNING",
                "--redis-url",
                redis_url,
                "--pool",
                pool,
                "--port",
                str(ports[1]),
                "--control-port",
                str(ports[2]),
                "--scrape-interval-s",
                "0",
                "--node-id",
                "bench-node",
            ],
            env={**os.environ, "COORD_REDIS_TIMEOUT_MS": "2000"},
        ),
    ]
    redis = SyncRedis.from_url(redis_url)
    try:
        return asyncio.run(measure(args, redis, *ports))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        redis.close()
        delete_pool(redis_url, pool, "lc")


async def measure(
    args: argparse.Namespace, redis: SyncRedis, engine_port: int, node_port: int, control_port: int
) -> dict[str, Any]:
    """TTFT pairs, Redis calls, then the closed loops."""
    engine_url = f"http://127.0.0.1:{engine_port}"
    node_url = f"http://127.0.0.1:{node_port}"
    async with aiohttp.ClientSession() as session:
        await wait_up(session, f"http://127.0.0.1:{control_port}/healthz")
        control = f"http://127.0.0.1:{control_port}/v1/instances"
        ids = ["engine-0"]
        await register(session, control, ids[0], engine_url)
        beats = asyncio.create_task(heartbeats(session, control, ids))
        await wait_up(session, node_url + "/healthz", instances=1)
        direct = engine_url + "/v1/chat/completions"
        proxied = node_url + "/v1/chat/completions"
        for _ in range(args.warmup):
            await ttft_ms(session, direct)
            await ttft_ms(session, proxied)
        d_ms: list[float] = []
        p_ms: list[float] = []
        before = redis_calls(redis)
        for i in range(args.requests):
            order = (direct, proxied) if i % 2 == 0 else (proxied, direct)
            for url in order:
                value = await ttft_ms(session, url)
                (d_ms if url == direct else p_ms).append(value)
        after = redis_calls(redis)
        loops = [("direct to the engine", 0, await closed_loop(direct, args))]
        for count in (1, args.aliases):
            while len(ids) < count:
                ids.append(f"engine-{len(ids)}")
                await register(session, control, ids[-1], engine_url)
            await wait_up(session, node_url + "/healthz", instances=count)
            retries = await node_metric(session, node_url, "proxy_reserve_retries_total")
            scripts_before = redis_calls(redis).get("evalsha", 0)
            result = await closed_loop(proxied, args)
            result["retries"] = (
                await node_metric(session, node_url, "proxy_reserve_retries_total") - retries
            ) / max(1, result["requests"])
            result["scripts"] = (redis_calls(redis).get("evalsha", 0) - scripts_before) / max(
                1, result["requests"]
            )
            loops.append((f"through one node, {count} instance(s)", count, result))
        beats.cancel()
        with suppress(asyncio.CancelledError):
            await beats
    calls = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    calls = {k: v for k, v in calls.items() if v > 0}
    diffs = [p - d for p, d in zip(p_ms, d_ms, strict=True)]
    return {"direct": d_ms, "proxied": p_ms, "diffs": diffs, "calls": calls, "loops": loops}


async def register(session: aiohttp.ClientSession, control: str, iid: str, url: str) -> None:
    """Register one instance id for the engine, with a timing model, like an engine would."""
    async with session.post(control, json={"id": iid, "url": url, **TIMING}) as resp:
        if resp.status != 201:
            raise RuntimeError(f"registration failed: {resp.status} {await resp.text()}")


async def node_metric(session: aiohttp.ClientSession, node_url: str, name: str) -> float:
    """Sum of a metric's samples on the node's /metrics."""
    async with session.get(node_url + "/metrics") as resp:
        text = await resp.text()
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.split("{")[0].split(" ")[0] == name
    )


def table(result: dict[str, Any], args: argparse.Namespace, seconds: float) -> str:
    """The markdown section for docs/benchmarks.md."""
    d, p, diffs = result["direct"], result["proxied"], result["diffs"]
    n = len(p)
    internal = lua_commands()
    trips = {k: v for k, v in result["calls"].items() if k not in internal}
    inside = {k: v for k, v in result["calls"].items() if k in internal}
    per_request = sum(trips.values()) / n
    breakdown = ", ".join(f"{k} {v / n:.2f}" for k, v in sorted(trips.items()))
    in_scripts = sum(inside.values()) / n
    lines = [
        "## Proxy overhead",
        "",
        f"Generated by `python bench/proxy_overhead.py --write-docs --requests {args.requests} "
        f"--concurrency {args.concurrency} --seconds {args.seconds:g} --aliases {args.aliases}` "
        f"in {seconds:.0f} s: a zero-latency streaming engine ({CHUNKS} chunks), one node "
        "(`coordinator serve`, least_load, a private embedded Redis) and the client, three "
        f"processes on 2 shared cores. {n} direct and {n} proxied streamed requests "
        "alternate, one at a time (the order flips every pair); TTFT is send to first "
        "body chunk at the client.",
        "",
        "| TTFT | p50 ms | p99 ms |",
        "|---|---:|---:|",
        f"| direct to the engine | {pct(d, 0.5):.3f} | {pct(d, 0.99):.3f} |",
        f"| through one node | {pct(p, 0.5):.3f} | {pct(p, 0.99):.3f} |",
        f"| **overhead** (node − direct) | **{pct(p, 0.5) - pct(d, 0.5):.3f}** "
        f"| **{pct(p, 0.99) - pct(d, 0.99):.3f}** |",
        f"| pairwise difference (each proxied − its direct neighbour) | "
        f"{pct(diffs, 0.5):.3f} | {pct(diffs, 0.99):.3f} |",
        "",
        f"Redis round trips per proxied request, one at a time: **{per_request:.2f}** "
        f"(INFO commandstats delta over the latency run / proxied requests, counting "
        f"commands the node sends: {breakdown}); the scripts run {in_scripts:.1f} "
        "commands per request inside Redis. A request costs one `reserve`, which also "
        "carries the previous request's first-token mark and release (the node holds "
        "them up to `carry_ms`; one at a time, the next request comes sooner); the "
        "remainder is `carry` calls after a pause, the node's lease renewal and the "
        "heartbeats keeping the instance alive.",
        "",
        f"Closed loop, {args.concurrency} concurrent clients for {args.seconds:g} s each; the "
        "node makes one decision at a time (proxy_node.forwarding). With a single "
        "instance, a first-token mark or release landing between a decision's read and "
        "its reserve changes the instance's version, and the reserve re-reads (a retry); "
        f"with {args.aliases} instance ids registered for the same engine such changes "
        "rarely hit the chosen candidate. The load generator shares the 2 cores with the "
        "node, the engine and Redis, so these are lower bounds.",
        "",
        "| throughput | requests/s | reserve retries / request | script calls / request |",
        "|---|---:|---:|---:|",
    ]
    for label, _, loop in result["loops"]:
        retries = f"{loop['retries']:.2f}" if "retries" in loop else "–"
        scripts = f"{loop['scripts']:.2f}" if "scripts" in loop else "–"
        lines.append(f"| {label} | {loop['rps']:,.0f} | {retries} | {scripts} |")
    return "\n".join(lines)


def main() -> int:
    """Run the benchmark, print the table (and with --write-docs, record it in the docs)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2000, help="proxied (and direct) requests")
    parser.add_argument("--warmup", type=int, default=100, help="unmeasured requests of each kind")
    parser.add_argument("--concurrency", type=int, default=32, help="closed-loop clients")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each closed loop")
    parser.add_argument(
        "--aliases", type=int, default=8, help="instance ids for the engine in the last loop"
    )
    parser.add_argument("--redis-url", help="use this server instead of a private one")
    add_write_docs(parser)
    parser.add_argument("--serve-engine", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_engine:
        serve_engine(args.serve_engine)
        return 0
    started = time.perf_counter()
    if args.redis_url:
        result = run(args, args.redis_url)
    else:
        with EmbeddedRedis() as server:
            result = run(args, server.url)
    markdown = table(result, args, time.perf_counter() - started)
    print(markdown)
    if args.write_docs:
        write_section("proxy_overhead", markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
