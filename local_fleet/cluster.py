"""`coordinator cluster`: Redis, N proxy nodes and M registered mock engines, locally.

Every part is a real OS process on 127.0.0.1. Before starting anything the launcher
checks that every port it will use is free and that a given Redis answers. It then
waits for each child to be ready (by polling its health endpoint, with a deadline),
prints how to reach everything, and on Ctrl-C or SIGTERM stops engines, then nodes,
then Redis, leaving no process or temporary directory behind. Children also get
SIGTERM if the launcher dies. A child that fails is reported with its own last
output line (each child writes its warnings and errors to a file in a temporary
directory, removed with the cluster): at start-up the launch fails; later the rest
serve on, as a fleet does when one of its processes dies, until no node is left.
Each engine registers through every node's control plane in turn (its own node
first), so it stays registered while a node is down.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from coordinator.connection import close_redis, connect_redis, redact
from coordinator.errors import CoordinatorError
from coordinator.settings import Settings
from local_fleet.embedded import EmbeddedRedis, ServerUnavailableError, die_with_parent
from local_fleet.pools import delete_pool

# Below Linux's ephemeral range (32768+), where outgoing connections take ports.
PORT_RANGE = (20_000, 32_000)


def free_port_block(nodes: int, engines: int, rng: random.Random | None = None) -> int:
    """A base port whose node and engine ports (see LocalCluster) are all free now."""
    rng = rng or random.Random()
    for _ in range(200):
        base = rng.randrange(*PORT_RANGE, 2)
        ports = [base + i for i in range(2 * nodes)] + [base + 100 + j for j in range(engines)]
        try:
            for port in ports:
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free block of loopback ports found")


class ClusterStartError(RuntimeError):
    """The local cluster could not start; the message names the cause."""


REDIS_CHECK_TIMEOUT_MS = 2000  # a given Redis must answer PING within this before anything starts


def port_in_use(port: int) -> bool:
    """True if a server could not bind 127.0.0.1:port now (as aiohttp binds: SO_REUSEADDR)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def check_redis(url: str) -> None:
    """PING the Redis at `url`; ClusterStartError naming the cause if it does not answer."""
    settings = replace(Settings(), redis_timeout_ms=REDIS_CHECK_TIMEOUT_MS)

    async def ping() -> None:
        client = connect_redis(url, settings)
        try:
            await client.ping()
        finally:
            await close_redis(client)

    try:
        asyncio.run(ping())
    except (RedisError, OSError, CoordinatorError) as exc:
        raise ClusterStartError(f"Redis at {redact(url)} does not answer: {exc}") from exc


def http_json(url: str, timeout_s: float = 2.0) -> Any:
    """GET a JSON document (loopback only)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read())


@dataclass
class Child:
    """One launched process and the URL that says it is ready."""

    name: str
    args: list[str]
    ready_url: str
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None  # where its output goes, when not inherited

    def start(self, env: dict[str, str], log_to: Any) -> None:
        """Start the process; its output goes to `log_to` (a file, DEVNULL, or None: ours)."""
        self.process = subprocess.Popen(
            self.args, env=env, stdout=log_to, stderr=log_to, preexec_fn=die_with_parent
        )

    def start_logged(self, env: dict[str, str], log_path: Path) -> None:
        """Start the process with its output in `log_path` (read back by last_words)."""
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.start(env, log)

    def last_words(self) -> str:
        """The last line the process wrote (its error, when it failed), or ''."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return next((line.strip() for line in reversed(lines) if line.strip()), "")

    def exit_message(self) -> str | None:
        """None while running; else how it exited, with its last line."""
        if self.process is None or self.process.poll() is None:
            return None
        words = self.last_words()
        return f"{self.name} exited with code {self.process.returncode}" + (
            f": {words}" if words else ""
        )

    def wait_ready(self, deadline: float) -> None:
        """Poll the ready URL until it answers 200; fail fast if the process died."""
        while True:
            exited = self.exit_message()
            if exited is not None:
                raise ClusterStartError(f"{exited} (during start-up)")
            try:
                with urllib.request.urlopen(self.ready_url, timeout=1.0) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise ClusterStartError(f"{self.name} not ready at {self.ready_url} in time")
            time.sleep(0.05)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after the timeout."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@dataclass
class LocalCluster:
    """Redis + proxy nodes + mock engines on loopback ports."""

    nodes: int = 3
    engines: int = 4
    base_port: int = 8001
    redis_url: str | None = None
    speed: float = 1.0
    pool: str = "demo"
    token: str | None = None
    strategy: str = "least_load"
    engine_args: list[str] = field(default_factory=list)
    per_engine_args: list[list[str]] = field(default_factory=list)  # engine j: [j % len]
    node_env: dict[str, str] = field(default_factory=dict)  # e.g. COORD_* knobs for nodes
    quiet: bool = True
    redis: EmbeddedRedis | None = None
    children: list[Child] = field(default_factory=list)
    _logs: tempfile.TemporaryDirectory[str] | None = None

    def node_port(self, k: int) -> int:
        """Service port of node k."""
        return self.base_port + 2 * k

    def control_port(self, k: int) -> int:
        """Control-plane port of node k."""
        return self.base_port + 2 * k + 1

    def engine_port(self, j: int) -> int:
        """Port of mock engine j."""
        return self.base_port + 100 + j

    def ports(self) -> list[tuple[int, str]]:
        """Every port the cluster binds, with what binds it."""
        out = []
        for k in range(self.nodes):
            out += [(self.node_port(k), f"node-{k}"), (self.control_port(k), f"node-{k} control")]
        return out + [(self.engine_port(j), f"engine-{j}") for j in range(self.engines)]

    def check_ports(self) -> None:
        """ClusterStartError listing the ports something else already holds."""
        taken = [f"{port} ({what})" for port, what in self.ports() if port_in_use(port)]
        if taken:
            raise ClusterStartError(
                f"port{'s' if len(taken) > 1 else ''} already in use on 127.0.0.1: "
                f"{', '.join(taken)}; choose another --base-port"
            )

    @property
    def node_urls(self) -> list[str]:
        """Service-plane base URLs of every node."""
        return [f"http://127.0.0.1:{self.node_port(k)}" for k in range(self.nodes)]

    @property
    def control_urls(self) -> list[str]:
        """Control-plane base URLs of every node."""
        return [f"http://127.0.0.1:{self.control_port(k)}" for k in range(self.nodes)]

    @property
    def engine_urls(self) -> list[str]:
        """Base URLs of every mock engine."""
        return [f"http://127.0.0.1:{self.engine_port(j)}" for j in range(self.engines)]

    def start(self, timeout_s: float = 30.0) -> LocalCluster:
        """Start everything and wait until every engine is registered and alive."""
        if self.nodes < 1 or self.engines < 1:
            raise ValueError("a cluster needs at least one node and one engine")
        if self.speed <= 0:
            raise ValueError("--speed must be > 0")
        if not (1 <= self.base_port and self.engine_port(self.engines - 1) <= 65535):
            raise ValueError(f"--base-port {self.base_port} leaves no room for every port")
        self.check_ports()
        if self.redis_url is not None:
            check_redis(self.redis_url)
        deadline = time.monotonic() + timeout_s
        try:
            if self.redis_url is None:
                self.redis = EmbeddedRedis().start()
                self.redis_url = self.redis.url
            env = dict(os.environ)
            env.pop("COORD_TOKEN", None)
            node_env = {**env, **self.node_env}
            if self.quiet:
                self._logs = tempfile.TemporaryDirectory(prefix="coordinator-cluster-")
            python = [sys.executable, "-m"]
            # Logged children keep warnings and errors only: a long-lived cluster's
            # per-request access lines would grow the log files without end.
            quiet = ["--log-level", "WARNING"] if self._logs is not None else []
            auth = ["--token", self.token] if self.token else []
            for k in range(self.nodes):
                child = Child(
                    f"node-{k}",
                    [
                        *python,
                        "proxy_node",
                        *quiet,
                        "--redis-url",
                        self.redis_url,
                        "--pool",
                        self.pool,
                        "--port",
                        str(self.node_port(k)),
                        "--control-port",
                        str(self.control_port(k)),
                        "--node-id",
                        f"node-{k}",
                        "--strategy",
                        self.strategy,
                        *auth,
                    ],
                    f"http://127.0.0.1:{self.node_port(k)}/healthz",
                )
                self._launch(child, node_env)
                self.children.append(child)
            for child in self.children:
                child.wait_ready(deadline)
            engines = []
            for j in range(self.engines):
                # Its node first (engines spread over the nodes), the others after it:
                # the engine stays registered while its node is down.
                k = j % self.nodes
                control = ",".join(self.control_urls[k:] + self.control_urls[:k])
                child = Child(
                    f"engine-{j}",
                    [
                        *python,
                        "local_fleet.mock_engine",
                        *quiet,
                        "--port",
                        str(self.engine_port(j)),
                        "--speed",
                        str(self.speed),
                        "--register",
                        control,
                        "--instance-id",
                        f"engine-{j}",
                        *auth,
                        *self.engine_args,
                        *(
                            self.per_engine_args[j % len(self.per_engine_args)]
                            if self.per_engine_args
                            else []
                        ),
                    ],
                    f"http://127.0.0.1:{self.engine_port(j)}/health",
                )
                self._launch(child, env)
                engines.append(child)
            self.children.extend(engines)
            for child in engines:
                child.wait_ready(deadline)
            self.wait_for_instances(self.engines, deadline)
            # A ready URL answered by someone else's server would hide a child that
            # failed to bind: every child must still be running now.
            self.check_children()
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self, child: Child, env: dict[str, str]) -> None:
        if self._logs is None:
            child.start(env, None)
        else:
            child.start_logged(env, Path(self._logs.name) / f"{child.name}.log")

    def check_children(self) -> None:
        """ClusterStartError with the first exited child's own last line."""
        for child in self.children:
            exited = child.exit_message()
            if exited is not None:
                raise ClusterStartError(exited)

    def alive_instances(self) -> int:
        """Alive instances as node 0's control plane reports them."""
        try:
            listing = http_json(f"{self.control_urls[0]}/v1/instances")
        except (urllib.error.URLError, OSError, ValueError):
            return 0
        rows = listing.get("instances", listing) if isinstance(listing, dict) else listing
        return sum(1 for row in rows if row.get("alive"))

    def wait_for_instances(self, count: int, deadline: float) -> None:
        """Block until `count` instances are alive in the pool."""
        while self.alive_instances() < count:
            self.check_children()
            if time.monotonic() > deadline:
                words = [
                    f"{child.name}: {child.last_words()}"
                    for child in self.children
                    if child.name.startswith("engine-") and child.last_words()
                ]
                raise ClusterStartError(
                    f"only {self.alive_instances()} of {count} engines registered in time"
                    + ("; last lines: " + " | ".join(words) if words else "")
                )
            time.sleep(0.05)

    def keep_logs(self, into: Path) -> None:
        """Copy the children's logs (quiet clusters keep them in a temporary directory,
        removed by `stop`) into `into`."""
        if self._logs is not None:
            shutil.copytree(self._logs.name, into, dirs_exist_ok=True)

    def stop(self) -> None:
        """Stop engines (they unregister), then nodes, then Redis."""
        for child in reversed(self.children):
            child.stop()
        self.children.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        if self._logs is not None:
            self._logs.cleanup()
            self._logs = None

    def delete_pool(self) -> int:
        """Delete every key of this cluster's pool (and nothing else); returns how many."""
        assert self.redis_url is not None
        return delete_pool(self.redis_url, self.pool)

    def server_line(self) -> str:
        """Which Redis the cluster uses: the URL, and for a private one its binary."""
        assert self.redis_url is not None
        if self.redis is None:
            return redact(self.redis_url)
        return f"{self.redis_url}  (private: {self.redis.binary}, {self.redis.version_line})"

    def describe(self) -> str:
        """Every URL, and a redis-cli line for inspecting the pool."""
        assert self.redis_url is not None
        host_port = self.redis_url.split("://", 1)[1].split("/", 1)[0].rsplit("@", 1)[-1]
        host, _, port = host_port.partition(":")
        lines = [f"redis        {self.server_line()}"]
        for k in range(self.nodes):
            lines.append(
                f"node-{k}       service {self.node_urls[k]}   control {self.control_urls[k]}"
            )
        for j in range(self.engines):
            lines.append(f"engine-{j}     {self.engine_urls[j]}")
        pool_key = f"lc:{{{self.pool}}}"
        lines += [
            "",
            "try:",
            f"  curl -s {self.node_urls[0]}/v1/chat/completions -H 'Content-Type: application/json' "
            '-d \'{"model":"mock","messages":[{"role":"user","content":"hi"}],"max_tokens":16}\'',
            f"  curl -s {self.control_urls[0]}/debug/instance_loads | python -m json.tool",
            f"  redis-cli -h {host} -p {port or 6379} HGETALL '{pool_key}:reservations'",
            f"  coordinator inspect --redis-url {redact(self.redis_url)} --pool {self.pool}",
            f"  coordinator cordon engine-0 --redis-url {redact(self.redis_url)} --pool "
            f"{self.pool} --wait   # drain it; --lift puts it back",
        ]
        return "\n".join(lines)


def add_fleet_arguments(parser: argparse.ArgumentParser, base_port: int) -> None:
    """The cluster's shape: --nodes, --engines, --redis-url, --base-port and --speed."""
    parser.add_argument("--nodes", type=int, default=3, help="proxy nodes to start")
    parser.add_argument("--engines", type=int, default=4, help="mock engines to start")
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL"),
        help="use this Redis instead of a private embedded server (env REDIS_URL)",
    )
    parser.add_argument(
        "--base-port",
        type=int,
        default=base_port,
        help="node k serves on base+2k, its control plane on base+2k+1; engine j on base+100+j",
    )
    parser.add_argument("--speed", type=float, default=1.0, help="mock engines run S times faster")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `coordinator cluster`."""
    add_fleet_arguments(parser, base_port=8001)
    parser.add_argument("--pool", default="demo", help="pool name")
    parser.add_argument("--token", default=None, help="control-plane bearer token for all nodes")
    parser.add_argument(
        "--strategy",
        default="least_load",
        choices=["least_load", "round_robin", "power_of_two"],
        help="selection strategy of every node",
    )


def run(args: argparse.Namespace) -> int:
    """Start the cluster and keep it up until Ctrl-C or SIGTERM."""
    cluster = LocalCluster(
        nodes=args.nodes,
        engines=args.engines,
        base_port=args.base_port,
        redis_url=args.redis_url,
        speed=args.speed,
        pool=args.pool,
        token=args.token,
        strategy=args.strategy,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"starting redis, {args.nodes} nodes and {args.engines} engines...", flush=True)
    try:
        cluster.start()
    except (RuntimeError, ValueError, ServerUnavailableError) as exc:
        print(f"cluster failed to start: {exc}", file=sys.stderr)
        return 1
    print(cluster.describe(), flush=True)
    print("\ncluster is up; Ctrl-C stops everything.", flush=True)
    try:
        code = watch(cluster, stop)
    finally:
        # Stop first: a closed stdout (the reader went away) must not leave orphans.
        _say("stopping...")
        cluster.stop()
    _say("stopped.")
    return code


def watch(cluster: LocalCluster, stop: threading.Event, every_s: float = 0.5) -> int:
    """Report each process that exits while the rest serve on (a node, an engine or
    the private Redis killed to see what the fleet does); 0 once `stop` is set, 1 when
    no node is left."""
    gone: set[str] = set()
    nodes = {f"node-{k}" for k in range(cluster.nodes)}
    while not stop.wait(every_s):
        for name, exited in _exits(cluster):
            if name in gone:
                continue
            gone.add(name)
            after = AFTER_EXIT[name.split("-")[0]] if nodes - gone else "no node is left"
            print(f"{exited}; {after}", file=sys.stderr, flush=True)
        if not nodes - gone:
            return 1
    return 0


def _exits(cluster: LocalCluster) -> Iterator[tuple[str, str]]:
    """(name, how it exited) of every process of the cluster that is not running."""
    for child in cluster.children:
        exited = child.exit_message()
        if exited is not None:
            yield child.name, exited
    server = cluster.redis.process if cluster.redis is not None else None
    if server is not None and server.poll() is not None:
        yield "redis", f"redis exited with code {server.returncode}"


# What the rest of the cluster does after a child exited, by kind.
AFTER_EXIT = {
    "node": "the other nodes serve on; its lease expires and a peer releases its "
    "reservations, and its engines heartbeat through another node",
    "engine": "the nodes stop sending it requests once its heartbeats are missed",
    "redis": "the nodes serve on degraded (each one counts only its own requests) "
    "until a server answers at its address again",
}


def _say(text: str) -> None:
    with contextlib.suppress(OSError):
        print(text, flush=True)
