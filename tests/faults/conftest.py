"""Harness of the fault suite: real processes on loopback, a streaming load, exact checks.

A `Fleet` starts proxy nodes (`python -m coordinator_cli.main serve`) and mock engines
(`coordinator mock-engine`, self-registered through a node's control plane, or listed
on nodes with `--instance`) as OS processes on free 127.0.0.1 ports, and kills every one of them when the test ends,
whatever happened. A `Load` sends streaming chat requests round-robin to the nodes
and records each one; the node's `X-Reservation-Id` names its reservation, so a check can
compare the reservations in Redis with the streams actually open at the clients.

`read_pool` reads counters, reservation records, epochs, leases and the Redis time
in one MULTI/EXEC, so a check made under load sees one consistent state.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import pytest
from redis.asyncio import Redis

from coordinator.keys import PoolKeys
from local_fleet.embedded import EmbeddedRedis, ServerUnavailableError, free_port
from tests.helpers import decode_counters, delete_pool

LEASE_MS = 1500  # every node's lease (COORD_LEASE_MS): a dead node is reaped quickly
START_TIMEOUT_S = 30.0  # a process must answer its health check by then
COUNTERS = ("inflight", "pending_prefill", "active_decode")
MAX_REQUESTS_PER_WORKER = 5000  # bounds each load worker; tests stop them much earlier
CLIENT_TIMEOUT_S = 30.0  # one whole client request, stream included
CLI = [sys.executable, "-m", "coordinator_cli.main", "--log-level", "WARNING"]
PR_SET_PDEATHSIG = 1

# (what, value) printed after the run. Filled through the `measure` fixture: test
# modules import this file under another module name, with a list of its own.
MEASUREMENTS: list[tuple[str, str]] = []


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    # If pytest itself is killed, no process of the fleet outlives it.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


# ---------------------------------------------------------------------- processes


@dataclass
class Proc:
    """One child process, its output in a log file."""

    name: str
    args: list[str]
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start (or start again) with the same arguments."""
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.args,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )

    @property
    def pid(self) -> int:
        """The current process id."""
        assert self.process is not None
        return self.process.pid

    @property
    def running(self) -> bool:
        """Whether the process has not exited."""
        return self.process is not None and self.process.poll() is None

    def send(self, sig: signal.Signals) -> None:
        """Send a signal (SIGSTOP, SIGCONT, ...)."""
        if self.running:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL and reap: the process is gone when this returns."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def tail(self, lines: int = 30) -> str:
        """The end of the process's output (for failure reports)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class Node:
    """A proxy node process: service plane, control plane, node id."""

    node_id: str
    port: int
    control_port: int
    proc: Proc

    @property
    def url(self) -> str:
        """Service-plane base URL."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def control_url(self) -> str:
        """Control-plane base URL."""
        return f"http://127.0.0.1:{self.control_port}"


@dataclass
class Engine:
    """A mock engine process, registered through a node's control plane."""

    instance_id: str
    port: int
    proc: Proc

    @property
    def url(self) -> str:
        """Base URL of the engine."""
        return f"http://127.0.0.1:{self.port}"


class RedisServer:
    """A private Redis-compatible server the test may kill, restart empty or freeze."""

    def __init__(self) -> None:
        self.server = EmbeddedRedis()
        self.port = 0

    def start(self) -> RedisServer:
        """Start on a free port."""
        self.server.start()
        self.port = self.server.port
        return self

    @property
    def url(self) -> str:
        """redis:// URL (stable across restarts: same port)."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        """The server's process id."""
        assert self.server.process is not None
        return self.server.process.pid

    def kill(self) -> None:
        """SIGKILL: everything in memory is lost."""
        process = self.server.process
        assert process is not None
        process.kill()
        process.wait(10)
        self.server.stop()

    async def restart_empty(self) -> None:
        """Start a new, empty server on the same port (start-up polls, so off the loop)."""
        self.server = EmbeddedRedis(port=self.port)
        await asyncio.to_thread(self.server.start)

    def pause(self) -> None:
        """SIGSTOP: the server holds its connections but answers nothing."""
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT."""
        os.kill(self.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Stop for good (resumed first, in case a test left it frozen)."""
        if self.server.process is not None and self.server.process.poll() is None:
            with contextlib.suppress(OSError):
                self.resume()
        self.server.stop()


# ---------------------------------------------------------------------- pool state


@dataclass(frozen=True)
class PoolState:
    """One atomic read of a pool: counters, reservations, epochs, leases, Redis time."""

    counters: dict[str, dict[str, int]]
    records: dict[str, dict[str, Any]]
    epochs: dict[str, int]
    leases: dict[str, int]  # node id -> lease deadline (Redis ms)
    now_ms: int

    def problems(self) -> list[str]:
        """DESIGN.md §6 violations: a counter != its live reservations, a negative one,
        a reservation of a void epoch or of an unknown instance."""
        expected = {name: dict.fromkeys(self.epochs, 0) for name in COUNTERS}
        found = []
        for rid, rec in self.records.items():
            if self.epochs.get(rec["instance"]) != rec["epoch"]:
                found.append(f"{rid} on {rec['instance']} has void epoch {rec['epoch']}")
                continue
            expected["inflight"][rec["instance"]] += 1
            phase = "pending_prefill" if rec["phase"] == "prefill" else "active_decode"
            expected[phase][rec["instance"]] += 1
        for name in COUNTERS:
            if any(v < 0 for v in self.counters[name].values()):
                found.append(f"negative {name}: {self.counters[name]}")
            if self.counters[name] != expected[name]:
                found.append(f"{name} {self.counters[name]} != live {expected[name]}")
        return found

    def of_node(self, node_id: str) -> set[str]:
        """Reservation ids recorded for a node."""
        return {rid for rid, rec in self.records.items() if rec["node"] == node_id}

    def of_instance(self, instance_id: str) -> set[str]:
        """Reservation ids recorded on an instance."""
        return {rid for rid, rec in self.records.items() if rec["instance"] == instance_id}

    @property
    def counter_sum(self) -> int:
        """Sum of every counter of every instance."""
        return sum(v for column in self.counters.values() for v in column.values())


async def read_pool(client: Redis, keys: PoolKeys) -> PoolState:
    """Read the pool in one MULTI/EXEC: concurrent scripts cannot interleave."""
    pipe = client.pipeline(transaction=True)
    pipe.hgetall(keys.column("slot"))
    pipe.getrange(keys.column("state"), 0, -1)
    pipe.hgetall(keys.column("reservations"))
    pipe.hgetall(keys.column("epoch"))
    pipe.zrange(keys.column("nodes"), 0, -1, withscores=True)
    pipe.time()
    slots, state, records, epochs, leases, (seconds, micros) = await pipe.execute()
    decoded = decode_counters(slots, state)
    return PoolState(
        counters={name: decoded[name] for name in COUNTERS},
        records={rid: json.loads(raw) for rid, raw in records.items()},
        epochs={k: int(v) for k, v in epochs.items()},
        leases={str(n): int(score) for n, score in leases},
        now_ms=int(seconds) * 1000 + int(micros) // 1000,
    )


# ---------------------------------------------------------------------- load


@dataclass
class Outcome:
    """One client request as the client saw it (times: monotonic seconds)."""

    rid: str
    node: str
    sent_at: float
    fault: str | None = None  # X-Mock-Fault sent with it
    max_tokens: int = 0
    headers_at: float | None = None
    first_chunk_at: float | None = None
    ended_at: float | None = None
    status: int | None = None
    instance: str = ""
    done: bool = False  # the stream ended with data: [DONE]
    error: str = ""  # exception that ended it, if any

    @property
    def ok(self) -> bool:
        """200, a complete stream, no error."""
        return self.status == 200 and self.done and not self.error

    @property
    def duration_s(self) -> float:
        """Send to end (0 while it runs)."""
        return 0.0 if self.ended_at is None else self.ended_at - self.sent_at

    @property
    def ttft_s(self) -> float | None:
        """Send to first SSE chunk."""
        return None if self.first_chunk_at is None else self.first_chunk_at - self.sent_at

    def __str__(self) -> str:
        return (
            f"{self.rid} via {self.node} on {self.instance or '?'}: status {self.status}, "
            f"done {self.done}, error {self.error or '-'}, fault {self.fault or '-'}"
        )


class Load:
    """Streaming chat requests round-robin over nodes, `concurrency` at a time.

    Worker k asks for `max_tokens[k % len(max_tokens)]` tokens, so one load can mix
    long streams (open across a whole fault) with short ones (new requests during it).
    `fault(n)` names the X-Mock-Fault of the n-th request (None: no fault).
    """

    def __init__(
        self,
        http: aiohttp.ClientSession,
        nodes: list[Node],
        *,
        concurrency: int = 8,
        max_tokens: int | Sequence[int] = 40,
        fault: Callable[[int], str | None] | None = None,
    ) -> None:
        self.http = http
        self.rotation = list(nodes)
        self.concurrency = concurrency
        self.max_tokens = [max_tokens] if isinstance(max_tokens, int) else list(max_tokens)
        self.fault = fault
        self.results: list[Outcome] = []
        self.by_rid: dict[str, Outcome] = {}
        self.open: dict[str, Outcome] = {}  # headers received, stream not ended
        self._count = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Load:
        self._tasks = [asyncio.create_task(self._worker(k)) for k in range(self.concurrency)]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Send nothing more and wait for the requests in flight to end."""
        self._stop.set()
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=CLIENT_TIMEOUT_S + 5)
            for task in pending:
                task.cancel()
            for task in self._tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self._tasks = []

    def remove(self, node: Node) -> None:
        """Take a node out of the rotation (as a load balancer's health check would)."""
        self.rotation = [n for n in self.rotation if n is not node]

    def ended(self, node: Node | None = None, after: float = 0.0) -> list[Outcome]:
        """Requests that ended, optionally only those sent through one node after a time."""
        return [
            r
            for r in self.results
            if r.ended_at is not None
            and r.sent_at >= after
            and (node is None or r.node == node.node_id)
        ]

    def completed(self, node: Node | None = None, after: float = 0.0) -> int:
        """How many requests completed fine (optionally: through a node, sent after a time)."""
        return sum(r.ok for r in self.ended(node, after))

    async def wait_more_completed(
        self, count: int = 8, what: str = "serving after recovery"
    ) -> None:
        """Wait until `count` more requests than now have completed fine."""
        served = self.completed()
        await wait_until(lambda: self.completed() >= served + count, 20, what)

    def assert_none_failed(self) -> None:
        """Every request so far ended fine (none failed, none stalled past its timeout)."""
        bad = [str(r) for r in self.results if not r.ok]
        assert not bad, bad

    def open_on(self, *, node: Node | None = None, instance: str | None = None) -> list[Outcome]:
        """Streams open now, optionally through one node or on one instance."""
        return [
            r
            for r in self.open.values()
            if (node is None or r.node == node.node_id)
            and (instance is None or r.instance == instance)
        ]

    async def _worker(self, k: int) -> None:
        tokens = self.max_tokens[k % len(self.max_tokens)]
        for _ in range(MAX_REQUESTS_PER_WORKER):
            if self._stop.is_set():
                return
            if not self.rotation:
                await asyncio.sleep(0.02)
                continue
            n = next(self._count)
            node = self.rotation[n % len(self.rotation)]
            fault = self.fault(n) if self.fault is not None else None
            out = Outcome(f"ld-{self._prefix}-{n}", node.node_id, time.monotonic(), fault)
            await self._one(out, node, tokens)

    async def _one(self, out: Outcome, node: Node, max_tokens: int) -> None:
        out.max_tokens = max_tokens
        self.results.append(out)
        self.by_rid[out.rid] = out
        body = {
            "model": "mock",
            "messages": [{"role": "user", "content": "tell me about faults " * 8}],
            "max_tokens": max_tokens,
            "stream": True,
        }
        headers = {"X-Request-Id": out.rid}
        if out.fault is not None:
            headers["X-Mock-Fault"] = out.fault
        try:
            async with self.http.post(
                node.url + "/v1/chat/completions", json=body, headers=headers
            ) as resp:
                out.status = resp.status
                out.headers_at = time.monotonic()
                out.instance = resp.headers.get("X-Instance-Id", "")
                # The node names its reservation (a client's X-Request-Id is not it).
                out.rid = resp.headers.get("X-Reservation-Id", out.rid)
                self.by_rid[out.rid] = out
                if resp.status == 200:
                    self.open[out.rid] = out
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    if out.first_chunk_at is None:
                        out.first_chunk_at = time.monotonic()
                    if line.startswith(b"data: [DONE]"):
                        out.done = True
        except (aiohttp.ClientError, TimeoutError) as exc:
            out.error = type(exc).__name__
        finally:
            out.ended_at = time.monotonic()
            self.open.pop(out.rid, None)


# ---------------------------------------------------------------------- the fleet


class Fleet:
    """Nodes and engines of one test on one Redis; `close()` kills every process."""

    def __init__(self, tmp_path: Path, redis_url: str, http: aiohttp.ClientSession) -> None:
        self.tmp_path = tmp_path
        self.redis_url = redis_url
        self.http = http
        self.pool = f"f{uuid.uuid4().hex[:10]}"
        self.keys = PoolKeys("lc", self.pool)
        self.nodes: list[Node] = []
        self.engines: list[Engine] = []
        self.procs: list[Proc] = []
        self.client = Redis.from_url(redis_url, decode_responses=True, socket_timeout=2.0)

    def _proc(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        full_env = dict(os.environ)
        for var in [v for v in full_env if v.startswith(("COORD_", "MOCK_ENGINE_"))]:
            del full_env[var]  # the test decides every knob
        full_env.update(env or {})
        proc = Proc(name, args, full_env, self.tmp_path / f"{name}.log")
        self.procs.append(proc)
        return proc

    def add_node(
        self,
        node_id: str,
        *,
        redis_url: str | None = None,
        env: dict[str, str] | None = None,
        instances: Sequence[str] = (),
    ) -> Node:
        """A node (not started yet): lease LEASE_MS, default Redis timeout.

        `instances` are static engine URLs the node registers and keeps alive itself.
        """
        port, control = free_port(), free_port()
        args = [
            *CLI,
            "serve",
            "--redis-url",
            redis_url or self.redis_url,
            "--pool",
            self.pool,
            "--port",
            str(port),
            "--control-port",
            str(control),
            "--node-id",
            node_id,
            *(arg for url in instances for arg in ("--instance", url)),
        ]
        node_env = {"COORD_LEASE_MS": str(LEASE_MS), **(env or {})}
        node = Node(node_id, port, control, self._proc(node_id, args, node_env))
        self.nodes.append(node)
        return node

    def add_engine(
        self, instance_id: str, via: Node | None, *, port: int | None = None, speed: float = 1.0
    ) -> Engine:
        """A mock engine (not started yet) registering through `via`'s control plane.

        With `via` None it registers nowhere: a static instance some node lists, whose
        id is then the node's (host:port), not `instance_id`.
        """
        port = port or free_port()
        args = [*CLI, "mock-engine", "--port", str(port), "--speed", str(speed)]
        if via is not None:
            args += ["--register", via.control_url, "--instance-id", instance_id]
        name = f"{instance_id}-{port}"
        engine = Engine(instance_id, port, self._proc(name, args))
        self.engines.append(engine)
        return engine

    async def start_two_by_two(
        self, env: dict[str, str] | None = None, env_b: dict[str, str] | None = None
    ) -> tuple[Node, Node, Engine, Engine]:
        """node-a and node-b (`env_b` defaults to `env`), then engine-0 registered through
        node-a and engine-1 through node-b; returns once both instances are alive."""
        a = self.add_node("node-a", env=env)
        b = self.add_node("node-b", env=env if env_b is None else env_b)
        await self.start(a, b)
        e0, e1 = self.add_engine("engine-0", via=a), self.add_engine("engine-1", via=b)
        await self.start(e0, e1)
        await self.wait_alive(2)
        return a, b, e0, e1

    async def start(self, *items: Node | Engine) -> None:
        """Start processes and wait until each answers its health check."""
        for item in items:
            item.proc.start()
        await asyncio.gather(*(self.wait_ready(item) for item in items))

    async def wait_ready(self, item: Node | Engine) -> None:
        """Poll the health URL until 200; fail at once if the process died."""
        url = item.url + ("/healthz" if isinstance(item, Node) else "/health")

        async def ready() -> bool:
            if not item.proc.running:
                raise AssertionError(f"{item.proc.name} exited:\n{item.proc.tail()}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with self.http.get(url, timeout=aiohttp.ClientTimeout(total=1)) as resp:
                    return resp.status == 200
            return False

        await wait_until(ready, START_TIMEOUT_S, f"{item.proc.name} ready")

    async def healthz(self, node: Node) -> dict[str, Any]:
        """The node's /healthz document."""
        async with self.http.get(
            node.url + "/healthz", timeout=aiohttp.ClientTimeout(total=5)
        ) as resp:
            doc: dict[str, Any] = await resp.json()
            return doc

    async def coordination(self, node: Node) -> str:
        """`ok` or `degraded`, as the node's /healthz says."""
        return str((await self.healthz(node))["coordination"])

    async def wait_coordination(self, node: Node, value: str, timeout_s: float = 15.0) -> None:
        """Wait until the node reports this coordination state."""

        async def check() -> bool:
            return await self.coordination(node) == value

        await wait_until(check, timeout_s, f"{node.node_id} coordination={value}")

    async def wait_alive(self, count: int, nodes: list[Node] | None = None) -> None:
        """Wait until every (given) node sees `count` alive instances."""

        async def check() -> bool:
            docs = [await self.healthz(n) for n in nodes or self.nodes]
            return all(d["alive_instances"] == count for d in docs)

        await wait_until(check, START_TIMEOUT_S, f"{count} alive instances on every node")

    async def metric(self, node: Node, name: str, **labels: str) -> float:
        """Sum of a metric's samples on the node's /metrics that carry these labels."""
        async with self.http.get(node.url + "/metrics") as resp:
            text = await resp.text()
        total = 0.0
        for line in text.splitlines():
            if line.startswith("#") or not line.startswith(name):
                continue
            head, _, value = line.rpartition(" ")
            metric, _, label_text = head.partition("{")
            if metric != name:
                continue
            if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
                total += float(value)
        return total

    async def state(self) -> PoolState:
        """The pool, read atomically."""
        return await read_pool(self.client, self.keys)

    async def close(self) -> None:
        """Kill every process, delete the pool's keys, close the client."""
        for proc in self.procs:
            with contextlib.suppress(OSError):
                proc.send(signal.SIGCONT)
            proc.kill()
        with contextlib.suppress(Exception):
            await delete_pool(self.client, "lc", self.pool)
        await self.client.aclose()

    def tails(self) -> str:
        """Every process's last lines of output."""
        return "\n".join(f"----- {p.name}\n{p.tail()}" for p in self.procs)


# ---------------------------------------------------------------------- waits and checks


async def wait_until(
    predicate: Callable[[], Awaitable[bool] | bool],
    timeout_s: float,
    what: str,
    every_s: float = 0.02,
) -> float:
    """Poll until the predicate holds; returns the seconds it took (fails at the deadline)."""
    start = time.monotonic()
    while True:
        result = predicate()
        if not isinstance(result, bool):
            result = await result
        if result:
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(every_s)


async def wait_converged(fleet: Fleet, load: Load, timeout_s: float = 10.0) -> set[str]:
    """Wait until Redis holds exactly the streams open at the clients; returns their ids.

    Each sample is an atomic read; it counts only if no stream opened or ended while
    it was taken. A counter that ever differs from its live reservations fails at once:
    that invariant holds at every instant, not only eventually. At the deadline the
    failure names the streams Redis misses (node -> instance) and the stale records.
    """
    matched: set[str] = set()
    last: list[str] = []

    async def check() -> bool:
        before = set(load.open)
        state = await fleet.state()
        assert not state.problems(), state.problems()
        if set(load.open) != before:
            return False
        records = set(state.records)
        if records == before:
            matched.update(before)
            return True
        missing = sorted(
            f"{load.by_rid[r].node}->{load.by_rid[r].instance}" for r in before - records
        )
        last[:] = [f"open at the clients, missing in Redis: {missing}"]
        last.append(f"in Redis, not open at the clients: {len(records - before)}")
        return False

    try:
        await wait_until(check, timeout_s, "Redis reservations == streams open at the clients")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last sample: {'; '.join(last)}") from None
    return matched


async def wait_drained(fleet: Fleet, timeout_s: float = 10.0) -> None:
    """After the load: no reservation left and every counter 0 (nothing leaked)."""

    async def check() -> bool:
        state = await fleet.state()
        assert not state.problems(), state.problems()
        return not state.records and state.counter_sum == 0

    await wait_until(check, timeout_s, "every reservation released and every counter 0")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print what the fault tests measured."""
    if MEASUREMENTS:
        terminalreporter.section("fault suite measurements")
        for what, value in MEASUREMENTS:
            terminalreporter.write_line(f"{what}: {value}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Keep each phase's report on the item, so fixtures know whether the test failed."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


# ---------------------------------------------------------------------- fixtures

Measure = Callable[[str, str], None]


@pytest.fixture
def measure() -> Measure:
    """Record a number for the summary printed after the run (never asserted on speed)."""

    def record(what: str, value: str) -> None:
        MEASUREMENTS.append((what, value))

    return record


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """The test's client session: no connection cap, bounded requests."""
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S),
    ) as session:
        yield session


@pytest.fixture
async def private_redis() -> AsyncIterator[RedisServer]:
    """A Redis-compatible server of this test alone (it will be killed or frozen)."""
    server = RedisServer()
    try:
        await asyncio.to_thread(server.start)
    except ServerUnavailableError as exc:
        pytest.skip(f"no Redis-compatible server: {exc}")
    try:
        yield server
    finally:
        server.stop()


async def _fleet(
    request: pytest.FixtureRequest, tmp_path: Path, url: str, http: aiohttp.ClientSession
) -> AsyncIterator[Fleet]:
    fleet = Fleet(tmp_path, url, http)
    try:
        yield fleet
    finally:
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            print(fleet.tails())  # shown with the failure
        await fleet.close()


@pytest.fixture
async def fleet(
    request: pytest.FixtureRequest, tmp_path: Path, redis_url: str, http: aiohttp.ClientSession
) -> AsyncIterator[Fleet]:
    """A fleet on the session's server (its own pool): for faults that spare Redis."""
    async for f in _fleet(request, tmp_path, redis_url, http):
        yield f


@pytest.fixture
async def private_fleet(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    private_redis: RedisServer,
    http: aiohttp.ClientSession,
) -> AsyncIterator[Fleet]:
    """A fleet on a private server: for faults that hit Redis itself."""
    async for f in _fleet(request, tmp_path, private_redis.url, http):
        yield f
