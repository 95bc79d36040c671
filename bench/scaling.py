"""Scaling: Redis cost per request by nodes and pool size, stalls, failover (issue 12).

Every number comes from a private server started here (EmbeddedRedis: redis-server on
PATH, else the bundled valkey-server) and from local Sentinel topologies
(local_fleet/topologies.py). Server cost is read from the server itself: INFO cpu
(user+sys CPU of the whole server process, networking included), INFO commandstats
(usec spent in EVALSHA, calls), INFO stats (bytes written) and SLOWLOG (the duration
of every single call while a stall scenario runs). The script prints its tables;
with --write-docs it also writes docs/scaling.md.

    python bench/scaling.py --write-docs   # about 8 minutes on 2 cores
    python bench/scaling.py --quick        # a smoke run (1/10 scale, 1 repetition)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from redis import Redis as SyncRedis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.docs import add_write_docs  # noqa: E402
from bench.replay import send_calls  # noqa: E402
from coordinator import Coordinator, InstanceSpec, Settings  # noqa: E402
from coordinator.connection import connect_redis  # noqa: E402
from coordinator.coordinator import (  # noqa: E402
    CANDIDATE_ARGS,
    CARRY_STEP,
    REAP_STEP,
    RESERVE_HEAD_ARGS,
    SPEC_READ_STEP,
    SWEEP_STEP,
    TIMING_STEP,
    LocalReservation,
)
from coordinator.keys import COLUMNS, PoolKeys  # noqa: E402
from coordinator.outliers import OutlierPolicy  # noqa: E402
from coordinator.packed import NO_SLOT, STATE_BYTES, pack_candidate  # noqa: E402
from coordinator.scripts import SCRIPT_NAMES, script_source, with_prelude  # noqa: E402
from coordinator.timing import flush_interval_ms  # noqa: E402
from local_fleet.embedded import EmbeddedRedis  # noqa: E402
from local_fleet.pools import delete_pool  # noqa: E402

DOC = ROOT / "docs" / "scaling.md"
# Leases far longer than any measurement: the harness runs without the lease loop.
SETTINGS = Settings(
    instance_ttl_ms=600_000,
    heartbeat_interval_ms=1_000,
    redis_timeout_ms=5_000,
    lease_ms=600_000,
)
PREFIX = SETTINGS.key_prefix

# Issue 12, "Done when".
FLAT_RATIO = 1.3  # CPU per request, 64 nodes / 1 node, at most
CPU_TARGET_US = {64: 80.0, 1024: 120.0}  # CPU per request with 1 node, at most
BYTES_TARGET = 2000  # bytes out per request at 64 instances, any node count
STALL_MS = 5.0  # no single call above this (SLOWLOG)
# The same targets as docs/scaling.md reported them before replies carried only the
# records a call changed (a full run at commit 452dbf7), shown beside this run's.
BEFORE_COMMIT = "452dbf7"
BEFORE = {
    "CPU/request 64 nodes ÷ 1 node, 64 instances": "1.18",
    "CPU/request 64 nodes ÷ 1 node, 1,024 instances": "0.93",
    "CPU/request, 1 node, 64 instances": "305 µs",
    "CPU/request, 1 node, 1,024 instances": "320 µs",
    "bytes out/request, 64 instances, every node count": "3,943 B at 64 nodes",
    "stalls": "0 calls; longest 3.74 ms",
}

SIZES = (64, 1024)
TIMING_SAMPLES = 64  # samples per timing flush in section 2 (one per instance)
NODE_COUNTS = (1, 4, 16, 64)
# A fleet to size with the measured cost (shards = fleet CPU / budget per shard).
FLEET_RPS = 50_000
SHARD_BUDGET = 0.6  # plan a shard at 60% of one core: headroom for spikes and re-asserts


def instance_spec(i: int, max_slots: int = 64) -> InstanceSpec:
    """A realistic registration: timing model, slots, model name, two tags."""
    return InstanceSpec(
        id=f"inst-{i:05d}",
        url=f"http://10.{i // 62500}.{i // 250 % 250}.{i % 250}:8000",
        max_slots=max_slots,
        prefill_ms_per_token=0.08,
        prefill_overhead_ms=10.0,
        decode_ms_per_token=16.0,
        model="llama-3.1-8b-instruct",
        tags=("h100", f"zone-{i % 3}"),
    )


OWN_COMMANDS = ("info", "slowlog", "config", "client", "hello", "ping", "script")


def server_counters(client: SyncRedis) -> dict[str, float]:
    """EVALSHA calls/usec, all calls, server CPU seconds, bytes written: monotonic counters."""
    stats = client.info("commandstats")
    cpu = client.info("cpu")
    net = client.info("stats")
    calls = usec = every = inner_usec = 0.0
    for key, entry in stats.items():
        name = str(key).removeprefix("cmdstat_").lower()
        if name.split("|")[0] in OWN_COMMANDS:
            continue
        every += float(entry.get("calls", 0))
        if name in ("evalsha", "eval"):
            calls += float(entry.get("calls", 0))
            usec += float(entry.get("usec", 0))
        else:  # inside scripts, or read_state's GETs after its EVALSHA (one call)
            inner_usec += float(entry.get("usec", 0))
    return {
        "calls": calls,
        "usec": usec,
        "commands": every,
        "inner_usec": inner_usec,
        "cpu_s": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
        "net_out": float(net["total_net_output_bytes"]),
    }


def diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Counter deltas."""
    return {k: after[k] - before[k] for k in after}


def load_scripts(client: SyncRedis) -> dict[str, str]:
    """Every script loaded on the server: name -> sha."""
    return {name: str(client.script_load(script_source(name))) for name in SCRIPT_NAMES}


class RawPool:
    """Pipelined script calls on one pool (setup only: the measured paths use Coordinator)."""

    def __init__(self, url: str, pool: str) -> None:
        self.client = SyncRedis.from_url(url, decode_responses=True)
        self.keys = PoolKeys(PREFIX, pool)
        self.columns = self.keys.columns
        self.sha = load_scripts(self.client)

    def many(
        self, name: str, calls: Iterable[tuple[list[Any], tuple[str, ...]]], batch: int = 500
    ) -> list[Any]:
        """Run `name` once per (args, extra keys), pipelined; replies in order."""
        out: list[Any] = []
        pipe = self.client.pipeline(transaction=False)
        queued = 0
        for args, extra in calls:
            keys = [*self.columns, *extra]
            pipe.evalsha(self.sha[name], len(keys), *keys, *args)
            queued += 1
            if queued == batch:
                out += pipe.execute()
                queued = 0
        if queued:
            out += pipe.execute()
        return out

    def register(self, specs: Iterable[InstanceSpec]) -> list[Any]:
        index = (self.keys.prefix_index(),)
        return self.many("register", (([s.id, s.to_json(), s.max_slots, 0], index) for s in specs))

    def lease(self, node: str, lease_ms: int = SETTINGS.lease_ms) -> None:
        """Take (or renew) `node`'s lease, as the node's renew_lease would."""
        self.many("renew_lease", [([node, lease_ms, "bench"], (self.keys.node_owner(node),))])

    def close(self) -> None:
        self.client.close()


def register_pool(url: str, pool: str, instances: int, max_slots: int = 64) -> None:
    """Register `instances` instances in a fresh pool (pipelined register calls)."""
    raw = RawPool(url, pool)
    raw.register(instance_spec(i, max_slots) for i in range(instances))
    raw.close()


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per-metric median over repetitions."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


# --------------------------------------------------------------------------- 1. cycles


class PoolSnapshot:
    """Every key of one pool, DUMPed, and put back exactly (RESTORE ... REPLACE)."""

    def __init__(self, url: str, pool: str) -> None:
        self.client = SyncRedis.from_url(url)  # bytes: DUMP payloads are binary
        self.pattern = PoolKeys(PREFIX, pool).pattern()
        self.keys: dict[bytes, bytes] = {}

    def take(self) -> PoolSnapshot:
        found = list(self.client.scan_iter(match=self.pattern, count=500))
        self.keys = {k: payload for k in found if (payload := self.client.dump(k)) is not None}
        return self

    def restore(self) -> None:
        found = list(self.client.scan_iter(match=self.pattern, count=500))
        if found:
            self.client.delete(*found)
        for key, payload in self.keys.items():
            self.client.restore(key, 0, payload, replace=True)

    def close(self) -> None:
        self.client.close()


@dataclass
class Recorder:
    """The script calls Coordinators send, in the order they send them, with the
    status each got: replayed later, pipelined, onto the same starting state."""

    calls: list[tuple[str, list[Any], list[Any]]] = field(default_factory=list)
    statuses: list[Any] = field(default_factory=list)

    def attach(self, c: Coordinator) -> None:
        inner = c._direct_call

        async def recording(name: str, args: list[Any], extra: tuple[Any, ...] = ()) -> Any:
            self.calls.append((name, [*c._columns, *extra], list(args)))
            at = len(self.statuses)
            self.statuses.append(None)
            reply = await inner(name, args, extra)
            self.statuses[at] = status_of(reply)
            return reply

        c._direct_call = recording  # type: ignore[method-assign]

    def replay(self, url: str, batch: int = 500) -> dict[str, float]:
        """Send every recorded call again in pipelines of `batch`; the server's counters
        for them, and the share of calls whose status matched the recorded run's."""
        client = SyncRedis.from_url(url, decode_responses=True)
        sha = load_scripts(client)
        before = server_counters(client)
        replies: list[Any] = []
        for at in range(0, len(self.calls), batch):
            replies += send_calls(client, sha, self.calls[at : at + batch])
        d = diff(server_counters(client), before)
        client.close()
        same = sum(status_of(r) == s for r, s in zip(replies, self.statuses, strict=True))
        return {**d, "same": same / max(1, len(replies))}

    def walk_profile(self, url: str, batch: int = 500) -> dict[str, float]:
        """Replay every recorded call again in pipelines of `batch` with SLOWLOG timing
        each one (`slowlog-log-slower-than 0`; a private server): of the `reserve`
        calls that reserved, the share that took a candidate other than those its node
        ranked best (`took_best`: its view was behind, and they had become busier than
        their bounds), and the median µs of those and of the others."""
        client = SyncRedis.from_url(url, decode_responses=True)
        sha = load_scripts(client)
        saved = {str(k): str(v) for k, v in client.config_get("slowlog-*").items()}
        # Commands run inside a script are logged too: room for all of a batch's.
        client.config_set("slowlog-max-len", batch * 64)
        client.config_set("slowlog-log-slower-than", 0)
        first: list[float] = []
        walked: list[float] = []
        try:
            for at in range(0, len(self.calls), batch):
                calls = self.calls[at : at + batch]
                client.slowlog_reset()
                replies = send_calls(client, sha, calls)
                logged = [
                    e["duration"]
                    for e in reversed(client.slowlog_get(batch * 64))
                    if _command_name(e["command"]) == "EVALSHA"
                ]
                if len(logged) != len(calls):
                    raise RuntimeError(f"SLOWLOG kept {len(logged)} of {len(calls)} calls")
                for (name, _, args), reply, us in zip(calls, replies, logged, strict=True):
                    if name == "reserve" and status_of(reply) == "ok":
                        (first if took_best(args, reply[1]) else walked).append(float(us))
        finally:
            for key, value in saved.items():
                client.config_set(key, value)
            client.close()
        nan = float("nan")
        return {
            "walked_share": len(walked) / max(1, len(first) + len(walked)),
            "first_us": statistics.median(first) if first else nan,
            "walked_us": statistics.median(walked) if walked else nan,
        }


def took_best(args: list[Any], taken: str) -> bool:
    """Whether a `reserve` (its recorded arguments) took a candidate its node ranked
    best: its first, or one of the first `ties` (ARGV[11]) that tie for best, which
    the script visits in turn round the pool."""
    best = [args[RESERVE_HEAD_ARGS + 2 * i] for i in range(max(1, int(args[10])))]
    return taken in best


def _command_name(command: str | bytes) -> str:
    """The first word of a SLOWLOG entry's command, upper case."""
    text = command.decode() if isinstance(command, bytes) else command
    return text.split(" ", 1)[0].upper()


def status_of(reply: Any) -> Any:
    """A script reply's status word (reserve's 'ok'/'stale'/...), or its type."""
    if isinstance(reply, list) and reply and isinstance(reply[0], str | bytes):
        return reply[0]
    return type(reply).__name__


@dataclass
class Recording:
    """One cycle run's calls, with the pool as they found it and as they left it."""

    calls: Recorder
    start: PoolSnapshot
    end: PoolSnapshot
    requests: int

    def replay(self, url: str) -> dict[str, float]:
        """The calls sent again, pipelined, onto the state they started from: server CPU
        and EVALSHA µs per request, the share of calls that got the recorded status.
        The pool is left as the run left it."""
        self.start.restore()
        busy = self.calls.replay(url)
        self.end.restore()
        return {
            "busy_cpu_us_per_req": busy["cpu_s"] * 1e6 / self.requests,
            "busy_usec_per_req": busy["usec"] / self.requests,
            "replay_same": busy["same"],
        }

    def close(self) -> None:
        self.start.close()
        self.end.close()


# Reservations in flight in the whole pool while section 1 measures, whatever the node
# count: a fleet's in-flight count follows from its request rate and how long requests
# take (Little's law), not from how many nodes carry them. Each node holds its share.
IN_FLIGHT = 512
# Runs before this measure kept 8 in flight per node: 64 nodes then carried 64 times the
# load of 1 node. One such 1-node cell per repetition is kept for comparison.
LIGHT_IN_FLIGHT = 8


async def _cycles(
    url: str, pool: str, nodes: int, cycles: int, in_flight: int = IN_FLIGHT
) -> tuple[dict[str, float], Recording]:
    """`nodes` Coordinators in one process, interleaving full request cycles while the
    pool holds `in_flight` reservations (each node its share, reserved before the
    measurement and released after it: every measured request carries one mark and
    one release); then the same calls replayed with SLOWLOG on (the walk profile). The
    recording, to replay for the server's CPU alone (`Recording.replay`)."""
    made = [
        await Coordinator.connect(
            url, pool=pool, node_id=f"n{k}", settings=SETTINGS, background=False
        )
        for k in range(nodes)
    ]
    for c in made:
        await c.refresh()
    per_node = max(1, cycles // nodes)
    depth = max(1, in_flight // nodes)
    held: dict[str, list[str]] = {}

    async def fill(c: Coordinator) -> None:
        held[c.node_id] = [(await c.reserve(512, 128)).rid for _ in range(depth)]
        for rid in held[c.node_id]:
            c.first_token_soon(rid)
        await c.flush_carried()

    await asyncio.gather(*(fill(c) for c in made))
    sync = SyncRedis.from_url(url, decode_responses=True)
    start = PoolSnapshot(url, pool).take()
    recorder = Recorder()
    for c in made:
        recorder.attach(c)
    rows_before = sum(c._cache.rows_applied for c in made)
    retries_before = sum(c.stats.reserve_retries for c in made)
    carries_before = sum(c.stats.carry_calls for c in made)
    before = server_counters(sync)

    async def run(c: Coordinator) -> None:
        live = held[c.node_id]
        for _ in range(per_node):
            res = await c.reserve(512, 128)
            c.first_token_soon(res.rid)
            live.append(res.rid)
            c.release_soon(live.pop(0))
        await c.flush_carried()

    async def drain(c: Coordinator) -> None:
        for rid in held[c.node_id]:
            c.release_soon(rid)
        await c.flush_carried()

    t0 = time.perf_counter()
    await asyncio.gather(*(run(c) for c in made))
    wall = time.perf_counter() - t0
    d = diff(server_counters(sync), before)
    rows = sum(c._cache.rows_applied for c in made) - rows_before
    retries = sum(c.stats.reserve_retries for c in made) - retries_before
    # Before close(), which sends what is still held in one last carry call per node.
    carries = sum(c.stats.carry_calls for c in made) - carries_before
    degraded = sum(c.stats.degraded_entries for c in made)
    sync.close()
    recorded = Recorder(list(recorder.calls), list(recorder.statuses))
    await asyncio.gather(*(drain(c) for c in made))  # not recorded: the pool empties
    for c in made:
        await c.close()
    if degraded:
        raise RuntimeError(f"{degraded} node(s) went degraded during a cycle run")
    end = PoolSnapshot(url, pool).take()
    start.restore()
    walk = recorded.walk_profile(url)
    end.restore()
    total = per_node * nodes
    return {
        "requests": total,
        "rps": total / wall,
        "calls_per_req": d["calls"] / total,
        "commands_per_req": d["commands"] / total,
        "usec_per_req": d["usec"] / total,
        "cpu_us_per_req": d["cpu_s"] * 1e6 / total,
        "bytes_per_req": d["net_out"] / total,
        "rows_per_req": rows / total,
        "retries_per_req": retries / total,
        "carries_per_req": carries / total,
        **walk,
    }, Recording(recorded, start, end, total)


# Rounds of replays of one repetition's recordings: in each, every node count's in turn
# (side by side: a burst of noise on the shared machine lands on all cells alike), and
# each cell's replayed figure is the median of its rounds.
REPLAY_ROUNDS = 5


def measure_cycles(url: str, quick: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Section 1: cost of one request cycle by pool size × node count (median of reps),
    with IN_FLIGHT reservations in the pool; then each repetition's recordings replayed
    side by side (`REPLAY_ROUNDS`). Also 1 node with LIGHT_IN_FLIGHT (the `light` cells:
    the 1-node cell of runs before IN_FLIGHT), measured and replayed alongside."""
    reps = 1 if quick else 3
    cycles = 600 if quick else 3000
    rounds = 1 if quick else REPLAY_ROUNDS
    # (nodes, in flight) of every cell: the node counts at IN_FLIGHT, then the light one.
    cells = [*((n, IN_FLIGHT) for n in NODE_COUNTS), (1, LIGHT_IN_FLIGHT)]
    runs: dict[tuple[int, int, int], list[dict[str, float]]] = {}
    recordings: dict[tuple[int, int, int, int], Recording] = {}
    for instances in SIZES:
        register_pool(url, f"cycle-{instances}", instances)
    # Repetitions outermost, cells interleaved: noise from the shared machine lands on
    # every cell alike instead of on whichever ran during a burst.
    for rep in range(reps):
        for instances in SIZES:
            for nodes, in_flight in cells:
                r, recordings[(instances, nodes, in_flight, rep)] = asyncio.run(
                    _cycles(url, f"cycle-{instances}", nodes, cycles, in_flight)
                )
                runs.setdefault((instances, nodes, in_flight), []).append(r)
                print(
                    f"  cycles rep {rep + 1}/{reps}: {instances:5d} instances, "
                    f"{nodes:3d} nodes, {in_flight} in flight: "
                    f"{r['cpu_us_per_req']:.0f} us CPU, {r['usec_per_req']:.0f} us EVALSHA, "
                    f"{r['calls_per_req']:.2f} calls, {r['bytes_per_req']:,.0f} B out per request",
                    flush=True,
                )
    for instances in SIZES:
        for rep in range(reps):
            replayed: dict[tuple[int, int], list[dict[str, float]]] = {}
            for _ in range(rounds):
                for c in cells:
                    one = recordings[(instances, *c, rep)].replay(url)
                    replayed.setdefault(c, []).append(one)
            for c in cells:
                runs[(instances, *c)][rep].update(median_of(replayed[c]))
                recordings[(instances, *c, rep)].close()
            print(
                f"  replayed rep {rep + 1}/{reps}: {instances:5d} instances: "
                + ", ".join(
                    f"{n} nodes with {f} in flight "
                    f"{runs[(instances, n, f)][rep]['busy_cpu_us_per_req']:.0f} us"
                    for n, f in cells
                )
                + f" CPU per request (median of {rounds})",
                flush=True,
            )
        delete_pool(url, f"cycle-{instances}", PREFIX)
    out: list[dict[str, Any]] = []
    light: list[dict[str, Any]] = []
    for (instances, nodes, in_flight), cell in runs.items():
        m: dict[str, Any] = median_of(cell)
        m.update(instances=instances, nodes=nodes, reps=len(cell), replay_rounds=rounds)
        m["in_flight"] = in_flight
        m["cpu_all"] = [r["cpu_us_per_req"] for r in cell]
        m["busy_all"] = [r["busy_cpu_us_per_req"] for r in cell]
        (out if in_flight == IN_FLIGHT else light).append(m)
    return out, light


# The two ways section 1 measures server CPU per request: the nodes' own run (the
# server waits for each call) and the same calls replayed in pipelines (it never waits).
CPU_MEASURES = (
    ("cpu_us_per_req", "cpu_all", ""),
    ("busy_cpu_us_per_req", "busy_all", ", busy shard (replayed)"),
)


def targets(cycles: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 12's cost targets against the cycle medians, by both CPU measures."""
    cell = {(c["instances"], c["nodes"]): c for c in cycles}
    top = max(NODE_COUNTS)
    out = []
    for metric, each_key, label in CPU_MEASURES:
        for n in SIZES:
            ratio = cell[(n, top)][metric] / cell[(n, 1)][metric]
            each = [
                a / b for a, b in zip(cell[(n, top)][each_key], cell[(n, 1)][each_key], strict=True)
            ]
            spread = (
                f" (each repetition: {', '.join(f'{x:.2f}' for x in each)})"
                if len(each) > 1
                else ""
            )
            out.append(
                {
                    "target": f"CPU/request {top} nodes ÷ 1 node, {n:,} instances{label}",
                    "limit": f"≤ {FLAT_RATIO}",
                    "measured": f"{ratio:.2f}{spread}",
                    "short": f"{ratio:.2f}",
                    "met": ratio <= FLAT_RATIO,
                }
            )
        for n in SIZES:
            cpu = cell[(n, 1)][metric]
            out.append(
                {
                    "target": f"CPU/request, 1 node, {n:,} instances{label}",
                    "limit": f"≤ {CPU_TARGET_US[n]:.0f} µs",
                    "measured": f"{cpu:.0f} µs",
                    "short": f"{cpu:.0f} µs",
                    "met": cpu <= CPU_TARGET_US[n],
                }
            )
    worst = max((cell[(64, k)] for k in NODE_COUNTS), key=lambda c: c["bytes_per_req"])
    out.append(
        {
            "target": "bytes out/request, 64 instances, every node count",
            "limit": f"≤ {BYTES_TARGET:,} B",
            "measured": f"{worst['bytes_per_req']:,.0f} B (worst: {worst['nodes']} nodes)",
            "short": f"{worst['bytes_per_req']:,.0f} B at {worst['nodes']} nodes",
            "met": worst["bytes_per_req"] <= BYTES_TARGET,
        }
    )
    return out


# --------------------------------------------------------------------------- 2. scripts


async def _per_script(url: str, pool: str, batch: int) -> dict[str, float]:
    """EVALSHA usec per call of each script on the request path (one node, batches)."""
    c = await Coordinator.connect(
        url, pool=pool, node_id="solo", settings=SETTINGS, background=False
    )
    await c.refresh()
    sync = SyncRedis.from_url(url, decode_responses=True)
    out: dict[str, float] = {}

    def per_call(before: dict[str, float]) -> tuple[float, float]:
        d = diff(server_counters(sync), before)
        name = current[0]
        out[f"{name}_inner"] = d["inner_usec"] / d["calls"]
        out[f"{name}_commands"] = (d["commands"] - d["calls"]) / d["calls"]
        return d["usec"] / d["calls"], d["net_out"] / d["calls"]

    current = ["reserve"]

    held = []
    before = server_counters(sync)
    for _ in range(batch):
        held.append(await c.reserve(512, 128))
    out["reserve"], out["reserve_bytes"] = per_call(before)
    for name, call in (("mark_first_token", c.mark_first_token), ("release", c.release)):
        before = server_counters(sync)
        current[0] = name
        for res in held:
            await call(res.rid)
        out[name], out[f"{name}_bytes"] = per_call(before)
    # A request as the proxy makes it: one reserve that takes the previous request's
    # first-token mark and release along.
    previous = await c.reserve(512, 128)
    before = server_counters(sync)
    current[0] = "reserve_carrying"
    for _ in range(batch):
        c.first_token_soon(previous.rid)
        c.release_soon(previous.rid)
        previous = await c.reserve(512, 128)
    out["reserve_carrying"], out["reserve_carrying_bytes"] = per_call(before)
    await c.release(previous.rid)
    # Learned timing (issue 15): one node's flush merging a sample of each of up to
    # TIMING_SAMPLES reservations' instances, then the pool's records read back.
    flushes = max(1, batch // 20)
    held = [await c.reserve(512, 128) for _ in range(min(len(c._cache.rows), TIMING_SAMPLES))]
    current[0] = "merge_timing"
    before = server_counters(sync)
    for _ in range(flushes):
        for res in held:
            c.observe(res, ttft_ms=60.0, output_tokens=128, decode_ms=2540.0)
        await c.sync_timing()
    out["merge_timing"], out["merge_timing_bytes"] = per_call(before)
    for res in held:
        await c.release(res.rid)
    for live in (0, 1):
        before = server_counters(sync)
        for _ in range(batch):
            await c._call("read_state", [live])
        name = "read_state_live" if live else "read_state"
        current[0] = name
        out[name], out[f"{name}_bytes"] = per_call(before)
    sync.close()
    await c.close()
    return out


def timing_us_per_request(merge_us: float, nodes: int, rps: float) -> float:
    """Server µs per request that learned timing adds: a node merges once every
    Coordinator.timing_flush_interval_ms (timing_flush_ms, stretched beyond
    timing_flush_nodes live nodes, at most to the half-life), whatever its own traffic:
    a fleet of `nodes` serving `rps` requests/s pays nodes / interval merges a second."""
    s = SETTINGS
    interval = flush_interval_ms(
        s.timing_flush_ms, s.timing_flush_nodes, s.timing_half_life_ms, nodes
    )
    return merge_us * nodes / (interval / 1000) / rps


PIPED_NAMES = [instance_spec(i).id for i in range(64)]  # the instances piped calls use


def piped_reserve_args(
    node: str, i: int, rid: str, enforce: int, carried: list[str] | None = None
) -> list[Any]:
    """A reserve call's arguments as a node sends them (top_k candidates from the i-th
    of PIPED_NAMES, each observed as busy as can be: the first is taken), then the
    carried marks and releases (`carried`: op, rid pairs; None sends no such part)."""
    k = SETTINGS.top_k
    out: list[Any] = [rid, node, 512, 128, 0, enforce, SETTINGS.instance_ttl_ms, 0, "", k, 0, ""]
    for c in range(k):
        bounds = pack_candidate(NO_SLOT, 50, 2000, 10**12, 10**12, 0)
        out += [PIPED_NAMES[(i + c) % len(PIPED_NAMES)], bounds]
    return out if carried is None else [*out, len(carried) // 2, *carried]


def pipelined_cycles(url: str, pool: str, requests: int) -> dict[str, float]:
    """Server CPU and EVALSHA µs per request cycle when the server never waits for a call.

    The same three scripts with the arguments a node sends (top_k candidates), sent
    in pipelines of 500 by a plain client: what a request costs a busy shard, without
    the per-call network round trip of a node that waits for each reply.
    """
    raw = RawPool(url, pool)
    node = "piped"
    rids_key = raw.keys.node_rids(node)
    raw.lease(node)
    rids = [f"piped-{i}" for i in range(requests)]

    def reserve_args(i: int, rid: str) -> list[Any]:
        return piped_reserve_args(node, i, rid, 0)

    before = server_counters(raw.client)
    raw.many("reserve", ((reserve_args(i, rid), (rids_key,)) for i, rid in enumerate(rids)))
    raw.many("mark_first_token", (([rid], ()) for rid in rids))
    raw.many("release", (([rid], (rids_key,)) for rid in rids))
    d = diff(server_counters(raw.client), before)
    raw.close()
    return {
        "pipelined_cpu": d["cpu_s"] * 1e6 / requests,
        "pipelined_usec": d["usec"] / requests,
    }


def request_call_args() -> int:
    """Arguments of a proxied request's one call: reserve's RESERVE_HEAD_ARGS, a group
    of CANDIDATE_ARGS per candidate, then the carried mark and release (a count and 2
    pairs)."""
    return RESERVE_HEAD_ARGS + CANDIDATE_ARGS * SETTINGS.top_k + 1 + 2 * 2


# Where reserve.lua is cut to time its parts: after its arguments are read and its
# walk order is set, and after its decision (before anything is written).
RESERVE_CUTS = (
    ("args", "local m, records = 0, {}"),
    ("decided", "-- Then write: the carried transitions first"),
)


def reserve_breakdown(url: str, pool: str, calls: int) -> dict[str, float]:
    """Where a proxied request's one call spends its time inside Redis (EVALSHA usec
    per call, pipelined, on a pool with 8 live reservations per instance of the first
    64): `reserve` cut after reading its arguments, cut after deciding (both write
    nothing, so each call sees the same state), and whole, carrying the previous
    request's first-token mark and the release of the one 8 before; for the whole
    call also its commands' own usec and count (commandstats)."""
    raw = RawPool(url, pool)
    node = "parts"
    rids_key = raw.keys.node_rids(node)
    raw.lease(node)

    def args(i: int, rid: str, carried: list[str]) -> list[Any]:
        return piped_reserve_args(node, i, rid, 1, carried)

    warm = [f"warm-{i}" for i in range(8 * len(PIPED_NAMES))]
    raw.many("reserve", ((args(i, rid, []), (rids_key,)) for i, rid in enumerate(warm)))
    body = (resources.files("coordinator") / "lua" / "reserve.lua").read_text()
    keys = [*raw.columns, rids_key]
    out: dict[str, float] = {}
    for name, marker in RESERVE_CUTS:
        at = body.find(marker)
        if at < 0:
            raise RuntimeError(f"reserve.lua no longer has {marker!r}: update RESERVE_CUTS")
        sha = raw.client.script_load(
            with_prelude(f"{body[:at]}if true then return 1 end\n{body[at:]}")
        )
        pipe = raw.client.pipeline(transaction=False)
        for i in range(calls):
            carried = ["f", warm[i % len(warm)], "r", warm[(i + 7) % len(warm)]]
            pipe.evalsha(sha, len(keys), *keys, *args(i, f"cut-{i}", carried))
        before = server_counters(raw.client)
        pipe.execute()
        d = diff(server_counters(raw.client), before)
        out[f"upto_{name}"] = d["usec"] / d["calls"]
    live = warm[-8:]
    cycles = []
    for i in range(calls):
        carried = ["f", live[-1], "r", live.pop(0)]
        rid = f"whole-{i}"
        cycles.append((args(i, rid, carried), (rids_key,)))
        live.append(rid)
    before = server_counters(raw.client)
    raw.many("reserve", cycles)
    d = diff(server_counters(raw.client), before)
    raw.close()
    out["whole"] = d["usec"] / d["calls"]
    out["whole_inner"] = d["inner_usec"] / d["calls"]
    out["whole_commands"] = (d["commands"] - d["calls"]) / d["calls"]
    return out


def script_floor(url: str, calls: int) -> dict[str, float]:
    """EVALSHA usec of `return 1`, and of the shared prelude with all pool keys; and the
    server CPU of one call (PING, EVALSHA of `return 1` with the pool keys) from a client
    that waits for each reply, as a lone node does: the per-call floor on this machine."""
    client = SyncRedis.from_url(url)
    prelude = script_source("read_state").split("-- read_state:")[0]
    keys = PoolKeys(PREFIX, "floor").columns
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
        if name == "empty":
            empty_with_keys = client.register_script(source)
            before = server_counters(client)
            for _ in range(calls):
                empty_with_keys(keys=keys)
            out["call_cpu"] = diff(server_counters(client), before)["cpu_s"] * 1e6 / calls
            # As many keys and arguments as a proxied request's one call sends (reserve
            # with top_k candidates, carrying a mark and a release): what the call
            # costs before its script does anything.
            args = ["x"] * request_call_args()
            before = server_counters(client)
            for _ in range(calls):
                empty_with_keys(keys=[*keys, "{floor}:rids"], args=args)
            out["request_call_cpu"] = diff(server_counters(client), before)["cpu_s"] * 1e6 / calls
    before = server_counters(client)
    for _ in range(calls):
        client.ping()
    out["ping_cpu"] = diff(server_counters(client), before)["cpu_s"] * 1e6 / calls
    client.close()
    return out


def measure_scripts(url: str, quick: bool) -> dict[str, Any]:
    """Section 2: per-script cost at each pool size, one node."""
    batch = 300 if quick else 2000
    out: dict[Any, Any] = {"floor": script_floor(url, 1000 if quick else 5000)}
    for instances in SIZES:
        pool = f"script-{instances}"
        register_pool(url, pool, instances, max_slots=0)
        out[instances] = asyncio.run(_per_script(url, pool, batch))
        out[instances].update(pipelined_cycles(url, pool, batch))
        parts = reserve_breakdown(url, pool, batch)
        out[instances].update({f"parts_{key}": value for key, value in parts.items()})
        delete_pool(url, pool, PREFIX)
        s = out[instances]
        print(
            f"  scripts, {instances:5d} instances: reserve {s['reserve']:.1f} us, "
            f"mark_first_token {s['mark_first_token']:.1f} us, release {s['release']:.1f} us, "
            f"read_state {s['read_state']:.1f} us ({s['read_state_live']:.1f} us with live); "
            f"pipelined cycle {s['pipelined_cpu']:.0f} us CPU, {s['pipelined_usec']:.0f} us EVALSHA",
            flush=True,
        )
    return out


# --------------------------------------------------------------------------- 3. stalls


@dataclass
class Scale:
    """The stall scenario's sizes (issue 12), or a fraction of them for --quick."""

    instances: int = 10_000
    reservations: int = 100_000
    dead_node: int = 50_000  # held by the node that dies
    one_instance: int = 20_000  # on the instance that is unregistered
    reassert: int = 5_000  # made by a node while degraded, re-asserted after
    churned: int = 100_000  # instance ids registered and unregistered
    spec_changes: int = 300  # re-registrations during the idle node's heartbeat interval
    releases: int = 2_000  # releases during that interval

    def scaled(self, f: float) -> Scale:
        return Scale(*(max(1, int(v * f)) for v in vars(self).values()))


# Items one call of a stepped script handles, and where the step is set.
STEPS = {
    "reap_node": REAP_STEP,
    "sweep": SWEEP_STEP,
    "read_specs": SPEC_READ_STEP,
    "merge_timing": TIMING_STEP,
}
STEP_NAMES = {
    "reap_node": "coordinator.coordinator.REAP_STEP",
    "sweep": "coordinator.coordinator.SWEEP_STEP",
    "read_specs": "coordinator.coordinator.SPEC_READ_STEP",
    "merge_timing": "coordinator.coordinator.TIMING_STEP",
}
SLOWLOG_US = 250  # logged while an operation runs: every call above 0.25 ms


class TimedCoordinator(Coordinator):
    """A Coordinator that counts its script calls and times each round trip."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: dict[str, int] = {}
        self.longest: tuple[float, str] = (0.0, "-")

    async def _direct_call(
        self, name: str, args: list[Any], extra: tuple[str | bytes, ...] = ()
    ) -> Any:
        t = time.perf_counter()
        try:
            return await super()._direct_call(name, args, extra)
        finally:
            ms = (time.perf_counter() - t) * 1000
            self.calls[name] = self.calls.get(name, 0) + 1
            self.longest = max(self.longest, (ms, name))


class SlowLog:
    """Calls above SLOWLOG_US as the server logged them, read back per operation.

    Commands a script runs are logged too (client address '?:0'); only the calls
    clients sent count.
    """

    def __init__(self, client: SyncRedis, sha_names: dict[str, str]) -> None:
        self.client = client
        self.names = {sha: name for name, sha in sha_names.items()}
        client.config_set("slowlog-max-len", 100_000)

    def reset(self) -> None:
        self.client.slowlog_reset()

    def read(self) -> dict[str, Any]:
        """Max single-call duration, which call it was, calls over 5 ms, calls logged."""
        entries = self.client.slowlog_get(1_000_000)
        worst_us, worst, over, calls = 0, "-", 0, 0
        steps: dict[str, int] = {}
        for e in entries:
            command = e["command"]
            words = (command.decode() if isinstance(command, bytes) else str(command)).split()
            verb = words[0].lower() if words else "?"
            address = e.get("client_address", b"")
            address = address.decode() if isinstance(address, bytes) else str(address)
            if verb in OWN_COMMANDS or address.startswith("?"):
                continue
            name = (
                self.names.get(words[1], "script?")
                if verb == "evalsha" and len(words) > 1
                else verb
            )
            steps[name] = steps.get(name, 0) + 1
            calls += 1
            us = int(e["duration"])
            over += us > STALL_MS * 1000
            if us > worst_us:
                worst_us, worst = us, name
        return {
            "max_ms": worst_us / 1000,
            "worst": worst,
            "over": over,
            "logged": calls,
            "logged_steps": steps,
        }


async def _stalls(url: str, scale: Scale) -> list[dict[str, Any]]:
    pool = "big"
    raw = RawPool(url, pool)
    log = SlowLog(raw.client, raw.sha)
    keys = raw.keys
    admin = SyncRedis.from_url(url, decode_responses=True)
    admin.config_set("slowlog-log-slower-than", -1)  # setup is not measured
    out: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    raw.register(instance_spec(i, max_slots=0) for i in range(scale.instances))
    holders = [f"holder-{k}" for k in range(4)]
    for holder in ("dead", *holders):
        raw.lease(holder)

    def restores(node: str, count: int, instance: Callable[[int], int], tag: str) -> None:
        nodes_key = keys.node_rids(node)
        raw.many(
            "restore",
            (
                (
                    [
                        f"{tag}-{k}",
                        node,
                        f"inst-{instance(k):05d}",
                        1,
                        "prefill" if k % 2 else "decode",
                        512,
                        128,
                        51,
                        2048,
                    ],
                    (nodes_key,),
                )
                for k in range(count)
            ),
            batch=1000,
        )

    # Reservation records exactly as the re-assert writes them (restore.lua): 100k
    # reserve replies would each carry the whole 180 KB state view.
    others = max(1, scale.instances - 1)
    restores("dead", scale.dead_node, lambda k: 1 + k % others, "dead")
    rest = scale.reservations - scale.dead_node - scale.one_instance
    per_holder = scale.one_instance // len(holders)
    for j, holder in enumerate(holders):
        restores(holder, per_holder, lambda k: 0, f"one{j}")
        spread = rest // len(holders)
        restores(holder, spread, lambda k: 1 + (k * 7 + j) % others, f"r{j}")  # noqa: B023
    made = int(admin.hlen(keys.column("reservations")))
    print(
        f"  stalls: {scale.instances:,} instances, {made:,} reservations set up in "
        f"{time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    settings = replace(SETTINGS, recovery_interval_ms=50)

    timed: list[TimedCoordinator] = []

    async def op(name: str, what: str, run: Callable[[], Awaitable[Any]]) -> Any:
        for c in timed:
            c.calls, c.longest = {}, (0.0, "-")
        log.reset()
        admin.config_set("slowlog-log-slower-than", SLOWLOG_US)
        counted = server_counters(admin)
        t = time.perf_counter()
        result = await run()
        wall = (time.perf_counter() - t) * 1000
        counted = diff(server_counters(admin), counted)
        admin.config_set("slowlog-log-slower-than", -1)
        seen = log.read()
        seen["evalsha_ms"] = counted["usec"] / 1000
        seen["inner_share"] = counted["inner_usec"] / max(1.0, counted["usec"])
        steps: dict[str, int] = {}
        for c in timed:
            for k, v in c.calls.items():
                steps[k] = steps.get(k, 0) + v
        trip_ms, trip = max(c.longest for c in timed)
        seen.update(
            op=name,
            what=what,
            wall_ms=wall,
            steps=steps,
            trip_ms=trip_ms,
            trip=trip,
            calls=sum(steps.values()),
        )
        out.append(seen)
        print(
            f"  stalls: {name}: {seen['calls']} calls {steps}, SLOWLOG longest "
            f"{seen['max_ms']:.2f} ms ({seen['worst']}), {seen['over']} over {STALL_MS:.0f} ms; "
            f"longest round trip {trip_ms:.2f} ms ({trip}); {wall:.0f} ms in all",
            flush=True,
        )
        return result

    def node(node_id: str, s: Settings = SETTINGS, pool_name: str = pool) -> TimedCoordinator:
        c = TimedCoordinator(connect_redis(url, s), pool=pool_name, node_id=node_id, settings=s)
        timed.append(c)
        return c

    # (a) A new node's first read: state and liveness, then every spec in steps.
    newcomer = node("newcomer")
    await op(
        "a. new node's first read",
        f"refresh() of an empty cache: read_state with liveness, then read_specs full "
        f"in steps of {SPEC_READ_STEP} ({scale.instances:,} instances)",
        newcomer.refresh,
    )
    # (b) The same node, idle for a heartbeat interval of changes.
    raw.many(
        "heartbeat",
        (([f"inst-{i:05d}", "12", "3", "0"], ()) for i in range(scale.instances)),
    )
    raw.register(
        replace(instance_spec(i, max_slots=0), tags=("h100", "moved"))
        for i in range(1, 1 + scale.spec_changes)
    )
    raw.many(
        "release",
        (([f"r0-{k}"], (keys.node_rids(holders[0]),)) for k in range(scale.releases)),
    )
    await op(
        "b. idle node catching up",
        f"refresh() after every instance heartbeated, {scale.spec_changes} specs changed "
        f"and {scale.releases:,} reservations were released",
        lambda: newcomer.refresh(live=True),
    )
    await newcomer.close()
    # (c) Reap a dead node.
    raw.lease("dead", 1)
    await asyncio.sleep(0.05)
    reaper = node("reaper")
    reaped = await op(
        "c. reap a dead node",
        f"reap_node() of a node holding {scale.dead_node:,} reservations",
        lambda: reaper.reap_node("dead"),
    )
    assert reaped == scale.dead_node, (reaped, scale.dead_node)

    # (d) Unregister an instance, then the lease loop's sweeps.
    async def unregister_and_sweep() -> None:
        await reaper.unregister_instance("inst-00000")
        await reaper.reap_expired()
        while reaper._voids_left:
            await reaper.reap_expired()

    await op(
        "d. unregister a busy instance",
        f"unregister_instance() of an instance with {scale.one_instance:,} reservations, "
        "then reap_expired() (renew_lease + one sweep step) until nothing is left",
        unregister_and_sweep,
    )
    left = admin.zlexcount(keys.column("by_instance"), "[inst-00000#", "(inst-00000$")
    assert left == 0, left
    await reaper.close()
    # (e) A node re-asserting what it reserved while degraded.
    asserter = node("asserter", settings)
    await asserter.refresh()
    await asserter.renew_lease()
    for k in range(scale.reassert):
        rid = f"degraded-{k}"
        asserter._local[rid] = LocalReservation(
            rid, f"inst-{1 + k % others:05d}", 1, "prefill", 512, 128, 51, 2048, in_redis=False
        )

    async def reassert() -> None:
        asserter._enter_degraded("bench: reservations made while Redis was away")
        while asserter.coordination != "ok":  # noqa: ASYNC110 - the node has no event to await
            await asyncio.sleep(0.01)

    await op(
        "e. re-assert after degraded mode",
        f"recovery of a node holding {scale.reassert:,} reservations made while degraded "
        "(renew, read, one restore per reservation, reconcile)",
        reassert,
    )
    restored = int(admin.scard(keys.node_rids("asserter")))
    assert restored == scale.reassert, restored
    await asserter.close()
    # (g) A busy node's learned-timing flush: samples of every instance since its last.
    learner = node("learner")
    await learner.refresh()
    for i in range(scale.instances):
        iid = f"inst-{i:05d}"
        learner.observations.prefill(iid, 1, 512, 60.0, None)
        learner.observations.decode(iid, 1, 4, 20.0, None)
    await op(
        "g. a busy node's timing flush",
        f"sync_timing() with samples of all {scale.instances:,} instances: merge_timing "
        f"merging {TIMING_STEP} instances' samples per call, then reading the pool's "
        "records back a page per call",
        learner.sync_timing,
    )
    await learner.close()
    # (h) Passive health when every instance has failed once: each holds a record.
    count_only = OutlierPolicy(consecutive_failures=1000)
    raw.many(
        "record_outcome",
        (
            (
                [f"inst-{i:05d}", "fail", 1000, 10_000, 1000, 60_000, "50", 0, "status_503"],
                (keys.outliers(), keys.ejected()),
            )
            for i in range(scale.instances)
        ),
    )
    health = node("health")
    await health.refresh(live=True)

    async def read_and_eject() -> None:
        view = await health.read_outliers()
        # inst-00000 left in (d): it has no record.
        assert len(view.states) == scale.instances - 1, len(view.states)
        eject = OutlierPolicy(consecutive_failures=1)
        for i in range(1, 4):
            await health.record_outcome(f"inst-{i:05d}", False, eject, "status_503")
        await health.record_outcome("inst-00004", False, count_only, "status_503")

    await op(
        "h. passive health, every instance failing",
        f"read_outliers() of {scale.instances:,} instances' failure records (a page per "
        "call), then three ejections weighed against the cap",
        read_and_eject,
    )
    await health.close()
    # (f) A small pool after many instance ids came and went.
    small = RawPool(url, "churn")
    small.register(instance_spec(i) for i in range(10))

    async def first_read(pool_name: str, node_id: str) -> None:
        c = node(node_id, pool_name=pool_name)
        await c.refresh()
        assert len(c._cache.rows) == 10, len(c._cache.rows)
        await c.close()

    await op(
        "f0. 10-instance pool, before churn",
        "refresh() of an empty cache on a pool of 10 instances",
        lambda: first_read("churn", "before"),
    )
    t = time.perf_counter()
    step = 100  # ids come and go in waves of 100, as with an autoscaled fleet
    for lo in range(0, scale.churned, step):
        ids = range(10 + lo, 10 + min(scale.churned, lo + step))
        small.register(instance_spec(i) for i in ids)
        outlier_keys = (small.keys.outliers(), small.keys.ejected())
        small.many("unregister", (([f"inst-{i:05d}"], outlier_keys) for i in ids))
    print(f"  stalls: churned {scale.churned:,} ids in {time.perf_counter() - t:.0f} s", flush=True)
    await op(
        "f. 10-instance pool after churn",
        f"refresh() of an empty cache after {scale.churned:,} ids were registered and "
        f"unregistered, {step} at a time",
        lambda: first_read("churn", "after"),
    )
    ck = small.keys
    out[-1]["keys"] = {
        "spec_log": int(admin.zcard(ck.column("spec_log"))),
        "spec": int(admin.hlen(ck.column("spec"))),
        "state_bytes": int(admin.strlen(ck.column("state"))),
        "free_slots": int(admin.zcard(ck.column("free_slots"))),
        "retired": int(admin.hlen(ck.column("retired"))),
    }
    small.close()
    admin.config_set("slowlog-log-slower-than", 10_000)
    admin.close()
    raw.close()
    return out


def measure_stalls(url: str, quick: bool) -> tuple[Scale, list[dict[str, Any]]]:
    """Section 3: the longest single call of each long operation on a big pool."""
    scale = Scale().scaled(0.1) if quick else Scale()
    out = asyncio.run(_stalls(url, scale))
    delete_pool(url, "big", PREFIX)
    delete_pool(url, "churn", PREFIX)
    return scale, out


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
    """Section 5: SIGKILL the master under load; time until coordination is ok again."""
    out = []
    for _ in range(1 if quick else 3):
        result = asyncio.run(_failover_trial())
        out.append(result)
        print(f"  failover: gap {result['gap_ms']:.0f} ms", flush=True)
    return out


# --------------------------------------------------------------------------- 5. fleet


def fleet(cycles: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Shards for FLEET_RPS from the measured CPU per request (64 nodes per pool)."""
    top = max(NODE_COUNTS)
    out = []
    for c in cycles:
        if c["nodes"] != top:
            continue
        cpu = c["cpu_us_per_req"]
        shard_rps = SHARD_BUDGET * 1e6 / cpu
        out.append(
            {
                "instances": c["instances"],
                "cpu_us": cpu,
                "shard_rps": shard_rps,
                "shards": max(1, -(-FLEET_RPS * cpu // (SHARD_BUDGET * 1e6))),
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
    cycles: list[dict[str, Any]]
    targets: list[dict[str, Any]]
    scripts: dict[Any, Any]
    scale: Scale
    stalls: list[dict[str, Any]]
    failover: list[dict[str, float]]
    estimate: list[dict[str, Any]]
    # 1 node with LIGHT_IN_FLIGHT reservations in flight, by pool size (none in runs
    # from before IN_FLIGHT, whose cells all kept 8 in flight per node)
    light: list[dict[str, Any]] = field(default_factory=list)


SCRIPT_ROWS = (
    ("reserve_carrying", "reserve with a carried mark and release (a proxied request)"),
    ("reserve", "reserve"),
    ("mark_first_token", "mark_first_token"),
    ("release", "release"),
    ("read_state", "read_state"),
    ("read_state_live", "read_state with live"),
    ("merge_timing", "merge_timing (a node's timing flush: samples in, the pool's records out)"),
)


def yes(met: bool) -> str:
    return "yes" if met else "**no**"


def tables(r: Results) -> dict[str, list[str]]:
    """The measured tables, as printed and as written into the doc."""
    t: dict[str, list[str]] = {}
    t["targets"] = [
        f"| target (issue 12) | limit | before ({BEFORE_COMMIT}) | measured | met? |",
        "|---|---:|---:|---:|---|",
    ] + [
        f"| {x['target']} | {x['limit']} | {BEFORE.get(x['target'], 'not measured')} "
        f"| {x['measured']} "
        f"| {yes(x['met'])} |"
        for x in r.targets
    ]
    stall_met = all(s["over"] == 0 for s in r.stalls)
    worst = max(r.stalls, key=lambda s: s["max_ms"])
    t["targets"].append(
        f"| no call over {STALL_MS:.0f} ms (SLOWLOG), {r.scale.instances:,} instances / "
        f"{r.scale.reservations:,} reservations | 0 calls | {BEFORE['stalls']} | "
        f"{sum(s['over'] for s in r.stalls)} calls; longest {worst['max_ms']:.2f} ms "
        f"({worst['worst']}, {worst['op'].split('. ')[0]}) | {yes(stall_met)} |"
    )
    t["cycles"] = [
        "| instances | nodes | server CPU µs/request | EVALSHA µs/request | Redis calls/request "
        "| commands run/request | bytes out/request | rows rebuilt/request "
        "| reserve retries/request | carry calls/request | CPU µs, each repetition "
        "| replayed: CPU µs/request | replayed: each repetition | replayed: same status |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---:|",
    ]
    for c in sorted(r.cycles, key=lambda c: (c["instances"], c["nodes"])):
        t["cycles"].append(
            f"| {c['instances']:,} | {c['nodes']} | {c['cpu_us_per_req']:.0f} | {c['usec_per_req']:.0f} "
            f"| {c['calls_per_req']:.2f} | {c['commands_per_req']:.0f} | {human_bytes(c['bytes_per_req'])} | {c['rows_per_req']:.1f} "
            f"| {c['retries_per_req']:.3f} | {c['carries_per_req']:.3f} "
            f"| {', '.join(f'{v:.0f}' for v in c['cpu_all'])} "
            f"| {c['busy_cpu_us_per_req']:.0f} | {', '.join(f'{v:.0f}' for v in c['busy_all'])} "
            f"| {c['replay_same']:.1%} |"
        )
    t["scripts"] = [
        "| script | µs/call, 64 | of which Redis commands | commands/call | reply | "
        "µs/call, 1,024 | of which Redis commands | commands/call | reply |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, label in SCRIPT_ROWS:
        cells = []
        for n in SIZES:
            x = r.scripts[n]
            cells.append(
                f"{x[name]:.1f} | {x[name + '_inner']:.1f} | {x[name + '_commands']:.1f} "
                f"| {human_bytes(x[name + '_bytes'])}"
            )
        t["scripts"].append(f"| {label} | {' | '.join(cells)} |")
    t["stalls"] = [
        "| operation | what ran | script calls | longest call (SLOWLOG) | longest round trip "
        "(node) | calls over 5 ms | all calls, wall time |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for s in r.stalls:
        calls = ", ".join(f"{n} {k:,}" for n, k in s["steps"].items())
        logged = (
            f"{s['max_ms']:.2f} ms ({s['worst']})"
            if s["max_ms"]
            else f"< {SLOWLOG_US / 1000:.2f} ms"
        )
        t["stalls"].append(
            f"| {s['op']} | {s['what']} | {calls} | {logged} | {s['trip_ms']:.2f} ms ({s['trip']}) "
            f"| {s['over']} | {s['wall_ms']:,.0f} ms |"
        )
    t["failover"] = [
        "| trial | kill → degraded | kill → coordination ok (the gap) |",
        "|---:|---:|---:|",
    ]
    for i, f in enumerate(r.failover, 1):
        t["failover"].append(f"| {i} | {f['detect_ms']:,.0f} ms | {f['gap_ms']:,.0f} ms |")
    t["fleet"] = [
        "| pool size | server CPU µs/request (64 nodes) | one shard at 60% carries | shards for 50,000 req/s |",
        "|---:|---:|---:|---:|",
    ] + [
        f"| {e['instances']:,} | {e['cpu_us']:.0f} | {e['shard_rps']:,.0f} req/s | {e['shards']:.0f} |"
        for e in r.estimate
    ]
    return t


def flatness_reason(r: Results, n: int, metric: str, each_key: str, label: str) -> list[str]:
    """Why the flatness target at `n` instances, by one CPU measure, was missed or only
    met on the medians; empty when every repetition met it."""
    cell = {(c["instances"], c["nodes"]): c for c in r.cycles}
    top = max(NODE_COUNTS)
    target = f"CPU/request {top} nodes ÷ 1 node, {n:,} instances{label}"
    flat = next(x for x in r.targets if x["target"] == target)
    one, many = cell[(n, 1)], cell[(n, top)]
    each = [a / b for a, b in zip(many[each_key], one[each_key], strict=True)]
    if flat["met"] and max(each) <= FLAT_RATIO:
        return []
    where = f"at {n:,} instances{label}"
    head = f"**Why flatness is missed {where}** (section 1):"
    if flat["met"]:
        head = (
            f"**Flatness {where} is met on the medians ({flat['short']}) but not robustly** "
            f"(section 1): per repetition the ratio ranged {min(each):.2f} to {max(each):.2f}."
        )
    # Calls beyond the request's own reserve, its retries and carries: whole-state
    # reads (read_state, with the spec reads they bring).
    reads = many["calls_per_req"] - 1 - many["retries_per_req"] - many["carries_per_req"]
    return [
        f"{head} With {top} nodes a request "
        f"made {many['calls_per_req']:.2f} script calls instead of {one['calls_per_req']:.2f}; "
        f"{many['retries_per_req']:.2f} of them were `reserve` retries (`stale`: every candidate "
        "had become busier than the node's view showed, and than the pool's mean: the "
        "guard against herding), "
        f"{many['carries_per_req']:.2f} `carry` calls (a node of the {top} in one process "
        "waited longer than `carry_ms` between its own reserves) and "
        f"{max(0.0, reads):.2f} reads of the whole `state` ({human_bytes(STATE_BYTES * n)}: "
        f"each of the {top} nodes decides for 1/{top} of the traffic, so its view ages past "
        "`snapshot_max_age_ms` (longer beyond `snapshot_nodes` live nodes) or its liveness "
        f"past `live_refresh_ms` before about one decision in {1 / max(reads, 1e-3):.0f}; "
        "bytes out "
        f"{human_bytes(many['bytes_per_req'])} per request against "
        f"{human_bytes(one['bytes_per_req'])} with 1 node). "
        f"Per script call the server spent {one[metric] / one['calls_per_req']:.0f} µs "
        f"of CPU with 1 node and {many[metric] / many['calls_per_req']:.0f} µs with "
        f"{top} ({one['commands_per_req'] / one['calls_per_req']:.0f} and "
        f"{many['commands_per_req'] / many['calls_per_req']:.0f} commands per call): a "
        "`reserve` whose view is many changes behind finds its first candidates busier "
        "than their bounds and examines more of them (their `state` records in one read "
        "where their slots lie close together, else one read each, and the `live` record "
        f"of each one it would keep).{walk_sentence(one, many, top)}",
        "",
    ]


def walk_sentence(one: dict[str, Any], many: dict[str, Any], top: int) -> str:
    """What the walk past a node's best candidates costs, from `Recorder.walk_profile`
    (empty for results saved before it was measured)."""
    if "walked_share" not in many or math.isnan(many["walked_us"]):
        return ""
    alone = (
        f"; with 1 node {one['walked_share']:.0%}, and {one['first_us']:.0f} µs "
        "for one that took its best"
        if not math.isnan(one["first_us"])
        else ""
    )
    return (
        f" Timed call by call in a replay (SLOWLOG, whose logging of every command the "
        f"µs include): with {top} nodes "
        f"{many['walked_share']:.0%} of the reserves that reserved took a candidate other "
        "than those their node ranked best, and such a call took "
        f"{many['walked_us']:.0f} µs at the median against {many['first_us']:.0f} µs for "
        f"one that took its best{alone}."
    )


# The same day's run of this bench just before IN_FLIGHT (commit 7f076ba; its
# docs/scaling.md): every cell started from an empty pool, each node keeping 8.
EMPTY_START = {
    "commit": "7f076ba",
    "flatness": "1.47 (1.52, 1.38, 1.48)",
    "retries": 0.116,
    "calls": 1.14,
}


def light_comparison(r: Results) -> list[str]:
    """Why every cell holds IN_FLIGHT reservations, with the 1-node cell as runs before
    it measured it (LIGHT_IN_FLIGHT in flight) beside it."""
    if not r.light:
        return []
    cell = {(c["instances"], c["nodes"]): c for c in r.cycles}
    light = {c["instances"]: c for c in r.light}
    top = max(NODE_COUNTS)
    parts = []
    for n in SIZES:
        one, heavy = light[n], cell[(n, 1)]
        parts.append(
            f"at {n:,} instances {one['busy_cpu_us_per_req']:.0f} µs replayed against "
            f"{heavy['busy_cpu_us_per_req']:.0f} with {IN_FLIGHT} in flight "
            f"({one['cpu_us_per_req']:.0f} / {heavy['cpu_us_per_req']:.0f} live)"
        )
    many = cell[(64, top)]
    return [
        f"**Load in flight.** Every cell holds {IN_FLIGHT} reservations in flight "
        f"({IN_FLIGHT // 64} per instance at 64 instances) whatever the node count, "
        "reserved before the measurement and released after it: a fleet's load in "
        "flight follows from its request rate and how long requests take (Little's "
        "law), not from how many nodes carry it. Runs before this measure started every "
        f"cell on an empty pool with each node keeping {LIGHT_IN_FLIGHT}: their "
        f"{top}-node cell carried {top} times the load of their 1-node cell, and its "
        f"nodes' first {LIGHT_IN_FLIGHT} requests each (17% of its requests) ran while "
        "the pool filled from empty, when the nodes' views agree most on which "
        "instances are least busy and their concurrent reserves collide. The same "
        f"day's run just before this measure (commit {EMPTY_START['commit']}) gave a "
        f"64-instance replayed flatness of {EMPTY_START['flatness']}, with "
        f"{EMPTY_START['retries']:.2f} `stale` retries per request in its {top}-node "
        f"cell ({EMPTY_START['calls']:.2f} calls), against {many['retries_per_req']:.2f} "
        f"here ({many['calls_per_req']:.2f}). The 1-node cell moves little with the load: "
        f"1 node with {LIGHT_IN_FLIGHT} in flight, measured alongside, "
        + "; ".join(parts)
        + ". The absolute targets are judged on the 1-node cell with "
        f"{IN_FLIGHT} in flight, the dearer of the two.",
        "",
    ]


def reasons(r: Results) -> list[str]:
    """Why a target was missed, from the measurements (empty when all were met)."""
    cell = {(c["instances"], c["nodes"]): c for c in r.cycles}
    top = max(NODE_COUNTS)
    floor = r.scripts["floor"]
    out: list[str] = []
    for metric, each_key, label in CPU_MEASURES:
        for n in SIZES:
            out += flatness_reason(r, n, metric, each_key, label)
    idle = [x for x in r.targets if x["target"].startswith("CPU/request, 1 node")]
    if any(not x["met"] for x in idle if not x["target"].endswith(CPU_MEASURES[1][2])):
        out.append("**Why the absolute CPU target is missed** (sections 1 and 2):")
        out.append("")
        for n in SIZES:
            one, x = cell[(n, 1)], r.scripts[n]
            out.append(
                f"- {n:,} instances, 1 node: {one['cpu_us_per_req']:.0f} µs of server CPU per "
                f"request in {one['calls_per_req']:.2f} script calls, {one['usec_per_req']:.0f} µs "
                "of it inside scripts. The request's one call, `reserve` carrying the previous "
                f"request's mark and release, takes {x['reserve_carrying']:.0f} µs inside Redis "
                f"(section 2), {x['reserve_carrying_inner']:.0f} µs of it the "
                f"{x['reserve_carrying_commands']:.0f} Redis commands it runs (commandstats "
                "counts only each command's own work); the rest is the script around them: "
                "each `redis.call`'s conversion of arguments and replies, and Lua decoding "
                "and formatting the JSON reservation records, the lex index members and the "
                "packed records."
            )
        slower = ", ".join(
            f"{cell[(n, 1)]['usec_per_req']:.0f} µs against "
            f"{cell[(n, 1)]['busy_usec_per_req']:.0f} µs at {n:,} instances"
            for n in SIZES
        )
        out.append(
            "- A client that waits for each reply costs the server more than the calls' own "
            f"work. A call costs {floor['call_cpu']:.0f} µs of CPU before any work (EVALSHA of "
            f"`return 1` with the pool keys; a PING: {floor['ping_cpu']:.0f} µs), and the "
            "scripts themselves run slower when the server idles between calls: inside "
            f"scripts per request, live against the same calls replayed back to back: "
            f"{slower}. On this machine (a 2-core VM shared with the client) the server "
            "sleeps between a waiting client's calls and wakes slower (cold caches, most "
            "likely: not measured here); how much that costs varies from day to day "
            "(another day's run of this bench measured 40 µs per call before any work). "
            "With server and client pinned to one core (`taskset`), a PING measured 4.5 µs, "
            "against 27 µs on different cores, in an ad-hoc run of the same loop."
        )
        for n in SIZES:
            x = r.scripts[n]
            if "parts_whole" not in x:
                continue  # a saved run from before the breakdown
            decide = x["parts_upto_decided"] - x["parts_upto_args"]
            overhead = (x["parts_whole"] - x["parts_upto_args"] - x["parts_whole_inner"]) / x[
                "parts_whole_commands"
            ]
            out.append(
                f"- Inside that call at {n:,} instances (pipelined, a pool with 8 live "
                f"reservations per instance): {x['parts_upto_args']:.0f} µs until its "
                f"arguments are read (the prelude's definitions, {len(COLUMNS) + 1} keys, "
                f"{request_call_args()} arguments), {decide:.0f} µs more to decide, "
                f"{x['parts_whole'] - x['parts_upto_decided']:.0f} µs more to apply the "
                "carried mark and release and write its reservation "
                f"({x['parts_whole']:.0f} µs in all). Its {x['parts_whole_commands']:.0f} "
                f"commands' own work is {x['parts_whole_inner']:.0f} µs: past the "
                f"arguments, each `redis.call` costs about {overhead:.1f} µs beyond its "
                "command's own work (argument and reply conversion, ACL and propagation "
                "bookkeeping, the Lua around it), so the script's cost follows the number "
                "of commands it runs, not the size of the pool."
            )
        budget = CPU_TARGET_US[SIZES[0]]
        out.append(
            f"- With a proxied request's keys and arguments ({len(COLUMNS) + 1} keys, "
            f"{request_call_args()} arguments) the same empty script costs "
            f"{floor['request_call_cpu']:.0f} µs of server CPU per call: "
            f"{floor['request_call_cpu'] / budget:.0%} of the {budget:.0f} µs target at "
            f"{SIZES[0]} instances before the script runs a single command."
        )
        piped = ", ".join(
            f"{r.scripts[n]['pipelined_cpu']:.0f} µs at {n:,} instances "
            f"({r.scripts[n]['pipelined_usec']:.0f} µs inside scripts)"
            for n in SIZES
        )
        busy = ", ".join(
            f"{cell[(n, 1)]['busy_cpu_us_per_req']:.0f} µs at {n:,} instances" for n in SIZES
        )
        out.append(
            "- The same calls replayed in pipelines of 500 onto the state they started from "
            f"(section 1), so the server never waits between them, cost {busy} per request: "
            "the work one node's requests give a busy shard, where the wake-ups no longer "
            "count."
        )
        out.append(
            "- The three scripts sent separately in pipelines of 500 by one client (section 2), "
            f"so the server never waits between calls, cost {piped} of server CPU per request: "
            "the work a request gives a busy shard."
        )
        four = ", ".join(
            f"{cell[(n, 4)]['cpu_us_per_req']:.0f} µs at {n:,} instances" for n in SIZES
        )
        out.append(
            f"- With 4 nodes on the pool a request costs {four}: the server is woken less "
            "often per call. The 1-node figure is the worst of the small node counts."
        )
        out.append("")
    bytes_miss = [x for x in r.targets if x["target"].startswith("bytes") and not x["met"]]
    if bytes_miss:
        one, many = cell[(64, 1)], cell[(64, top)]
        out += [
            "**Why the bytes target is missed** at 64 instances with many nodes: a `stale` "
            f"answer to a view behind carries the whole {human_bytes(STATE_BYTES * 64)} `state`, so bytes "
            f"follow reserve retries. With 1 node a request is {one['calls_per_req']:.2f} script "
            f"calls and {human_bytes(one['bytes_per_req'])}; with {top} nodes "
            f"{many['calls_per_req']:.2f} calls, {many['retries_per_req']:.2f} of them reserve "
            f"retries after `stale` answers, and {human_bytes(many['bytes_per_req'])}: many nodes "
            "competing for few instances.",
            "",
        ]
    bad = [x for x in r.stalls if x["over"]]
    if bad:
        out.append("**Why the no-stall target is missed:**")
        out.append("")
        for x in bad:
            step = STEPS.get(x["worst"])
            line = (
                f"- {x['op']}: {x['over']} of its {x['calls']:,} calls ran over {STALL_MS:.0f} ms, "
                f"the longest {x['max_ms']:.1f} ms ({x['worst']}); the work did run in steps "
                f"({', '.join(f'{k} × {v:,}' for k, v in x['steps'].items())})."
            )
            if step:
                per_item = x["max_ms"] * 1000 / step
                line += (
                    f" One `{x['worst']}` step handles up to {step} items ({STEP_NAMES[x['worst']]}): "
                    f"{per_item:.0f} µs per item in the longest step, so a step would fit in "
                    f"{STALL_MS:.0f} ms at about {int(STALL_MS * 1000 / per_item):,} items."
                )
            line += (
                f" Of the operation's {x['evalsha_ms']:,.0f} ms inside scripts, "
                f"{x['inner_share']:.0%} was the Redis commands they ran (commandstats); the rest "
                f"is Lua itself. Its calls averaged {x['evalsha_ms'] / x['calls']:.2f} ms: a "
                "call far above that did the same bounded work, and SLOWLOG times the wall "
                "clock, so it includes time the server waited for a core on this shared "
                f"machine (load average {r.load[0]:.1f} before the run, {r.load[1]:.1f} after)."
            )
            out.append(line)
        out.append("")
    return out


def render(r: Results) -> str:
    """docs/scaling.md, from the measurements."""
    t = tables(r)
    cell = {(c["instances"], c["nodes"]): c for c in r.cycles}
    top = max(NODE_COUNTS)
    s64, s1k = r.scripts[64], r.scripts[1024]
    floor = r.scripts["floor"]
    met = [x for x in r.targets if x["met"]]
    missed = [x for x in r.targets if not x["met"]]
    stall_met = all(s["over"] == 0 for s in r.stalls)
    worst = max(r.stalls, key=lambda s: s["max_ms"])
    churn = r.stalls[-1]
    before = next(s for s in r.stalls if s["op"].startswith("f0"))
    rounds = r.cycles[0].get("replay_rounds", 1)
    command = "python bench/scaling.py --write-docs" + (" --quick" if r.quick else "")
    reps = cell[(64, 1)]["reps"]
    out = [
        "# Scaling: Redis cost per request, stalls, shards and failover",
        "",
        "What one request costs the Redis shard as nodes are added to a pool, whether any",
        "long operation stalls the shard, how many shards a fleet needs, and what a",
        "Sentinel failover costs. Every number here was measured by",
        f"`{command}` ({r.elapsed_s:.0f} s) on this machine: 2 cores shared with",
        f"other work (1-minute load average {r.load[0]:.1f} before, {r.load[1]:.1f} after), {r.version}.",
        "Rerun the command to regenerate this file. A dedicated server core is faster;",
        "treat the absolute µs as an upper bound and the ratios as the finding. The",
        "same requests counted in server instructions, which this machine's speed does",
        'not move, are in docs/benchmarks.md ("Server instructions per request",',
        "`bench/instructions.py`), with what a script's building blocks cost (`bench/lua_costs.py`).",
        "",
        "Related tests: `pytest tests/library/test_redis_cluster.py` (a 3-primary cluster: pools on",
        "different shards, the invariants, NOSCRIPT after SCRIPT FLUSH on every primary,",
        "losing one primary, a planned failover, a replica taking over from a crashed primary, a pool's slot",
        "migrating, two proxy nodes) and",
        "`pytest tests/library/test_sentinel.py -s` (the failover under streaming load; it prints",
        "the gap).",
        "",
        "## The design being measured",
        "",
        "- **Packed records.** Per pool, two strings hold one fixed-width record per",
        f"  instance slot (coordinator/packed.py): `state`, {STATE_BYTES} bytes (pending",
        "  prefill, active decode, prefill free-at, earliest end, pending prefill ms,",
        "  reservations started: the hot-spot guard's fleet-wide counts), the only",
        "  store of these counters: a transition reads the instance's record",
        "  (`GETRANGE`), changes it and writes it back (`SETRANGE`), and a call that",
        "  touches one instance several times (a reserve with its carried mark and",
        "  release) reads and writes it once; `live`, 36 bytes (last seen, engine",
        "  hints), rewritten by heartbeats. `coordinator inspect` decodes both.",
        "- **A view kept by changes, read whole at a bounded rate.** Every change of",
        "  `state` bumps the pool's `state_ver`. `reserve`, `mark_first_token` and",
        "  `release` answer with the one record they rewrote and the version it took",
        "  the pool to: a node whose view was at the version before moves its view on",
        "  (a lone node never reads the pool again); a node behind applies the record",
        "  to its slot. The whole `state` comes only in a `reserve` reply that did not",
        "  reserve (`stale`: the node decides again on fresh rows) to a view that is",
        "  behind (not when the view missed a change per instance and the state is over",
        "  4 KB: that node's next try ranks a fresh random sample on Redis's counters",
        "  anyway), and from `read_state` when the view has not been current for",
        "  `snapshot_max_age_ms` (500 ms; proportionally longer beyond `snapshot_nodes`,",
        "  8, live nodes, which `read_state` counts: the pool serves about as many whole",
        "  reads per second with 64 nodes as with 8); `live` every `live_refresh_ms`",
        "  (2 s). `read_state` is a MULTI/EXEC: the script gives the view's head (run,",
        "  versions, time, live nodes) and two plain GETs the strings, as atomic as one",
        "  script, without the copy through Lua that made a whole read of a large pool",
        "  cost the server 6x more. A view that replies show missed a change per instance ranks",
        "  `stale_sample` (16) random instances instead of all (power of d choices: the",
        "  nodes' stale views all point at the same instances, which their concurrent",
        "  picks then overload). Nodes",
        "  send their best 8 candidates (`top_k`) with bounds (live and prefilling",
        "  reservations, and how long its prefill may be busy: coordinator/guard.py);",
        "  of the candidates within their counts (and not beaten by one passed over for",
        "  its counts: fewer live reservations, a TTFT no longer) up to the first within all",
        "  its bounds,",
        "  the one starting this request's prefill soonest is taken; with every one",
        "  busier than its counts, `reserve` still takes the least busy if it has no",
        "  more live reservations than the pool's mean (meta `inflight_total` over the",
        "  registered instances), so `stale` needs all 8 above the mean. A candidate",
        "  comes packed with its slot as the node's view has it (trusted while the view's",
        "  run and `spec_gen` are the pool's, else looked up): a visited one costs a read",
        "  of its `state` record and no parsed number, plus its `live` record's last_seen",
        "  only when the walk would keep it (the first, and any less busy or within its",
        "  bounds) or when it would beat one within its bounds; when the walk passes",
        "  the first over, the others' `state` records come",
        "  in one GETRANGE when their slots lie within 4 KB.",
        "- **One call per request.** The proxy does not wait for a request's first-token",
        "  mark or release (`first_token_soon`, `release_soon`): the node holds them for",
        "  its next `reserve`, which applies them first in the same call, or sends all it",
        "  holds in one `carry` call after `carry_ms` (20 ms); at most "
        f"{CARRY_STEP} a call (a burst of",
        "  completions goes in several bounded calls). A busy node makes one script",
        "  call per request instead of three; a node idle for longer than `carry_ms`",
        "  makes two (`reserve`, then `carry`).",
        "- **Specs read on change.** Registration, restart and removal bump the pool's",
        "  `spec_gen` and log the id in `spec_log` (the last 10,000 changes). A node whose",
        f"  `spec_gen` is behind reads exactly the changed ids (`read_specs`, {SPEC_READ_STEP} per",
        "  step); a node that fell behind the kept log, or a new node, reads every spec",
        f"  with HSCAN, {SPEC_READ_STEP} per step. An unchanged spec is never resent.",
        f"- **Bounded steps.** `reap_node` releases at most {REAP_STEP} reservations per call and",
        "  answers `more`; `unregister` and an epoch bump zero the counters at once and",
        f"  leave the records to `sweep` ({SWEEP_STEP} per call, driven by the lease loop through",
        f"  `Coordinator.reap_expired()`); `register`/`unregister` sweep up to {SWEEP_STEP} too.",
        "  Re-assert restores one reservation per call. Freed slots are reused, and",
        "  `spec_log` is trimmed, so churned ids leave nothing behind.",
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
        "## Issue 12 targets",
        "",
        "Issue 12 measured the previous design (an incremental snapshot on every reply)",
        "on this machine at 608 / 305 µs of server CPU per request with 1 node and",
        "2,775 / 3,106 µs with 64 nodes (64 / 1,024 instances), and single scripts of",
        "270 ms to 1.2 s on the 10,000-instance pool. The flat design then sent the whole",
        f"`state` in every reserve reply (`before`: its full run at {BEFORE_COMMIT}, at load",
        "average 0.4, so compare its µs with care); this run, replies that carry only the",
        "records a call changed:",
        "",
        *t["targets"],
        "",
        f"**Met: {len(met) + stall_met} of {len(r.targets) + 1}.**"
        + (
            " Not met: "
            + "; ".join(f"{x['target']} ({x['short']}, limit {x['limit']})" for x in missed)
            + ("" if stall_met else f"; no stalls (longest call {worst['max_ms']:.2f} ms)")
            + "."
            if missed or not stall_met
            else ""
        ),
        "",
        *light_comparison(r),
        *reasons(r),
        "",
        "## 1. Cost per request by pool size and node count",
        "",
        "Full request cycles as the proxy makes them: `reserve`, then `first_token_soon`",
        "and (for the node's oldest reservation in flight) `release_soon`, which ride on",
        "the node's next `reserve` or go in one `carry` call after `carry_ms`. The pool",
        f"holds {IN_FLIGHT} reservations in flight whatever the node count (each node its",
        "share, reserved before the measurement and released after it), so every",
        "measured request carries one mark and one release, and adding nodes adds no",
        "load (see *Load in flight* above). `nodes` are independent Coordinators (each its own",
        "connection, view and lease) interleaving their cycles on one pool from one client",
        f"process. Each cell is the median of {reps} repetition(s); the repetitions ran",
        "interleaved (every cell once, then again), so a noisy moment hits every cell.",
        "Server CPU is INFO cpu user+sys of the whole server process per request, so it",
        "includes parsing, networking and the event loop; EVALSHA µs is time inside",
        "scripts (INFO commandstats), which is wall time and can exceed the CPU when the",
        "clients preempt the server on this 2-core machine. Redis calls are the script",
        "calls the nodes sent (read_state and read_specs included; the nodes send",
        "nothing else); commands run adds the commands those scripts ran inside Redis",
        "(commandstats). Bytes out is INFO total_net_output_bytes. Rows rebuilt is",
        "client-side work: records whose bytes changed since the node's previous view.",
        "A reserve retry is a second `reserve` after a `stale` answer; a carry call sends",
        "the marks and releases a node held for `carry_ms` without a `reserve` to take them.",
        "",
        "**Replayed** (a busy shard): the nodes' run waits for each reply, so the server",
        "idles between calls and pays a wake-up per call, which on this 2-core VM costs",
        "more CPU than a small script; a shard near its capacity never idles. So every",
        "script call the nodes sent is recorded, in the order sent, the pool is put back",
        "as the run found it (DUMP/RESTORE of every key), and the calls are sent again in",
        "pipelines of 500: the same work, from the same state, with the server never",
        "waiting. After every run, each repetition's recordings of one pool size are",
        f"replayed side by side: {rounds} rounds, each replaying every node count's in",
        "turn (a spell of noise on the shared machine lands on all of them alike); a",
        "cell's replayed figure for the repetition is the median of its rounds. `same",
        "status` is the share of replayed calls whose status (`ok`, `stale`, ...) equals",
        "the one the run got: below 100% where concurrent nodes' calls reached the server",
        "in another order than they were sent.",
        "",
        *t["cycles"],
        "",
        "## 2. Per-script cost",
        "",
        "One node, batches of each call on a pool of that size (INFO commandstats, EVALSHA",
        "µs per call; reply bytes from INFO stats per call). For scale: EVALSHA of",
        f"`return 1` costs {floor['empty']:.1f} µs here, and the shared prelude with all pool keys",
        f"(coordinator/lua/_lib.lua) {floor['prelude']:.1f} µs.",
        "",
        *t["scripts"],
        "",
        "At 64 instances a proxied request's one call (`reserve` with the previous request's",
        f"mark and release) takes {s64['reserve_carrying']:.0f} µs of EVALSHA time "
        f"({s1k['reserve_carrying']:.0f} µs at 1,024); the three",
        f"scripts called one by one take {s64['reserve'] + s64['mark_first_token'] + s64['release']:.0f} µs "
        f"({s1k['reserve'] + s1k['mark_first_token'] + s1k['release']:.0f} µs). A reply carries the "
        f"{STATE_BYTES}-byte records its call rewrote,",
        f"while `read_state` carries the {human_bytes(STATE_BYTES * 64)} /",
        f"{human_bytes(STATE_BYTES * 1024)} `state` string. A request cycle sent in pipelines of 500 (the",
        f"server never waits for a call) costs {s64['pipelined_cpu']:.0f} / {s1k['pipelined_cpu']:.0f} µs of server CPU "
        f"({s64['pipelined_usec']:.0f} / {s1k['pipelined_usec']:.0f} µs inside scripts).",
        "",
        *timing_cost_lines(r),
        "",
        "## 3. No stalls: long operations on a big pool",
        "",
        f"A private server with one pool of {r.scale.instances:,} instances and "
        f"{r.scale.reservations:,} live reservations",
        f"({r.scale.dead_node:,} held by one node that then dies, {r.scale.one_instance:,} on one instance that is then",
        "unregistered, the rest spread over four live nodes). The instances are registered",
        "by `register`; the reservation records are written by `restore.lua`, the script",
        "a node's re-assert uses, pipelined: they are the same records `reserve` writes,",
        "written without ranking 100k decisions first.",
        "Each operation then runs through the real Coordinator method. SLOWLOG is reset",
        f"before each with `slowlog-log-slower-than {SLOWLOG_US}` (µs), so it holds every call above",
        f"{SLOWLOG_US / 1000:.2f} ms, among them every call a {STALL_MS:.0f} ms threshold would show (commands run",
        "inside scripts are logged too and left out). The node side times every script",
        "call it makes (round trip, so it adds the network and client parsing) and counts",
        "the calls: that the long operations took several bounded steps shows there.",
        "",
        *t["stalls"],
        "",
        f"After the churn the 10-instance pool holds: spec_log {churn['keys']['spec_log']:,} entries, "
        f"{churn['keys']['spec']} specs,",
        f"a `state` string of {churn['keys']['state_bytes']} bytes, {churn['keys']['free_slots']} free slots and "
        f"{churn['keys']['retired']} retired ids. Its first",
        f"read took {churn['wall_ms']:.1f} ms end to end ({before['wall_ms']:.1f} ms before the churn).",
        "",
        "## 4. Shards for a fleet",
        "",
        f"Sized only from the measured server CPU per request with {top} nodes on the pool:",
        f"shards = {FLEET_RPS:,} req/s × CPU per request ÷ {SHARD_BUDGET} core (a shard planned at",
        f"{SHARD_BUDGET:.0%} of one core). Each pool must also fit in one shard: a pool above the",
        "one-shard rate must be split into sub-pools. Pools larger than 1,024 instances",
        "were not measured on the request path; their `read_state` and `stale` replies",
        f"grow by {STATE_BYTES} bytes per instance.",
        "",
        *t["fleet"],
        "",
        *failover_section(r),
    ]
    return "\n".join(out)


def timing_cost_lines(r: Results) -> list[str]:
    """Section 2's paragraph on learned timing's share of a request (issue 15: at most
    +20 µs), at the request rates section 1 measured."""
    cell = {(c["instances"], c["nodes"]): c for c in r.cycles}
    flush, bound = SETTINGS.timing_flush_ms, SETTINGS.timing_flush_nodes
    parts = []
    for n in SIZES:
        merge = r.scripts[n]["merge_timing"]
        per = ", ".join(
            f"{timing_us_per_request(merge, k, cell[(n, k)]['rps']):.2f} µs with {k}"
            for k in NODE_COUNTS
        )
        parts.append(f"at {n:,} instances one merge takes {merge:.0f} µs, so {per} nodes")
    return [
        "Learned timing makes no call per request: each node merges its samples in one",
        f"`merge_timing` call every `timing_flush_ms` ({flush:,} ms), whatever its traffic;",
        f"in a pool of more than `timing_flush_nodes` ({bound}) live nodes each merges",
        f"proportionally less often (the pool takes at most {bound} merges per interval), but",
        f"at least once per `timing_half_life_ms` ({SETTINGS.timing_half_life_ms:,} ms).",
        f"A merge here folds {TIMING_SAMPLES} samples in (one per instance, up to "
        f"{TIMING_SAMPLES}) and reads the pool's records back;",
        "per request it costs a merge's µs × nodes ÷ (requests/s × the interval).",
        "At the request rates section 1 measured (one client process driving every node; a",
        "fleet serving fewer requests pays more per request, one serving more pays less): "
        + "; ".join(parts)
        + ".",
    ]


def failover_section(r: Results) -> list[str]:
    """Section 5, when the run measured it."""
    if not r.failover:
        return ["## 5. Sentinel failover", "", "Not measured in this run (--no-failover).", ""]
    gaps = [f["gap_ms"] for f in r.failover]
    t = tables(r)
    return [
        "## 5. Sentinel failover",
        "",
        "1 master, 1 replica, 3 sentinels on loopback (quorum 2, down-after-milliseconds",
        "1000, failover-timeout 3000). A node runs request cycles, the master is SIGKILLed,",
        "and the gap is the time from the kill until the node's coordination is `ok` again",
        "on the promoted replica, its state re-asserted:",
        "",
        *t["failover"],
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
    ]


# --------------------------------------------------------------------------- main


def save(r: Results, path: Path) -> None:
    """The raw results as JSON, so a report can be re-rendered without measuring again."""
    data = vars(r).copy()
    data["scale"] = vars(r.scale)
    data["scripts"] = {str(k): v for k, v in r.scripts.items()}
    path.write_text(json.dumps(data, indent=1))


def load(path: Path) -> Results:
    data = json.loads(path.read_text())
    data["scale"] = Scale(**data["scale"])
    data["scripts"] = {(int(k) if k.isdigit() else k): v for k, v in data["scripts"].items()}
    data["load"] = tuple(data["load"])
    # Derived from the measurements: recomputed, so a report change needs no new run.
    data["targets"] = targets(data["cycles"])
    data["estimate"] = fleet(data["cycles"])
    return Results(**data)


def main() -> int:
    """Run every section, print the tables; with --write-docs, write docs/scaling.md."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="1/10 scale, 1 repetition, 1 failover")
    parser.add_argument("--no-failover", action="store_true", help="skip the Sentinel section")
    parser.add_argument("--save", type=Path, help="also write the raw results to this JSON file")
    parser.add_argument(
        "--render", type=Path, help="measure nothing: report the results a --save run wrote"
    )
    add_write_docs(parser, "docs/scaling.md")
    args = parser.parse_args()
    if args.render:
        results = load(args.render)
    else:
        results = run(args.quick, not args.no_failover)
        if args.save:
            save(results, args.save)
    doc = render(results)
    print(doc)
    if args.write_docs:
        DOC.parent.mkdir(parents=True, exist_ok=True)
        DOC.write_text(doc)
        print(f"wrote {DOC}")
    return 0


def run(quick: bool, failover: bool) -> Results:
    """Every measurement, in one run."""
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    server = EmbeddedRedis().start()
    try:
        version = server.version.split(" sha=")[0].split(" build=")[0]
        print("1. request cycles", flush=True)
        cycles, light = measure_cycles(server.url, quick)
        print("2. per-script cost", flush=True)
        scripts = measure_scripts(server.url, quick)
        print("3. stalls", flush=True)
        scale, stalls = measure_stalls(server.url, quick)
    finally:
        server.stop()
    print("4. failover", flush=True)
    failovers = measure_failover(quick) if failover else []
    return Results(
        version=version,
        load=(load_before, os.getloadavg()[0]),
        elapsed_s=time.monotonic() - started,
        quick=quick,
        cycles=cycles,
        targets=targets(cycles),
        scripts=scripts,
        scale=scale,
        stalls=stalls,
        failover=failovers,
        estimate=fleet(cycles),
        light=light,
    )


if __name__ == "__main__":
    sys.exit(main())
