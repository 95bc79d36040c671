"""Scaling: Redis cost per request, one shard's ceiling, a fleet's shard count, failover.

Every number comes from a private server started here (EmbeddedRedis: redis-server on
PATH, else the bundled valkey-server) and from local Sentinel topologies
(local_fleet/topologies.py). Server cost is read from the server itself: INFO commandstats
(usec spent in EVALSHA) and INFO cpu (user+sys CPU of the whole server process,
networking included). The script prints its tables; with --write-docs it also
writes docs/scaling.md.

    python bench/scaling.py --write-docs   # about 3 minutes on 2 cores
    python bench/scaling.py --quick        # a smoke run (smaller samples), print only
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from redis import Redis as SyncRedis
from redis.asyncio import Redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.docs import add_write_docs  # noqa: E402
from coordinator import Coordinator, InstanceSpec, Settings  # noqa: E402
from coordinator.keys import PoolKeys  # noqa: E402
from coordinator.scripts import Scripts  # noqa: E402
from local_fleet.embedded import EmbeddedRedis  # noqa: E402
from local_fleet.pools import delete_pool  # noqa: E402

DOC = ROOT / "docs" / "scaling.md"
SETTINGS = Settings(instance_ttl_ms=600_000, heartbeat_interval_ms=1_000, redis_timeout_ms=5_000)

# The fleet the brief asks about.
FLEET_INSTANCES = 10_000
FLEET_NODES = 200
FLEET_RPS = 50_000
SHARD_BUDGET = 0.6  # plan a shard at 60% of one core: headroom for spikes and re-asserts
HEARTBEAT_S = 3.0  # heartbeat_interval_ms default: one row change per instance per 3 s
ROUND_TRIP_S = 0.0005  # assumed node<->Redis round trip plus queueing in a data centre


def instance_spec(i: int) -> InstanceSpec:
    """A realistic registration: timing model, slots, model name, two tags."""
    return InstanceSpec(
        id=f"inst-{i:05d}",
        url=f"http://10.0.{i // 250}.{i % 250}:8000",
        max_slots=64,
        prefill_ms_per_token=0.08,
        prefill_overhead_ms=10.0,
        decode_ms_per_token=16.0,
        model="llama-3.1-8b-instruct",
        tags=("h100", f"zone-{i % 3}"),
    )


def server_counters(client: SyncRedis) -> dict[str, float]:
    """EVALSHA calls/usec, server CPU seconds, bytes written: monotonic counters."""
    stats = client.info("commandstats")
    cpu = client.info("cpu")
    net = client.info("stats")
    calls = usec = 0.0
    for name in ("evalsha", "eval"):
        entry = stats.get(f"cmdstat_{name}", {})
        calls += float(entry.get("calls", 0))
        usec += float(entry.get("usec", 0))
    return {
        "calls": calls,
        "usec": usec,
        "cpu_s": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
        "net_out": float(net["total_net_output_bytes"]),
    }


def diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Counter deltas."""
    return {k: after[k] - before[k] for k in after}


def resp_bytes(value: Any) -> int:
    """Bytes of a RESP2 reply as the server writes it (bytes, ints, nil, arrays)."""
    if value is None:
        return 5  # $-1\r\n
    if isinstance(value, int):
        return len(f":{value}\r\n")
    if isinstance(value, bytes):
        return len(f"${len(value)}\r\n") + len(value) + 2
    if isinstance(value, list):
        return len(f"*{len(value)}\r\n") + sum(resp_bytes(v) for v in value)
    raise TypeError(type(value))


async def register_pool(url: str, pool: str, instances: int, hints: bool = False) -> None:
    """Register `instances` instances (optionally with engine hints) in a fresh pool."""
    c = Coordinator(Redis.from_url(url, decode_responses=True), pool=pool, settings=SETTINGS)
    for i in range(instances):
        await c.register_instance(instance_spec(i))
        if hints:
            await c.heartbeat_instance(
                f"inst-{i:05d}", {"engine_running": 12, "engine_waiting": 3, "queue_depth": 0}
            )
    await c.close()


# --------------------------------------------------------------------------- 1. rows


@dataclass
class RowCost:
    rows: int
    usec_per_call: float
    bytes_per_reply: int
    spec_bytes: float  # mean RESP bytes of the spec JSON inside one row


async def _delta_costs(url: str, pool: str, instances: int, calls: int) -> list[RowCost]:
    """Snapshot replies carrying exactly R changed rows: server usec and reply bytes."""
    raw = Redis.from_url(url)  # bytes replies: RESP sizes are exact
    scripts = Scripts.register(raw)
    keys = PoolKeys("lc", pool).columns
    sync = SyncRedis.from_url(url, decode_responses=True)
    pool_keys = PoolKeys("lc", pool)
    run_id = sync.hget(pool_keys.column("meta"), "run_id") or ""
    version = int(sync.hget(pool_keys.column("meta"), "version") or 0)
    out = []
    for rows in (0, 1, 8, 64, 256, instances):
        # `since` = the version of the (R+1)-th most recently changed instance, so
        # exactly R rows are newer (0 = a full read of every row).
        since = version
        if rows:
            older = sync.zrevrange(pool_keys.column("changes"), rows, rows, withscores=True)
            since = int(older[0][1]) if older else 0
        reply = await scripts["snapshot"](keys=keys, args=[since, run_id])
        assert len(reply[4]) == rows, (rows, len(reply[4]))
        n = max(20, calls // max(1, rows))
        before = server_counters(sync)
        for _ in range(n):
            await scripts["snapshot"](keys=keys, args=[since, run_id])
        d = diff(server_counters(sync), before)
        specs = [resp_bytes(row[1]) for row in reply[4]]
        spec_bytes = statistics.fmean(specs) if specs else 0.0
        out.append(RowCost(rows, d["usec"] / d["calls"], resp_bytes(reply), spec_bytes))
    sync.close()
    await raw.aclose()
    return out


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - slope * mx, slope


def script_floor(url: str, calls: int) -> dict[str, float]:
    """EVALSHA usec of `return 1`, and of the shared Lua prelude with all 16 keys."""
    client = SyncRedis.from_url(url)
    prelude = (resources.files("coordinator") / "lua" / "_lib.lua").read_text()
    keys = PoolKeys("lc", "floor").columns
    out = {}
    for name, source, nkeys in (
        ("empty", "return 1", []),
        ("prelude", prelude + "\nreturn 1", keys),
    ):
        script = client.register_script(source)
        script(keys=nkeys)
        before = server_counters(client)
        for _ in range(calls):
            script(keys=nkeys)
        d = diff(server_counters(client), before)
        out[name] = d["usec"] / d["calls"]
    client.close()
    return out


def measure_rows(url: str, quick: bool) -> dict[str, Any]:
    """Section 1: the cost and size of one delta row, with and without engine hints."""
    out: dict[str, Any] = {"floor": script_floor(url, 1000 if quick else 5000)}
    for hints in (False, True):
        pool = f"rows-{int(hints)}"
        asyncio.run(register_pool(url, pool, 1024, hints=hints))
        costs = asyncio.run(_delta_costs(url, pool, 1024, 2000 if quick else 20000))
        delete_pool(url, pool, SETTINGS.key_prefix)
        base, per_row = fit([c.rows for c in costs], [c.usec_per_call for c in costs])
        b0, b_row = fit([c.rows for c in costs], [c.bytes_per_reply for c in costs])
        out["hints" if hints else "plain"] = {
            "costs": costs,
            "usec_base": base,
            "usec_per_row": per_row,
            "bytes_base": b0,
            "bytes_per_row": b_row,
            "spec_bytes": statistics.fmean(c.spec_bytes for c in costs if c.rows),
        }
    return out


# --------------------------------------------------------------------------- 2. cycle


async def _cycles(url: str, pool: str, nodes: int, cycles: int) -> dict[str, float]:
    """`nodes` Coordinators in one process, each running full request cycles."""
    made = [
        await Coordinator.connect(
            url, pool=pool, node_id=f"n{k}", settings=SETTINGS, background=False
        )
        for k in range(nodes)
    ]
    for c in made:
        await c.refresh()
    per_node = max(1, cycles // nodes)
    sync = SyncRedis.from_url(url, decode_responses=True)
    rows_before = sum(c._cache.rows_applied for c in made)
    before = server_counters(sync)

    async def run(c: Coordinator) -> None:
        live: list[str] = []
        for _ in range(per_node):
            res = await c.reserve(512, 128)
            await c.mark_first_token(res.rid)
            live.append(res.rid)
            if len(live) > 8:  # a steady state of live reservations per node
                await c.release(live.pop(0))
        for rid in live:
            await c.release(rid)

    t0 = time.perf_counter()
    await asyncio.gather(*(run(c) for c in made))
    wall = time.perf_counter() - t0
    d = diff(server_counters(sync), before)
    rows = sum(c._cache.rows_applied for c in made) - rows_before
    sync.close()
    for c in made:
        await c.close()
    total = per_node * nodes
    return {
        "requests": total,
        "rps": total / wall,
        "calls_per_req": d["calls"] / total,
        "usec_per_req": d["usec"] / total,
        "cpu_us_per_req": d["cpu_s"] * 1e6 / total,
        "rows_per_call": rows / d["calls"],
        "bytes_per_req": d["net_out"] / total,
    }


async def _per_script(url: str, pool: str, batch: int) -> dict[str, float]:
    """Script usec per call of reserve, mark_first_token, release (one node, batches)."""
    c = await Coordinator.connect(
        url, pool=pool, node_id="solo", settings=SETTINGS, background=False
    )
    await c.refresh()
    sync = SyncRedis.from_url(url, decode_responses=True)
    out: dict[str, float] = {}
    held = []
    before = server_counters(sync)
    for _ in range(batch):
        held.append(await c.reserve(512, 128))
    d = diff(server_counters(sync), before)
    out["reserve"] = d["usec"] / d["calls"]
    for name, call in (("mark_first_token", c.mark_first_token), ("release", c.release)):
        before = server_counters(sync)
        for res in held:
            await call(res.rid)
        d = diff(server_counters(sync), before)
        out[name] = d["usec"] / d["calls"]
    sync.close()
    await c.close()
    return out


def measure_cycles(url: str, quick: bool) -> list[dict[str, Any]]:
    """Section 2: Redis cost of one full request cycle by pool size and node count."""
    out = []
    cycles = 600 if quick else 4000
    for instances in (64, 1024):
        pool = f"cycle-{instances}"
        asyncio.run(register_pool(url, pool, instances))
        scripts = asyncio.run(_per_script(url, pool, 200 if quick else 1000))
        for nodes in (1, 4, 16, 64):
            result: dict[str, Any] = dict(asyncio.run(_cycles(url, pool, nodes, cycles)))
            result.update(instances=instances, nodes=nodes)
            if nodes == 1:
                result["scripts"] = scripts
            out.append(result)
            print(
                f"  cycle: {instances:5d} instances, {nodes:3d} nodes: "
                f"{result['usec_per_req']:.1f} us EVALSHA, {result['cpu_us_per_req']:.1f} us CPU, "
                f"{result['rows_per_call']:.1f} rows/call",
                flush=True,
            )
        delete_pool(url, pool, SETTINGS.key_prefix)
    return out


# --------------------------------------------------------------------------- 3. shard


async def _node_load(
    url: str, pool: str, node: str, concurrency: int, seconds: float, barrier: Any
) -> dict[str, int]:
    c = await Coordinator.connect(url, pool=pool, node_id=node, settings=SETTINGS, background=False)
    await c.refresh()
    rows_before = c._cache.rows_applied
    await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
    deadline = time.monotonic() + seconds
    done = 0

    async def loop() -> None:
        nonlocal done
        while time.monotonic() < deadline:
            res = await c.reserve(512, 128)
            await c.mark_first_token(res.rid)
            await c.release(res.rid)
            done += 1

    await asyncio.gather(*(loop() for _ in range(concurrency)))
    rows = c._cache.rows_applied - rows_before
    await c.close()
    return {"done": done, "rows": rows}


def _node_process(args: tuple[str, str, str, int, float, Any]) -> dict[str, int]:
    return asyncio.run(_node_load(*args))


def measure_shard(url: str, quick: bool) -> list[dict[str, Any]]:
    """Section 3: node processes drive full cycles at one pool until the server saturates."""
    seconds = 3.0 if quick else 8.0
    grid = (
        [(1, 1), (2, 1), (2, 16)] if quick else [(1, 1), (2, 1), (4, 1), (1, 16), (2, 16), (4, 16)]
    )
    out = []
    pool = "shard-64"
    asyncio.run(register_pool(url, pool, 64))
    ctx = mp.get_context("spawn")
    sync = SyncRedis.from_url(url, decode_responses=True)
    for procs, concurrency in grid:
        with ctx.Manager() as manager, ctx.Pool(procs) as workers:
            barrier = manager.Barrier(procs + 1)
            pending = workers.map_async(
                _node_process,
                [(url, pool, f"p{k}", concurrency, seconds, barrier) for k in range(procs)],
            )
            barrier.wait()
            t0 = time.monotonic()
            before = server_counters(sync)
            time.sleep(seconds)
            d = diff(server_counters(sync), before)
            wall = time.monotonic() - t0
            results = pending.get()
        done = sum(r["done"] for r in results)
        rps = done / seconds
        requests = rps * wall
        result = {
            "procs": procs,
            "concurrency": concurrency,
            "rps": rps,
            "server_cpu": d["cpu_s"] / wall,
            "cpu_us_per_req": d["cpu_s"] * 1e6 / requests,
            "usec_per_req": d["usec"] / requests,
            "calls_per_req": d["calls"] / requests,
            "rows_per_call": sum(r["rows"] for r in results) / max(1.0, 3.0 * done),
        }
        result["ceiling_rps"] = 1e6 / result["cpu_us_per_req"]
        out.append(result)
        print(
            f"  shard: {procs} node processes x {concurrency}: {rps:,.0f} req/s, "
            f"server CPU {result['server_cpu']:.0%}, {result['cpu_us_per_req']:.1f} us CPU/req, "
            f"{result['rows_per_call']:.1f} rows/call",
            flush=True,
        )
    sync.close()
    delete_pool(url, pool, SETTINGS.key_prefix)
    return out


# --------------------------------------------------------------------------- 4. failover


async def _failover_trial() -> dict[str, float]:
    from local_fleet.topologies import LocalSentinel

    topology = LocalSentinel(down_after_ms=1000, failover_timeout_ms=3000).start()
    settings = Settings(
        instance_ttl_ms=600_000,
        heartbeat_interval_ms=1_000,
        redis_timeout_ms=300,
        recovery_interval_ms=50,
    )
    try:
        c = await Coordinator.connect(
            topology.url, pool="failover", settings=settings, background=False
        )
        for i in range(8):
            await c.register_instance(instance_spec(i))
        served = 0
        stop = False
        warmed = asyncio.Event()

        async def load() -> None:
            nonlocal served
            while not stop:
                res = await c.reserve(512, 128)
                await c.mark_first_token(res.rid)
                await c.release(res.rid)
                served += 1
                if served >= 50:
                    warmed.set()
                await asyncio.sleep(0.001)

        task = asyncio.create_task(load())
        await asyncio.wait_for(warmed.wait(), 30)
        killed = time.monotonic()
        topology.crash_master()
        seen_degraded = None
        deadline = killed + 30
        while time.monotonic() < deadline:
            if c.coordination == "degraded" and seen_degraded is None:
                seen_degraded = time.monotonic()
            if seen_degraded is not None and c.coordination == "ok":
                break
            await asyncio.sleep(0.005)
        back = time.monotonic()
        stop = True
        await task
        await c.close()
        return {
            "detect_ms": ((seen_degraded or back) - killed) * 1000,
            "gap_ms": (back - killed) * 1000,
        }
    finally:
        topology.stop()


def measure_failover(quick: bool) -> list[dict[str, float]]:
    """Section 4: SIGKILL the master under load; time until coordination is ok again."""
    out = []
    for _ in range(1 if quick else 3):
        result = asyncio.run(_failover_trial())
        out.append(result)
        print(f"  failover: gap {result['gap_ms']:.0f} ms", flush=True)
    return out


# --------------------------------------------------------------------------- 5. fleet


def distinct(touches: float, instances: int) -> float:
    """Expected distinct instances among `touches` uniform picks."""
    return float(instances * (1 - (1 - 1 / instances) ** touches))


@dataclass
class Scenario:
    name: str
    pools: int
    nodes_per_pool: int
    delta_calls: int = 3  # script calls per request that carry a delta
    spec_in_rows: bool = True


def fleet(constants: dict[str, float]) -> list[dict[str, Any]]:
    """Shards needed for the target fleet under four layouts, from the measured constants."""
    scenarios = [
        Scenario("1 pool of 10,000, all 200 nodes", 1, FLEET_NODES),
        Scenario("50 pools of 200, every node serves every pool", 50, FLEET_NODES),
        Scenario("50 pools of 200, 4 nodes per pool (LB routes by model)", 50, 4),
        Scenario(
            "same, proposed: delta on reserve only, no spec in rows", 50, 4, 1, spec_in_rows=False
        ),
    ]
    out = []
    for s in scenarios:
        instances = FLEET_INSTANCES // s.pools
        pool_rps = FLEET_RPS / s.pools
        # A node's call returns the rows changed since the reply that set its cache
        # version: one call interval apart for a node calling less often than once per
        # round trip, else about one round trip. Each call changes one row; heartbeats
        # add instances / 3 s.
        node_calls = 3 * pool_rps / s.nodes_per_pool
        window = max(ROUND_TRIP_S, 1 / node_calls)
        change_rate = 3 * pool_rps + instances / HEARTBEAT_S
        rows_per_call = distinct(change_rate * window, instances)
        rows_per_req = s.delta_calls * rows_per_call
        cpu_us = constants["base_us"] + constants["cpu_per_row_us"] * rows_per_req
        shard_rps = SHARD_BUDGET * 1e6 / cpu_us
        total_cpu = FLEET_RPS * cpu_us / 1e6  # cores
        row_bytes = constants["bytes_per_row"] - (0 if s.spec_in_rows else constants["spec_bytes"])
        bytes_req = 3 * constants["bytes_base"] + row_bytes * rows_per_req
        out.append(
            {
                "name": s.name,
                "pools": s.pools,
                "pool_rps": pool_rps,
                "rows_per_call": rows_per_call,
                "rows_per_req": rows_per_req,
                "cpu_us": cpu_us,
                "shard_rps": shard_rps,
                "shards": math.ceil(total_cpu / SHARD_BUDGET),
                "fits": pool_rps <= shard_rps,
                "bytes_req": bytes_req,
                "egress": bytes_req * FLEET_RPS,
            }
        )
    return out


# --------------------------------------------------------------------------- report


def human_bytes(n: float) -> str:
    """1.2 KB, 3.4 MB, ..."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n:,.1f} TB"


@dataclass
class Results:
    """Everything the report needs."""

    version: str
    load: tuple[float, float]  # 1-minute load average before and after
    elapsed_s: float
    quick: bool
    rows: dict[str, Any]
    cycles: list[dict[str, Any]]
    shard: list[dict[str, Any]]
    failover: list[dict[str, float]]
    constants: dict[str, float]
    estimate: list[dict[str, Any]]


def render(r: Results) -> str:
    """docs/scaling.md, from the measurements."""
    k = r.constants
    plain, hinted, floor = r.rows["plain"], r.rows["hints"], r.rows["floor"]
    one = {c["instances"]: c for c in r.cycles if c["nodes"] == 1}
    small, large = one[64], one[1024]
    gaps = [f["gap_ms"] for f in r.failover]
    best = max(r.shard, key=lambda x: x["rps"])
    lean = min(r.shard, key=lambda x: x["cpu_us_per_req"])
    busy = max(r.shard, key=lambda x: x["rows_per_call"])
    single, spread, grouped, proposed = r.estimate
    command = "python bench/scaling.py --write-docs" + (" --quick" if r.quick else "")
    out = [
        "# Scaling: shards, pools and failover",
        "",
        "How far one Redis shard carries the coordinator, how many shards a large fleet",
        "needs, what breaks first, and what a Sentinel failover costs. Every number here",
        f"was measured by `{command}` ({r.elapsed_s:.0f} s) on this machine: 2 cores shared",
        f"with other work (1-minute load average {r.load[0]:.1f} before, {r.load[1]:.1f} after), {r.version}.",
        "Rerun the command to regenerate this file. A dedicated server core is faster;",
        "treat the absolute µs as an upper bound and the ratios as the finding.",
        "",
        "Related tests: `pytest tests/library/test_redis_cluster.py` (a 3-primary cluster: pools on",
        "different shards, the invariants, NOSCRIPT after SCRIPT FLUSH on every primary,",
        "losing one primary, two proxy nodes) and `pytest tests/library/test_sentinel.py -s` (the",
        "failover under streaming load; it prints the gap).",
        "",
        "## How a fleet maps onto Redis",
        "",
        "- Every key of a pool carries the hash tag `{pool}`: a pool lives in one hash",
        "  slot, on one shard, and all its scripts stay atomic there. Redis Cluster spreads",
        "  *pools* over shards; it never spreads one pool. **One pool is bounded by one",
        "  shard**: its request rate cannot exceed what one Redis core executes.",
        "- Connect with `redis+cluster://host:port[,host:port...]` (redis-py RedisCluster)",
        "  or `redis+sentinel://host:port[,host:port...]/master-name[/db]` (the master the",
        "  sentinels name, followed across failovers).",
        "- With many pools on a cluster, set `cluster-require-full-coverage no`: losing a",
        "  shard then stops only that shard's pools (their nodes run degraded and re-assert",
        "  when it returns), not every pool. The cluster test kills a primary to check it.",
        "",
        "## 1. Redis CPU per request",
        "",
        "A request runs three scripts: `reserve`, `mark_first_token` and `release`. Each",
        "reply piggybacks the pool's rows changed since the node's cache version (the",
        "incremental snapshot), so the cost is a fixed part plus a part per delta row.",
        "",
        "Per script, one node, batches of reserves, then first tokens, then releases",
        "(INFO commandstats: EVALSHA usec per call):",
        "",
        "| instances | reserve µs | mark_first_token µs | release µs |",
        "|---:|---:|---:|---:|",
    ]
    for c in (small, large):
        s = c["scripts"]
        out.append(
            f"| {c['instances']:,} | {s['reserve']:.0f} | {s['mark_first_token']:.0f} | {s['release']:.0f} |"
        )
    out += [
        "",
        "Full request cycles (reserve, first token, release; 8 live reservations per",
        "node). `nodes` are independent Coordinators interleaving their cycles on one pool.",
        "EVALSHA µs is time inside scripts (INFO commandstats); server CPU µs is INFO",
        "cpu user+sys of the whole server process, so it adds parsing, networking and",
        "the event loop. EVALSHA time is wall time, so where it exceeds the CPU (many",
        "nodes in one client process) the server was preempted mid-script by the clients",
        "on this 2-core machine; CPU is the number to plan with:",
        "",
        "| instances | nodes | EVALSHA µs/request | server CPU µs/request | scripts/request | delta rows/call | bytes out/request |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in r.cycles:
        out.append(
            f"| {c['instances']:,} | {c['nodes']} | {c['usec_per_req']:.0f} | {c['cpu_us_per_req']:.0f} "
            f"| {c['calls_per_req']:.2f} | {c['rows_per_call']:.1f} | {human_bytes(c['bytes_per_req'])} |"
        )
    out += [
        "",
        f"**One request costs {small['usec_per_req']:.0f} µs of script time and {small['cpu_us_per_req']:.0f} µs of server CPU**",
        f"with a 64-instance pool, and {large['usec_per_req']:.0f} / {large['cpu_us_per_req']:.0f} µs with 1,024 instances: the",
        "pool size hardly matters, because no script scans the pool (the node sends its",
        "ranked candidates in ARGV, and the earliest-ending reservation of an instance is",
        "one ZRANGEBYLEX on a lex index). What grows is the delta, with the number of",
        "nodes sharing the pool.",
        "",
        "One delta row, measured directly: the `snapshot` script asked for exactly R",
        "changed rows of a 1,024-instance pool. Reply bytes are the exact RESP2 size of",
        f"the real reply. For scale: EVALSHA of `return 1` costs {floor['empty']:.1f} µs here, and the",
        f"shared prelude every script starts with (coordinator/lua/_lib.lua) {floor['prelude']:.1f} µs.",
        "",
        "| rows R | µs/call, plain rows | reply bytes, plain | µs/call, rows with 3 hints | reply bytes, with hints |",
        "|---:|---:|---:|---:|---:|",
    ]
    for a, b in zip(plain["costs"], hinted["costs"], strict=True):
        out.append(
            f"| {a.rows:,} | {a.usec_per_call:.0f} | {a.bytes_per_reply:,} | {b.usec_per_call:.0f} | {b.bytes_per_reply:,} |"
        )
    out += [
        "",
        f"A delta row costs **{plain['usec_per_row']:.1f} µs of script time and {plain['bytes_per_row']:.0f} bytes**",
        f"({hinted['usec_per_row']:.1f} µs and {hinted['bytes_per_row']:.0f} bytes when the engine reports hints).",
        f"{plain['spec_bytes']:.0f} of those bytes are the instance's spec JSON, which almost never changes.",
        "Fitted on the cycle table (server CPU, networking included):",
        f"**{k['base_us']:.0f} µs per request + {k['cpu_per_row_us']:.1f} µs per delta row**.",
        "",
        "## 2. Requests per second on one shard, one pool",
        "",
        "Node processes, each one Coordinator running full cycles with 1 to 16",
        "requests in flight, against one private server and one 64-instance pool",
        "(requests/s counted by the nodes, CPU from INFO cpu over the same window):",
        "",
        "| node processes | requests in flight per node | requests/s | server CPU (INFO cpu) | server CPU µs/request | delta rows/call | server ceiling (100% of a core) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x in r.shard:
        out.append(
            f"| {x['procs']} | {x['concurrency']} | {x['rps']:,.0f} | {x['server_cpu']:.0%} | {x['cpu_us_per_req']:.0f} "
            f"| {x['rows_per_call']:.1f} | {x['ceiling_rps']:,.0f} req/s |"
        )
    out += [
        "",
        f"The best run sustained **{best['rps']:,.0f} requests/s with the server at {best['server_cpu']:.0%} of one core**.",
        "The Python node processes and the server share the two cores here, so the",
        "clients saturate first; the server's own limit is its CPU per request. With",
        f"sparse callers that is {lean['cpu_us_per_req']:.0f} µs, **a ceiling of {lean['ceiling_rps']:,.0f} requests/s per shard**",
        f"at 100% of a core ({lean['ceiling_rps'] * SHARD_BUDGET:,.0f} at the {SHARD_BUDGET:.0%} we plan for).",
        f"Requests in flight inside one node count like extra nodes: with {busy['concurrency']} per node the",
        f"replies carried {busy['rows_per_call']:.1f} rows per call and a request cost {busy['cpu_us_per_req']:.0f} µs, because",
        "concurrent calls of one node share one cache version, so each reply repeats the",
        "rows the others changed meanwhile.",
        "",
        "## 3. Shards for 10,000 instances, 200 nodes, 50,000 requests/s",
        "",
        "The arithmetic, with the constants measured above:",
        "",
        "- A request makes 3 script calls and each changes one row, so a pool serving",
        "  R req/s changes 3R rows/s, plus one row per instance per 3 s of heartbeats.",
        "- A call returns the rows changed since the reply that set the node's cache",
        "  version: one call interval earlier for a node that calls less often than once",
        f"  per round trip, else about one round trip ({ROUND_TRIP_S * 1000:.1f} ms assumed in a data centre).",
        "  With n nodes sharing a pool evenly, one call interval holds about n changes:",
        "  **delta rows per call ≈ the number of nodes sharing the pool** (fewer when",
        "  they hit the same instances, more when nodes are busier than a round trip).",
        f"- Server CPU per request = {k['base_us']:.0f} µs + {k['cpu_per_row_us']:.1f} µs × delta rows per request.",
        f"- A shard is planned at {SHARD_BUDGET:.0%} of one core, so shards = fleet CPU / {SHARD_BUDGET}, and each pool must",
        "  fit inside one shard (the hash-slot constraint).",
        "",
        "| layout | pool req/s | delta rows/call | server CPU µs/request | one shard carries | pool fits one shard? | shards | bytes/request | Redis egress |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for e in r.estimate:
        out.append(
            f"| {e['name']} | {e['pool_rps']:,.0f} | {e['rows_per_call']:,.0f} | {e['cpu_us']:,.0f} | {e['shard_rps']:,.0f} req/s "
            f"| {'yes' if e['fits'] else '**no**'} | {e['shards']:,}{'' if e['fits'] else ' (moot)'} "
            f"| {human_bytes(e['bytes_req'])} | {human_bytes(e['egress'])}/s |"
        )
    no_delta = SHARD_BUDGET * 1e6 / k["base_us"]
    out += [
        "",
        "Read honestly:",
        "",
        "- **One pool of 10,000 instances at 50,000 req/s cannot be served by this design,",
        f"  at any shard count.** The pool lives on one shard, which carries about {single['shard_rps']:,.0f} req/s",
        f"  in that layout, and even with no delta at all one shard tops out near {no_delta:,.0f} req/s.",
        "  A pool that large must be split into sub-pools.",
        "- Splitting into 50 pools is not enough while every node serves every pool:",
        f"  each call still carries ~{spread['rows_per_call']:,.0f} rows, so no pool fits its shard (one carries",
        f"  {spread['shard_rps']:,.0f} req/s, a pool needs {spread['pool_rps']:,.0f}); the fleet's CPU alone would take {spread['shards']:,} shards",
        f"  and Redis would send {human_bytes(spread['egress'])}/s.",
        "- With 50 pools and nodes grouped per pool (the load balancer routes a model to",
        f"  its 4 nodes), a request costs {grouped['cpu_us']:.0f} µs and **the fleet needs {grouped['shards']} shards** (each pool's",
        f"  {grouped['pool_rps']:,.0f} req/s fits in one), plus a replica each for failover. With the",
        f"  changes proposed in section 5, {proposed['shards']} shards.",
        "",
        "## 4. The incremental snapshot's network bytes per decision",
        "",
        f"A delta row is {plain['bytes_per_row']:.0f} bytes ({hinted['bytes_per_row']:.0f} with hints). The change rate above gives",
        f"{single['rows_per_req']:,.0f} rows per request in one shared pool ({human_bytes(single['bytes_req'])} per decision),",
        f"{spread['rows_per_req']:,.0f} when every node serves all 50 pools ({human_bytes(spread['bytes_req'])}), {grouped['rows_per_req']:.0f} with grouped",
        f"nodes ({human_bytes(grouped['bytes_req'])}), and {proposed['rows_per_req']:.0f} with the proposed changes ({human_bytes(proposed['bytes_req'])}).",
        "A decision's cost does not grow with the number of *instances*; it grows with",
        "the number of *nodes sharing a pool*, since every node must hear of every other",
        "node's changes.",
        "",
        "## 5. What breaks first, and what we would change",
        "",
        "1. **The delta fan-out breaks first.** Server CPU and egress grow with nodes ×",
        "   changes per pool. In order of payoff:",
        "   - Route by pool at the load balancer, so a few nodes share each pool.",
        "   - Carry the delta on `reserve` only; `mark_first_token` and `release` answer",
        "     a status and the one row they changed (a third of the rows).",
        "   - Leave the spec JSON out of delta rows: send a spec version and fetch the",
        f"     spec when it changes ({plain['spec_bytes']:.0f} of {plain['bytes_per_row']:.0f} bytes per row).",
        "   - Past that, choose on the server: a per-pool sorted set of load scores",
        "     maintained by the same scripts, `reserve` takes its head (O(log n), one row",
        "     back), and nodes read full snapshots only for debug views and metrics.",
        "2. **One shard per pool** is the hard ceiling. A pool above one shard's rate",
        "   must become sub-pools (`model#0..k`, each exact within itself), with the",
        "   balancer hashing sessions onto them.",
        f"3. **Script cost** comes next: {k['base_us']:.0f} µs of server CPU per request before any",
        "   delta row. Of that, the EVALSHA floor and the shared prelude are small",
        f"   ({floor['empty']:.1f} µs and {floor['prelude']:.1f} µs per call, three calls per request); the rest is",
        "   the scripts' own work (reservation JSON, index updates, candidate checks),",
        "   not yet profiled line by line.",
        "4. **Failover** costs seconds of degraded mode per shard (below): nothing fails,",
        "   but choices in the gap use each node's local counters only.",
        "",
        "## 6. Sentinel failover",
        "",
        "1 master, 1 replica, 3 sentinels on loopback (quorum 2, down-after-milliseconds",
        "1000, failover-timeout 3000). A node runs request cycles, the master is SIGKILLed,",
        "and the gap is the time from the kill until the node's coordination is `ok` again",
        "on the promoted replica, its state re-asserted:",
        "",
        "| trial | kill → degraded | kill → coordination ok (the gap) |",
        "|---:|---:|---:|",
    ]
    for i, f in enumerate(r.failover, 1):
        out.append(f"| {i} | {f['detect_ms']:,.0f} ms | {f['gap_ms']:,.0f} ms |")
    out += [
        "",
        f"**Failover gap: {statistics.median(gaps):,.0f} ms (median).** The node notices on its first failed",
        "call and serves from local state meanwhile. The gap is down-after (1 s), then the",
        "sentinels' agreement, leader election and the promotion; lower",
        "`down-after-milliseconds` only as far as the network's worst pause allows.",
        "",
        "tests/library/test_sentinel.py runs the same failover under streaming load through two",
        "proxy nodes and checks that every request answers 200, that the nodes follow",
        "the promoted replica, that reservations the old master acknowledged but the",
        "replica never received are restored by the nodes' re-assert, and that counters",
        "equal the live reservations afterwards.",
        "",
        "**Known gaps (core), one fix.** (1) A *release* the old master acknowledged",
        "but never replicated leaves its reservation on the new master for as long as",
        "its node lives: the re-assert only adds. (2) A request that ends while the",
        "re-assert is restoring other reservations can have its own reservation restored",
        "after it was released locally (the race tests/service/test_proxy_cluster.py xfails).",
        "Both close in `Coordinator._reassert`: skip a reservation released before its",
        "restore, queue a release for one released during it, and finally release every",
        "rid of the node's `{pool}:node:<id>:rids` set that the node no longer holds.",
        "Until then `test_release_lost_in_failover_is_not_left_behind` is a strict xfail.",
        "",
    ]
    return "\n".join(out)


def main() -> int:
    """Run every section, print the tables; with --write-docs, write docs/scaling.md."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small samples, one failover")
    add_write_docs(parser, "docs/scaling.md")
    args = parser.parse_args()
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    server = EmbeddedRedis().start()
    try:
        version = server.version.split(" sha=")[0].split(" build=")[0]
        print("1. delta rows", flush=True)
        rows = measure_rows(server.url, args.quick)
        print("2. request cycles", flush=True)
        cycles = measure_cycles(server.url, args.quick)
        print("3. one shard", flush=True)
        shard = measure_shard(server.url, args.quick)
    finally:
        server.stop()
    print("4. failover", flush=True)
    failover = measure_failover(args.quick)
    # Fit on the runs without reserve retries: a retry is a whole extra script.
    clean = [c for c in cycles if c["calls_per_req"] < 3.2]
    base_us, per_row = fit(
        [3 * c["rows_per_call"] for c in clean], [c["cpu_us_per_req"] for c in clean]
    )
    plain = rows["plain"]
    constants = {
        "base_us": base_us,
        "cpu_per_row_us": per_row,
        "bytes_per_row": plain["bytes_per_row"],
        "bytes_base": plain["bytes_base"],
        "spec_bytes": plain["spec_bytes"],
    }
    results = Results(
        version=version,
        load=(load_before, os.getloadavg()[0]),
        elapsed_s=time.monotonic() - started,
        quick=args.quick,
        rows=rows,
        cycles=cycles,
        shard=shard,
        failover=failover,
        constants=constants,
        estimate=fleet(constants),
    )
    doc = render(results)
    print(doc)
    if args.write_docs:
        DOC.parent.mkdir(parents=True, exist_ok=True)
        DOC.write_text(doc)
        print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
