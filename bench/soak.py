"""Soak: a local cluster under steady streaming load, with a random fault every 30-60 s.

Not a CI test. It starts `LocalCluster` (embedded Redis, 3 proxy nodes, 4 mock
engines, all real processes on 127.0.0.1), drives streaming chat requests round-robin
through the nodes with random client disconnects, and injects one fault at a time:

- kill -9 of a node, then a restart with the same node id and ports;
- Redis SIGKILL, then a restart, empty, on the same port;
- Redis SIGSTOP for 3 s, then SIGCONT;
- SCRIPT FLUSH (a few times in a row);
- kill -9 of a mock engine, then a restart on the same port (new epoch).

Then it stops the load, lets every node recover, waits one lease period for the
reaper, and reports: requests sent / completed / disconnected / failed (each failure
with its cause, and whether the fault in progress explains it), reservations left in
Redis after quiesce (must be 0), client-side TTFT p99 per minute, the invariant
checks made during the run, and each node's RSS at start and end (from /proc).
With --write-docs it writes its section of docs/reliability.md (between the
`soak` markers), with the raw results embedded so that `--rerender` can rebuild the
section without running again.

    python bench/soak.py --write-docs         # 10 minutes (the documented run)
    python bench/soak.py --minutes 2 --fault-every 10 20    # a quick smoke run, print only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import sys
import time
import traceback
import uuid
from collections import Counter
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import aiohttp
from redis.asyncio import Redis

from bench.docs import add_write_docs, write_section
from coordinator.invariants import pool_problems
from coordinator.keys import PoolKeys
from coordinator.packed import state_by_instance
from local_fleet.cluster import Child, LocalCluster, free_port_block
from local_fleet.embedded import EmbeddedRedis

DOC = Path(__file__).resolve().parent.parent / "docs" / "reliability.md"
DOC_SECTION = "soak"  # <!-- soak:start --> ... <!-- soak:end --> in DOC
RESULTS_START = "```json soak-results"
FAULT_KINDS = ("kill_node", "restart_redis", "sigstop_redis", "script_flush", "restart_engine")
POOL = "soak"
LEASE_MS = 10_000  # the default lease: the soak runs the settings an operator would
COUNTERS = ("inflight", "pending_prefill", "active_decode")
READY_TIMEOUT_S = 30.0  # a restarted process must answer its health check by then
RECOVERY_TIMEOUT_S = 30.0  # every node must be back to coordination=ok by then
QUIESCE_TIMEOUT_S = 60.0  # in-flight requests must end by then after the load stops
SIGSTOP_S = 3.0  # length of the Redis freeze
FLUSHES = 5  # SCRIPT FLUSHes per script_flush fault, FLUSH_GAP_S apart
FLUSH_GAP_S = 0.2
INVARIANT_EVERY_S = 2.0  # period of the atomic counters-vs-records check
TRUTH_TIMEOUT_S = 10.0  # Redis must hold exactly the open streams this soon after a fault
FAULT_GRACE_S = 3.0  # failures this long after a fault ended still count as its effect
MAX_FAILURE_EXAMPLES = 3  # request ids quoted per failure cause


def now() -> float:
    """Monotonic seconds."""
    return time.monotonic()


def rss_kib(pid: int) -> int | None:
    """VmRSS of a process in KiB, from /proc (None when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank) of values, None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[index]


# ---------------------------------------------------------------------- records


@dataclass
class Request:
    """One client request and how it ended."""

    rid: str
    node: int
    started: float  # seconds since the soak started
    max_tokens: int
    disconnect_after: int | None  # chunks read before the client hangs up on purpose
    ttft_s: float | None = None
    ended: float = 0.0
    status: int | None = None
    instance: str = ""
    outcome: str = "pending"  # completed | disconnected | failed
    cause: str = ""


@dataclass
class Fault:
    """One injected fault and what recovering from it took."""

    kind: str
    target: str
    started: float  # seconds since the soak started
    ended: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Results:
    """Everything the report is made of (also embedded in the doc as JSON)."""

    command: str
    minutes: float
    concurrency: int
    speed: float
    disconnect_rate: float
    started_at: str = ""
    duration_s: float = 0.0
    requests_raw: list[Request] = field(default_factory=list)
    faults_raw: list[Fault] = field(default_factory=list)
    invariant_checks: int = 0
    invariant_violations: list[str] = field(default_factory=list)
    leaked: dict[str, Any] = field(default_factory=dict)
    rss_kib: dict[str, dict[str, Any]] = field(default_factory=dict)
    error: str = ""


# ---------------------------------------------------------------------- the soak


PoolState = tuple[dict[str, dict[str, int]], dict[str, Any]]


async def read_pool_state(client: Redis, keys: PoolKeys) -> PoolState:
    """Counters (from the packed `state` records, their only store) and reservation
    records, read atomically (MULTI/EXEC); `client` decodes replies."""
    pipe = client.pipeline(transaction=True)
    pipe.hgetall(keys.column("slot"))
    pipe.get(keys.column("state"))
    pipe.hgetall(keys.column("reservations"))
    slots, state, raw_records = await pipe.execute()
    stored = state_by_instance(slots, state)
    counters = {n: {iid: getattr(r, n) for iid, r in stored.items()} for n in COUNTERS}
    records = {rid: json.loads(raw) for rid, raw in raw_records.items()}
    return counters, records


class Soak:
    """Cluster, load generator, fault injector and invariant checker of one run."""

    def __init__(self, args: argparse.Namespace, out: TextIO) -> None:
        self.args = args
        self.out = out
        self.rng = random.Random(args.seed)
        self.cluster = LocalCluster(
            nodes=args.nodes,
            engines=args.engines,
            base_port=free_port_block(args.nodes, args.engines),
            speed=args.speed,
            pool=POOL,
            quiet=False,  # children inherit our (redirected) stdout/stderr: the log file
        )
        self.t0 = now()
        self.requests: list[Request] = []
        self.open: dict[str, Request] = {}  # 200 received, stream not ended yet
        # Reservations of killed nodes still in Redis 1.5 leases later: leaked (a later
        # Redis restart erases them); the truth check does not count them again.
        self.orphans: set[str] = set()
        self.faults: list[Fault] = []
        self.up = [True] * args.nodes  # nodes in the client rotation (an LB health check)
        self.stop_load = asyncio.Event()
        self.rr = 0
        self.invariant_checks = 0
        self.violations: list[str] = []
        self.redis_paused = False
        self.env = dict(os.environ)
        self.env.pop("COORD_TOKEN", None)
        self.keys = PoolKeys("lc", POOL)
        self._client: Redis | None = None
        self._http: aiohttp.ClientSession | None = None

    def log(self, message: str) -> None:
        """Progress line on the original stdout."""
        print(f"[{now() - self.t0:7.1f}s] {message}", file=self.out, flush=True)

    def elapsed(self) -> float:
        """Seconds since the soak started."""
        return now() - self.t0

    @property
    def client(self) -> Redis:
        """The soak's own Redis client (short timeouts: Redis may be frozen)."""
        if self._client is None:
            assert self.cluster.redis_url is not None
            self._client = Redis.from_url(
                self.cluster.redis_url, decode_responses=True, socket_timeout=1.0
            )
        return self._client

    @property
    def http(self) -> aiohttp.ClientSession:
        """The load generator's session (no connection cap)."""
        if self._http is None:
            self._http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=120, sock_read=30),
            )
        return self._http

    def child(self, name: str) -> Child:
        """The cluster's child process of that name."""
        return next(c for c in self.cluster.children if c.name == name)

    def node_pids(self) -> dict[str, int]:
        """Current pid of every node process."""
        out = {}
        for k in range(self.args.nodes):
            process = self.child(f"node-{k}").process
            if process is not None:
                out[f"node-{k}"] = process.pid
        return out

    # ------------------------------------------------------------------ load

    async def load(self) -> None:
        """Run the workers until stop_load is set."""
        await asyncio.gather(*(self.worker(k) for k in range(self.args.concurrency)))

    def pick_node(self) -> int | None:
        """Next node in the rotation that is up (None while all are down)."""
        n = self.args.nodes
        for _ in range(n):
            self.rr = (self.rr + 1) % n
            if self.up[self.rr]:
                return self.rr
        return None

    async def worker(self, k: int) -> None:
        """Send streaming requests one after another until the load stops."""
        rng = random.Random(self.rng.random())
        while not self.stop_load.is_set():
            node = self.pick_node()
            if node is None:
                await asyncio.sleep(0.05)
                continue
            disconnect = rng.randint(1, 12) if rng.random() < self.args.disconnect_rate else None
            req = Request(
                rid=f"soak-{uuid.uuid4().hex[:16]}",
                node=node,
                started=self.elapsed(),
                max_tokens=rng.randint(16, self.args.max_tokens),
                disconnect_after=disconnect,
            )
            self.requests.append(req)
            await self.send(req, rng)

    async def send(self, req: Request, rng: random.Random) -> None:
        """One streaming chat request, read to the end (or cut on purpose)."""
        url = self.cluster.node_urls[req.node] + "/v1/chat/completions"
        body = {
            "model": "mock",
            "messages": [{"role": "user", "content": "soak " * rng.randint(5, 400)}],
            "max_tokens": req.max_tokens,
            "stream": True,
        }
        started = now()
        done = False
        chunks = 0
        try:
            async with self.http.post(url, json=body, headers={"X-Request-Id": req.rid}) as resp:
                req.status = resp.status
                req.instance = resp.headers.get("X-Instance-Id", "")
                # The node names its reservation (a client's X-Request-Id is not it).
                req.rid = resp.headers.get("X-Reservation-Id", req.rid)
                if resp.status == 200:
                    self.open[req.rid] = req
                if resp.status != 200:
                    text = (await resp.read())[:200].decode("utf-8", "replace")
                    code = ""
                    with suppress(ValueError, KeyError, TypeError):
                        code = json.loads(text)["error"]["code"]
                    req.outcome, req.cause = "failed", f"HTTP {resp.status} {code}".strip()
                    return
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    if req.ttft_s is None:
                        req.ttft_s = now() - started
                    if line.startswith(b"data: [DONE]"):
                        done = True
                        continue
                    chunks += 1
                    if req.disconnect_after is not None and chunks >= req.disconnect_after:
                        resp.close()  # hang up mid-stream: the node must release
                        req.outcome = "disconnected"
                        return
            if done:
                req.outcome = "completed"
            else:
                req.outcome, req.cause = "failed", "stream ended without [DONE]"
        except aiohttp.ClientPayloadError:
            req.outcome, req.cause = "failed", "stream cut (payload incomplete)"
        except aiohttp.ClientConnectorError:
            req.outcome, req.cause = "failed", "connection refused"
        except aiohttp.ServerDisconnectedError:
            req.outcome, req.cause = "failed", "server disconnected"
        except (aiohttp.ClientError, TimeoutError) as exc:
            req.outcome, req.cause = "failed", type(exc).__name__
        finally:
            req.ended = self.elapsed()
            self.open.pop(req.rid, None)

    # ------------------------------------------------------------------ checks

    async def pool_state(self) -> PoolState:
        """Counters and reservation records, read atomically."""
        return await read_pool_state(self.client, self.keys)

    async def check_invariants(self) -> None:
        """Every INVARIANT_EVERY_S while Redis answers: the pool's invariants as stored
        (coordinator/invariants.py: counters, index and totals against the records)."""
        while not self.stop_load.is_set():
            await asyncio.sleep(INVARIANT_EVERY_S)
            if self.redis_paused:
                continue
            try:
                problems = await pool_problems(self.client, self.keys)
            except Exception:  # Redis down or restarting: nothing to check now
                continue
            self.invariant_checks += 1
            for problem in problems:
                self.violations.append(f"t={self.elapsed():.1f}s {problem}")
                self.log(f"INVARIANT VIOLATION {problem}")

    async def coordination(self, k: int) -> str:
        """Node k's coordination state from /healthz ('down' when it does not answer)."""
        try:
            async with self.http.get(
                self.cluster.node_urls[k] + "/healthz", timeout=aiohttp.ClientTimeout(total=2)
            ) as resp:
                return str((await resp.json())["coordination"])
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
            return "down"

    async def wait_all_ok(self, timeout_s: float = RECOVERY_TIMEOUT_S) -> float | None:
        """Seconds until every node reports coordination=ok (None at the deadline)."""
        start = now()
        while now() - start < timeout_s:
            states = await asyncio.gather(*(self.coordination(k) for k in range(self.args.nodes)))
            if all(s == "ok" for s in states):
                return now() - start
            await asyncio.sleep(0.05)
        return None

    async def wait_http_ok(self, url: str, timeout_s: float = READY_TIMEOUT_S) -> float | None:
        """Seconds until url answers 200 (None at the deadline)."""
        start = now()
        while now() - start < timeout_s:
            with suppress(aiohttp.ClientError, TimeoutError):
                async with self.http.get(url, timeout=aiohttp.ClientTimeout(total=1)) as resp:
                    if resp.status == 200:
                        return now() - start
            await asyncio.sleep(0.05)
        return None

    # ------------------------------------------------------------------ faults

    async def inject(self) -> None:
        """One fault every 30-60 s (by default), kinds drawn from shuffled rounds."""
        deck: list[str] = []
        lo, hi = self.args.fault_every
        end = self.args.minutes * 60
        while True:
            wait = self.rng.uniform(lo, hi)
            if self.elapsed() + wait > end - 5:
                return
            await asyncio.sleep(wait)
            if not deck:
                deck = list(FAULT_KINDS)
                self.rng.shuffle(deck)
            kind = deck.pop()
            fault = Fault(kind, "", self.elapsed())
            self.faults.append(fault)
            try:
                await getattr(self, f"fault_{kind}")(fault)
            except Exception as exc:
                fault.detail["error"] = repr(exc)
                self.log(f"fault {kind} failed: {exc!r}")
            fault.ended = self.elapsed()
            self.log(f"fault {kind} {fault.target} done: {fault.detail}")

    async def fault_kill_node(self, fault: Fault) -> None:
        """kill -9 a node (out of the rotation first, as an LB would), restart it."""
        k = self.rng.randrange(self.args.nodes)
        child = self.child(f"node-{k}")
        fault.target = child.name
        assert child.process is not None
        self.up[k] = False
        self.log(f"kill -9 {child.name} (pid {child.process.pid})")
        child.process.kill()
        await asyncio.to_thread(child.process.wait)
        killed = now()
        _, records = await self.pool_state()
        orphans = {rid for rid, rec in records.items() if rec["node"] == child.name}
        child.start(self.env, None)
        ready = await self.wait_http_ok(child.ready_url)
        fault.detail["restart_ready_s"] = None if ready is None else round(ready, 2)
        self.up[k] = True
        # The dead process's reservations: released by the reaper after its lease
        # (LEASE_MS, then the next renewal of a live node), whatever the restart did.
        fault.detail["dead_incarnation_reservations"] = len(orphans)
        left = orphans
        while left and now() - killed < LEASE_MS / 1000 * 1.5 + 2:
            await asyncio.sleep(0.1)
            with suppress(Exception):
                left = orphans & set((await self.pool_state())[1])
        fault.detail["still_in_redis_after_1.5_leases"] = len(left)
        if left:
            self.orphans |= left
            self.log(f"LEAK: {len(left)} reservations of the killed {child.name} remain")
        else:
            fault.detail.update(await self.wait_truth())

    async def fault_restart_redis(self, fault: Fault) -> None:
        """SIGKILL Redis and start it again, empty, on the same port."""
        redis = self.cluster.redis
        assert redis is not None and redis.process is not None
        fault.target = "redis"
        port = redis.port
        self.log("SIGKILL redis")
        redis.process.kill()
        await asyncio.to_thread(redis.process.wait)
        redis.stop()
        self.cluster.redis = await asyncio.to_thread(EmbeddedRedis(port=port).start)
        self.orphans.clear()  # an empty Redis forgot them too
        self.log("redis restarted empty")
        recovered = await self.wait_all_ok()
        fault.detail["all_nodes_ok_s"] = None if recovered is None else round(recovered, 2)
        fault.detail.update(await self.wait_truth())

    async def wait_truth(self, timeout_s: float = TRUTH_TIMEOUT_S) -> dict[str, Any]:
        """How long until Redis holds exactly the streams open at the clients.

        Each sample is one atomic read, and counts only if no stream opened or ended
        while it was taken. At the deadline, the last sample's differences are kept.
        """
        start = now()
        missing: set[str] = set()
        extra: set[str] = set()
        first: dict[str, int] | None = None  # open streams Redis missed at the first sample
        while now() - start < timeout_s:
            before = set(self.open)
            try:
                _, records = await self.pool_state()
            except Exception:  # Redis not answering yet
                await asyncio.sleep(0.05)
                continue
            if set(self.open) == before:
                held = set(records) - self.orphans
                missing, extra = before - held, held - before
                if first is None:
                    first = self.where(missing)
                if not missing and not extra:
                    out: dict[str, Any] = {"redis_matches_clients_s": round(now() - start, 2)}
                    if first:
                        out["missing_in_redis_at_first_check"] = first
                    return out
            await asyncio.sleep(0.05)
        return {
            "redis_matches_clients_s": None,
            "open_streams_missing_in_redis": self.where(missing),
            "stale_reservations_in_redis": len(extra),
        }

    def where(self, rids: set[str]) -> dict[str, int]:
        """Open streams counted by `node->instance` (node 0 is node-0)."""
        found = Counter(
            f"node-{self.open[r].node}->{self.open[r].instance}" for r in rids if r in self.open
        )
        return dict(found)

    async def fault_sigstop_redis(self, fault: Fault) -> None:
        """Freeze Redis for SIGSTOP_S, then let it go on."""
        redis = self.cluster.redis
        assert redis is not None and redis.process is not None
        fault.target = "redis"
        pid = redis.process.pid
        self.log(f"SIGSTOP redis for {SIGSTOP_S:g} s")
        self.redis_paused = True
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(SIGSTOP_S)
        finally:
            os.kill(pid, signal.SIGCONT)
            self.redis_paused = False
        recovered = await self.wait_all_ok()
        fault.detail["all_nodes_ok_s"] = None if recovered is None else round(recovered, 2)
        fault.detail.update(await self.wait_truth())

    async def fault_script_flush(self, fault: Fault) -> None:
        """SCRIPT FLUSH a few times in a row: every node must reload scripts silently."""
        fault.target = "redis"
        for _ in range(FLUSHES):
            await self.client.script_flush()
            await asyncio.sleep(FLUSH_GAP_S)
        fault.detail["flushes"] = FLUSHES
        fault.detail.update(await self.wait_truth())

    async def fault_restart_engine(self, fault: Fault) -> None:
        """kill -9 a mock engine, start it again on the same port (a new epoch)."""
        j = self.rng.randrange(self.args.engines)
        child = self.child(f"engine-{j}")
        fault.target = child.name
        assert child.process is not None
        epoch_before = await self.client.hget(self.keys.column("epoch"), child.name)
        self.log(f"kill -9 {child.name}, restart on the same port")
        child.process.kill()
        await asyncio.to_thread(child.process.wait)
        start = now()
        child.start(self.env, None)
        await self.wait_http_ok(child.ready_url)
        while now() - start < READY_TIMEOUT_S:
            epoch = await self.client.hget(self.keys.column("epoch"), child.name)
            if epoch is not None and epoch != epoch_before:
                fault.detail["new_epoch_registered_s"] = round(now() - start, 2)
                break
            await asyncio.sleep(0.05)
        fault.detail.update(await self.wait_truth())

    # ------------------------------------------------------------------ run

    async def quiesce(self, load: asyncio.Task[None]) -> dict[str, Any]:
        """Stop the load, let it drain, wait for recovery and one lease; count what is left."""
        self.stop_load.set()
        await asyncio.wait_for(load, QUIESCE_TIMEOUT_S)
        recovered = await self.wait_all_ok()
        # A reservation of a dead node is reaped once its lease has expired, by the
        # next renewal of a live node (every lease/3): 1.5 leases covers both.
        deadline = now() + LEASE_MS / 1000 * 1.5 + 2
        records: dict[str, Any] = {}
        counters: dict[str, dict[str, int]] = {}
        while True:
            counters, records = await self.pool_state()
            total = sum(v for column in counters.values() for v in column.values())
            if (not records and total == 0) or now() > deadline:
                break
            await asyncio.sleep(0.2)
        return {
            "all_nodes_ok_after_stop_s": None if recovered is None else round(recovered, 2),
            "waited_s": round(now() - deadline + LEASE_MS / 1000 * 1.5 + 2, 1),
            "reservations": len(records),
            "counter_sum": sum(v for column in counters.values() for v in column.values()),
            "by_node": dict(Counter(str(rec.get("node")) for rec in records.values())),
            "examples": sorted(records)[:5],
        }

    async def run(self) -> Results:
        """Start the cluster, soak, quiesce, and collect the results."""
        args = self.args
        results = Results(
            command=args.command,
            minutes=args.minutes,
            concurrency=args.concurrency,
            speed=args.speed,
            disconnect_rate=args.disconnect_rate,
            started_at=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        )
        self.log(f"starting {args.nodes} nodes, {args.engines} engines")
        await asyncio.to_thread(self.cluster.start, 60.0)
        try:
            self.t0 = now()
            start_rss = {name: (pid, rss_kib(pid)) for name, pid in self.node_pids().items()}
            self.log(f"cluster up; soaking for {args.minutes:g} min")
            load = asyncio.create_task(self.load())
            checker = asyncio.create_task(self.check_invariants())
            injector = asyncio.create_task(self.inject())
            await asyncio.sleep(args.minutes * 60)
            await injector  # a fault in progress finishes (and recovers) first
            end_rss = {name: (pid, rss_kib(pid)) for name, pid in self.node_pids().items()}
            self.log("quiescing")
            results.leaked = await self.quiesce(load)
            await checker
            results.duration_s = round(self.elapsed(), 1)
            results.rss_kib = {
                name: {
                    "start_pid": start_rss[name][0],
                    "start_kib": start_rss[name][1],
                    "end_pid": end_rss[name][0],
                    "end_kib": end_rss[name][1],
                }
                for name in start_rss
            }
        finally:
            if self._http is not None:
                await self._http.close()
            if self._client is not None:
                with suppress(Exception):
                    await self._client.aclose()
            await asyncio.to_thread(self.cluster.stop)
        results.requests_raw = self.requests
        results.faults_raw = self.faults
        results.invariant_checks = self.invariant_checks
        results.invariant_violations = self.violations
        return results


# ---------------------------------------------------------------------- report


def explained(req: dict[str, Any], faults: list[dict[str, Any]]) -> str | None:
    """The fault that explains a failed request, or None when none does.

    A node kill explains the streams cut on that node; an engine restart explains the
    streams cut on that engine. Redis faults and script flushes explain nothing: no
    request may fail because of Redis.
    """
    for f in faults:
        if not f["started"] - 0.5 <= req["ended"] <= f["ended"] + FAULT_GRACE_S:
            continue
        if f["kind"] == "kill_node" and f["target"] == f"node-{req['node']}":
            return f"kill_node {f['target']}"
        if f["kind"] == "restart_engine" and req["instance"] == f["target"]:
            return f"restart_engine {f['target']}"
    return None


def summarize(results: Results) -> dict[str, Any]:
    """The numbers the report shows (small enough to embed in the doc)."""
    reqs = [asdict(r) for r in results.requests_raw]
    faults = [asdict(f) for f in results.faults_raw]
    failed = [r for r in reqs if r["outcome"] == "failed"]
    why = [explained(r, faults) for r in failed]
    groups: dict[tuple[str, str], list[str]] = {}
    for r, w in zip(failed, why, strict=True):
        groups.setdefault((r["cause"], w or "nothing (unexplained)"), []).append(r["rid"])
    outcomes = Counter(r["outcome"] for r in reqs)
    minutes = []
    for m in range(int(max((r["started"] for r in reqs), default=0) // 60) + 1):
        in_minute = [r for r in reqs if m * 60 <= r["started"] < (m + 1) * 60]
        ttfts = [r["ttft_s"] * 1000 for r in in_minute if r["ttft_s"] is not None]
        minutes.append(
            {
                "minute": m,
                "started": len(in_minute),
                "ttft_p50_ms": percentile(ttfts, 0.5),
                "ttft_p99_ms": percentile(ttfts, 0.99),
                "failed": sum(r["outcome"] == "failed" for r in in_minute),
                "faults": [f["kind"] for f in faults if m * 60 <= f["started"] < (m + 1) * 60],
            }
        )
    return {
        "command": results.command,
        "started_at": results.started_at,
        "minutes": results.minutes,
        "duration_s": results.duration_s,
        "concurrency": results.concurrency,
        "speed": results.speed,
        "disconnect_rate": results.disconnect_rate,
        "counts": {
            "sent": len(reqs),
            "completed": outcomes["completed"],
            "disconnected": outcomes["disconnected"],
            "failed": len(failed),
            "explained": sum(w is not None for w in why),
            "unexplained": sum(w is None for w in why),
            "pending": outcomes["pending"],
        },
        "failure_groups": [
            {"cause": c, "explained_by": b, "count": len(rids), "examples": rids[:3]}
            for (c, b), rids in sorted(groups.items(), key=lambda kv: -len(kv[1]))
        ],
        "faults": faults,
        "leaks_seen": [
            {"t": round(f["started"], 1), "fault": f["kind"], "target": f["target"], "count": n}
            for f in faults
            for n in [
                f["detail"].get("still_in_redis_after_1.5_leases", 0)
                + f["detail"].get("stale_reservations_in_redis", 0)
            ]
            if n
        ],
        "leaked": results.leaked,
        "invariant_checks": results.invariant_checks,
        "invariant_violations": results.invariant_violations[:20],
        "invariant_violation_count": len(results.invariant_violations),
        "per_minute": minutes,
        "rss_kib": results.rss_kib,
        "error": results.error,
    }


def fmt(value: Any, spec: str = "") -> str:
    """A table cell ('–' for None)."""
    if value is None:
        return "–"
    return format(value, spec)


def report_tables(s: dict[str, Any]) -> str:
    """The markdown tables of one soak run."""
    c = s["counts"]
    lines = [
        f"Run of {s['started_at']}: {s['minutes']:g} min of load "
        f"({s['duration_s']:g} s with quiesce), {s['concurrency']} concurrent "
        f"streaming clients, engine speed {s['speed']:g}, "
        f"{s['disconnect_rate']:.0%} of requests hung up by the client mid-stream.",
        "",
        "| sent | completed | client hang-ups (on purpose) | failed |"
        " failed, explained by a fault | failed, unexplained |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {c['sent']} | {c['completed']} | {c['disconnected']} | {c['failed']} "
        f"| {c['explained']} | {c['unexplained']} |",
        "",
        "**Failures by cause.**",
        "",
    ]
    if s["failure_groups"]:
        lines += ["| cause | explained by | count | example request ids |", "|---|---|---:|---|"]
        for g in s["failure_groups"]:
            examples = ", ".join(f"`{x}`" for x in g["examples"])
            lines.append(f"| {g['cause']} | {g['explained_by']} | {g['count']} | {examples} |")
    else:
        lines.append("No request failed.")
    lines += [
        "",
        "**Faults injected**, in order (seconds since the load started).",
        "",
        "| t | fault | target | took | recovery |",
        "|---:|---|---|---:|---|",
    ]
    for f in s["faults"]:
        detail = ", ".join(f"{k} {v}" for k, v in f["detail"].items()) or "–"
        lines.append(
            f"| {f['started']:.1f} | {f['kind']} | {f['target']} "
            f"| {f['ended'] - f['started']:.1f} s | {detail} |"
        )
    kinds = Counter(f["kind"] for f in s["faults"])
    lines += ["", "Faults per kind: " + ", ".join(f"{k} {kinds[k]}" for k in FAULT_KINDS) + "."]
    leaked = s["leaked"]
    lines += [
        "",
        "**After quiesce** (load stopped and drained, every node back to "
        "`coordination=ok`, then up to 1.5 leases for the reaper):",
        "",
        "| reservations left in Redis | sum of counters | left, by node |",
        "|---:|---:|---|",
        f"| {leaked.get('reservations')} | {leaked.get('counter_sum')} "
        f"| {leaked.get('by_node') or '–'} |",
        "",
        "**Leaks seen during the run** (reservations of a killed node still in Redis 1.5 "
        "leases later, or stale reservations 10 s after a fault; a later Redis restart "
        "erases them, so they need not show after quiesce): "
        + (
            ", ".join(
                f"{x['count']} after {x['fault']} {x['target']} at {x['t']} s"
                for x in s.get("leaks_seen", [])
            )
            or "none"
        )
        + ".",
        "",
        "Invariant checks during the run (one MULTI read of the whole pool, "
        "coordinator/invariants.py: every counter, the index and the pool's total "
        f"against the reservation records): {s['invariant_checks']}, violations: "
        f"{s['invariant_violation_count']}.",
    ]
    lines += [f"- `{v}`" for v in s["invariant_violations"]]
    lines += [
        "",
        "**Client-side TTFT per minute** (request sent to first SSE chunk, through a node).",
        "",
        "| minute | requests started | TTFT p50 ms | TTFT p99 ms | failed | faults started |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for m in s["per_minute"]:
        lines.append(
            f"| {m['minute']} | {m['started']} | {fmt(m['ttft_p50_ms'], '.0f')} "
            f"| {fmt(m['ttft_p99_ms'], '.0f')} | {m['failed']} | {', '.join(m['faults']) or '–'} |"
        )
    lines += [
        "",
        "**Node memory** (VmRSS from /proc; a node killed during the run is a new "
        "process at the end, with another pid).",
        "",
        "| node | pid at start | RSS at start | pid at end | RSS at end |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, m in sorted(s["rss_kib"].items()):
        start = None if m["start_kib"] is None else m["start_kib"] / 1024
        end = None if m["end_kib"] is None else m["end_kib"] / 1024
        lines.append(
            f"| {name} | {m['start_pid']} | {fmt(start, '.1f')} MiB "
            f"| {m['end_pid']} | {fmt(end, '.1f')} MiB |"
        )
    if s.get("error"):
        lines += ["", f"The run ended with an error: `{s['error']}`"]
    return "\n".join(lines)


DOC_SOAK_INTRO = """## Soak (`bench/soak.py`, not in CI)

`LocalCluster` with 3 nodes and 4 mock engines, default settings (lease 10 s, Redis
timeout 100 ms), 12 concurrent streaming clients with random hang-ups, and one fault
every 30–60 s, drawn from shuffled rounds of five:

| fault | what it does | expected effect on clients |
|---|---|---|
| `kill_node` | the node leaves the client rotation (an LB health check), is killed with SIGKILL, and is restarted with the same node id and ports | the streams it carried are cut; nothing else |
| `restart_redis` | SIGKILL of Redis, restarted empty on the same port | none: nodes serve degraded, then re-assert |
| `sigstop_redis` | SIGSTOP of Redis for 3 s, then SIGCONT | none: calls time out after 100 ms, nodes serve degraded |
| `script_flush` | SCRIPT FLUSH, 5 times 0.2 s apart | none: NOSCRIPT is retried transparently |
| `restart_engine` | SIGKILL of a mock engine, restarted on the same port; it re-registers with a higher epoch | the streams it carried are cut; nothing else |

After each fault the soak measures `redis_matches_clients_s`: how long until Redis
holds exactly the streams open at the clients (atomic reads; `None` when it did not
within 10 s, with the differences; `missing_in_redis_at_first_check` names, by
`node->instance`, the open streams Redis lacked at the first sample after every node
reported `ok`, a node that had not yet noticed the restart included). After a
`kill_node` it first follows the dead
process's reservations for 1.5 leases (`still_in_redis_after_1.5_leases`). Every 2 s
it checks the pool's invariants as stored (`coordinator/invariants.py`: each
instance's counters, its index entries and the pool's total against the reservation
records, in one MULTI read). A failure is *explained*
when a node kill or engine restart in progress (or ended at most 3 s before) was
carrying that very request; any other failure is a finding.
"""


def render(summary: dict[str, Any]) -> str:
    """The soak's section of docs/reliability.md for one summary (embedded for
    --rerender); `write_section` puts it between its markers, the rest of the page
    stays as it is."""
    data = json.dumps(summary)  # one line: data for --rerender, not for reading
    return (
        DOC_SOAK_INTRO
        + f"\nCommand (the last run):\n\n```\n{summary['command']}\n```\n\n"
        + report_tables(summary)
        + "\n\n<details><summary>The run's numbers, as data (read by "
        + "<code>bench/soak.py --rerender</code>)</summary>\n\n"
        + RESULTS_START
        + "\n"
        + data
        + "\n```\n\n</details>\n"
    )


def load_embedded(doc: Path) -> dict[str, Any]:
    """The summary embedded in a previously written doc."""
    text = doc.read_text()
    start = text.index(RESULTS_START) + len(RESULTS_START)
    end = text.index("\n```", start)
    loaded: dict[str, Any] = json.loads(text[start:end])
    return loaded


# ---------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags of the soak."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--minutes", type=float, default=10.0, help="length of the load phase")
    p.add_argument("--nodes", type=int, default=3, help="proxy nodes")
    p.add_argument("--engines", type=int, default=4, help="mock engines")
    p.add_argument("--concurrency", type=int, default=12, help="concurrent streaming clients")
    p.add_argument("--speed", type=float, default=0.5, help="mock engine speed factor")
    p.add_argument("--max-tokens", type=int, default=96, help="largest max_tokens of a request")
    p.add_argument(
        "--disconnect-rate",
        type=float,
        default=0.05,
        help="fraction of requests the client hangs up mid-stream",
    )
    p.add_argument(
        "--fault-every",
        type=float,
        nargs=2,
        default=(30.0, 60.0),
        metavar=("MIN_S", "MAX_S"),
        help="seconds between faults, drawn uniformly",
    )
    p.add_argument("--seed", type=int, default=None, help="seed of every random draw")
    p.add_argument("--log", default="/tmp/soak-cluster.log", help="the processes' output")
    p.add_argument("--raw", default="/tmp/soak-requests.json", help="every request, as JSON")
    p.add_argument("--doc", default=str(DOC), help="markdown file --write-docs writes")
    add_write_docs(p, "--doc")
    p.add_argument(
        "--rerender", action="store_true", help="rebuild the doc from its embedded results"
    )
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.nodes < 2 or args.engines < 2 or args.concurrency < 1:
        p.error("need --minutes > 0, --nodes >= 2, --engines >= 2, --concurrency >= 1")
    if not 0 <= args.disconnect_rate <= 1:
        p.error("--disconnect-rate must be in [0, 1]")
    args.command = "python bench/soak.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the soak (or re-render its doc) and print the report."""
    args = parse_args(argv)
    doc = Path(args.doc)
    if args.rerender:
        write_section(DOC_SECTION, render(load_embedded(doc)), doc)
        print(f"re-rendered the soak section of {doc}")
        return 0
    # Every child inherits fds 1 and 2: point them at the log file, and keep the
    # original stdout for this script's own progress and report.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    log_fd = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    soak = Soak(args, out)
    try:
        results = asyncio.run(soak.run())
    except BaseException as exc:
        traceback.print_exc(file=out)
        print(f"soak failed: {exc!r} (process output in {args.log})", file=out)
        return 1
    summary = summarize(results)
    with open(args.raw, "w") as raw:
        json.dump([asdict(r) for r in results.requests_raw], raw)
    print(report_tables(summary), file=out)
    if args.write_docs:
        write_section(DOC_SECTION, render(summary), doc)
        print(f"\nwrote the soak section of {doc}; process output in {args.log}", file=out)
    leaked = summary["leaked"].get("reservations") or summary["leaked"].get("counter_sum")
    return 1 if leaked or summary["invariant_violation_count"] else 0


if __name__ == "__main__":
    sys.exit(main())
