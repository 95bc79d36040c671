"""Local Redis Cluster and Sentinel topologies on loopback, for tests and benchmarks.

Every process binds 127.0.0.1 on a free port and keeps its files in its own temp
directory. Setup uses plain commands over redis-py (CLUSTER ADDSLOTSRANGE, CLUSTER
MEET, SENTINEL MASTER), so no redis-cli/valkey-cli is needed. `stop()` kills every
process and removes every directory, and an atexit hook does the same for anything a
crashed test left behind.
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from local_fleet.embedded import (
    EPHEMERAL_ARGS,
    ServerUnavailableError,
    find_server_binary,
    free_port,
    pings,
)

CLUSTER_SLOTS = 16384
SETUP_TIMEOUT_S = 20.0  # longest wait for a topology to converge
POLL_S = 0.02  # pause between readiness polls

_LIVE: set[ServerProcess] = set()  # every started process, for the atexit sweep


class TopologyUnavailableError(ServerUnavailableError):
    """The server binary cannot run this topology (no cluster or sentinel mode)."""


@dataclass(eq=False)
class ServerProcess:
    """One redis-server/valkey-server process (server or sentinel) and its directory."""

    port: int
    process: subprocess.Popen[bytes]
    workdir: Path

    @property
    def url(self) -> str:
        """Plain redis:// URL of this one process."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def alive(self) -> bool:
        """True while the process runs."""
        return self.process.poll() is None

    def client(self, timeout_s: float = 1.0) -> redis.Redis:
        """A synchronous client of this process (decoded replies)."""
        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            decode_responses=True,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # readiness polls must fail fast, not back off
        )

    def kill(self) -> None:
        """SIGKILL: no shutdown, no last words (like a crashed host)."""
        if self.alive:
            self.process.kill()
        self.process.wait()

    def pause(self) -> None:
        """SIGSTOP: the process stops reading its sockets until resume()."""
        if self.alive:
            self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after pause()."""
        if self.alive:
            self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Kill the process, close its pipes and forget it (the directory stays)."""
        if self.alive:
            self.resume()  # a paused process would sit on SIGTERM
            self.process.terminate()
            try:
                self.process.wait(3)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process.wait()
        if self.process.stderr is not None:
            self.process.stderr.close()
        _LIVE.discard(self)

    def log_tail(self, lines: int = 20) -> str:
        """The end of the process's log file (for error messages)."""
        log = self.workdir / "server.log"
        if not log.exists():
            return ""
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def spawn(
    binary: str,
    workdir: Path,
    args: list[str],
    *,
    port: int | None = None,
    config_file: Path | None = None,
    timeout_s: float = 10.0,
) -> ServerProcess:
    """Start one process in `workdir` and wait until it answers PING."""
    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    argv = [binary]
    if config_file is not None:
        argv.append(str(config_file))  # must come first: sentinel rewrites this file
    argv += [
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--dir",
        str(workdir),
        "--daemonize",
        "no",
        "--logfile",
        str(workdir / "server.log"),
        *args,
    ]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    server = ServerProcess(port, process, workdir)
    _LIVE.add(server)
    try:
        wait_until(lambda: _pings(server), timeout_s, f"{Path(binary).name} on port {port}")
    except (AssertionError, TopologyUnavailableError) as exc:
        err = ""
        if process.stderr is not None and not server.alive:
            err = process.stderr.read().decode(errors="replace")
        tail = server.log_tail()
        server.stop()
        raise TopologyUnavailableError(
            f"{binary} {' '.join(args[:4])}... did not start: {exc}; {err.strip()} {tail}"
        ) from exc
    return server


def _pings(server: ServerProcess) -> bool:
    if not server.alive:
        raise TopologyUnavailableError(f"exited with status {server.process.returncode}")
    return pings(server.port)


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll a condition until it holds; AssertionError at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(POLL_S)


def _sweep() -> None:
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.kill()
            server.stop()


atexit.register(_sweep)


class _Topology:
    """Shared start/stop plumbing: a temp root, the processes, context management."""

    def __init__(self, binary: str | None = None) -> None:
        self.binary = binary or ""
        self.processes: list[ServerProcess] = []
        self._root: Path | None = None

    def _begin(self) -> Path:
        self.binary = self.binary or find_server_binary()
        self._root = Path(tempfile.mkdtemp(prefix="coordinator-topology-"))
        return self._root

    def stop(self) -> None:
        """Kill every process and remove every directory."""
        for server in self.processes:
            server.stop()
        self.processes.clear()
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _info(client: redis.Redis, section: str) -> dict[str, Any]:
    return dict(client.info(section))


class LocalRedisCluster(_Topology):
    """N primaries, slots split evenly; `url` is a redis+cluster:// URL. Replicas are
    added one by one (add_replica) and promoted (take_over, fail_over); a slot moves
    between primaries as resharding moves it (begin_migration, move_keys,
    end_migration)."""

    def __init__(
        self,
        primaries: int = 3,
        *,
        binary: str | None = None,
        node_timeout_ms: int = 1000,
        full_coverage: bool = False,
    ) -> None:
        super().__init__(binary)
        if primaries < 1:
            raise ValueError("a cluster needs at least one primary")
        self.size = primaries
        self.node_timeout_ms = node_timeout_ms
        # Off by default: with many pools spread over shards, losing one shard should
        # stop only that shard's pools, not the whole cluster (see docs/scaling.md).
        self.full_coverage = full_coverage
        self.ranges: list[tuple[int, int]] = []
        self.bus_ports: list[int] = []
        self.replicas: list[ServerProcess] = []
        self.replaced: list[ServerProcess] = []  # primaries a replica took over from
        self.moved: dict[int, ServerProcess] = {}  # slots migrated away from their range

    @property
    def primaries(self) -> list[ServerProcess]:
        """The primaries, in slot-range order."""
        return self.processes

    @property
    def url(self) -> str:
        """The coordinator URL naming every primary."""
        hosts = ",".join(f"127.0.0.1:{p.port}" for p in self.processes)
        return f"redis+cluster://{hosts}"

    def _node_args(self, bus_port: int) -> list[str]:
        return [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-port",
            str(bus_port),
            "--cluster-node-timeout",
            str(self.node_timeout_ms),
            "--cluster-require-full-coverage",
            "yes" if self.full_coverage else "no",
            *EPHEMERAL_ARGS,
        ]

    def start(self, timeout_s: float = SETUP_TIMEOUT_S) -> LocalRedisCluster:
        """Start the primaries, assign slots, join them, wait for cluster_state:ok."""
        root = self._begin()
        try:
            step = CLUSTER_SLOTS // self.size
            for i in range(self.size):
                bus = free_port()
                self.bus_ports.append(bus)
                server = spawn(self.binary, root / f"node{i}", self._node_args(bus))
                self.processes.append(server)
                first, last = (
                    i * step,
                    (CLUSTER_SLOTS - 1 if i == self.size - 1 else (i + 1) * step - 1),
                )
                self.ranges.append((first, last))
                with server.client() as client:
                    try:
                        client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
                    except redis.ResponseError as exc:
                        raise TopologyUnavailableError(
                            f"{self.binary} has no cluster mode: {exc}"
                        ) from exc
            with self.processes[0].client() as client:
                for server, bus in zip(self.processes[1:], self.bus_ports[1:], strict=True):
                    client.execute_command("CLUSTER", "MEET", "127.0.0.1", server.port, bus)
            wait_until(self.converged, timeout_s, "cluster_state:ok on every primary")
        except BaseException:
            self.stop()
            raise
        return self

    def converged(self) -> bool:
        """Every live primary knows every other one and reports cluster_state:ok."""
        for server in self.processes:
            if not server.alive:
                continue
            with server.client() as client:
                info = client.execute_command("CLUSTER", "INFO")
            text = info if isinstance(info, str) else info.decode()
            fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
            if fields.get("cluster_state") != "ok":
                return False
            met = self.size + len(self.replicas) + len(self.replaced)
            if int(fields.get("cluster_known_nodes", 0)) != met:
                return False
        return True

    def add_replica(
        self, primary: ServerProcess, timeout_s: float = SETUP_TIMEOUT_S
    ) -> ServerProcess:
        """Start a replica of `primary`; returns once its replication link is up."""
        assert self._root is not None, "start() the cluster first"
        bus = free_port()
        name = f"replica-{bus}"  # unique: replicas come and go (promoted, replaced)
        replica = spawn(self.binary, self._root / name, self._node_args(bus))
        self.replicas.append(replica)
        with primary.client() as client:
            primary_id = client.execute_command("CLUSTER", "MYID")
            client.execute_command("CLUSTER", "MEET", "127.0.0.1", replica.port, bus)

        def knows_primary() -> bool:
            with replica.client() as client:
                return primary_id in str(client.execute_command("CLUSTER", "NODES"))

        wait_until(knows_primary, timeout_s, f"{name} to learn the cluster")
        with replica.client() as client:
            client.execute_command("CLUSTER", "REPLICATE", primary_id)

        def linked() -> bool:
            with replica.client() as client:
                return _info(client, "replication").get("master_link_status") == "up"

        wait_until(linked, timeout_s, f"{name}'s replication link")
        wait_until(self.converged, timeout_s, "every node to know the replica")
        return replica

    def take_over(self, replica: ServerProcess, timeout_s: float = SETUP_TIMEOUT_S) -> None:
        """Make `replica` the primary of its primary's slots now, whatever state that
        primary is in (CLUSTER FAILOVER TAKEOVER: no agreement, no catch-up), as a
        failover after a crash does; it then stands for that primary in `primaries`."""
        self._promote(replica, "TAKEOVER", timeout_s)

    def fail_over(self, replica: ServerProcess, timeout_s: float = SETUP_TIMEOUT_S) -> None:
        """Switch `replica` and its live primary (CLUSTER FAILOVER: the replica catches
        up first, nothing is lost), as an operator's planned failover does; the old
        primary stays as its replica."""
        self._promote(replica, None, timeout_s)

    def _promote(self, replica: ServerProcess, how: str | None, timeout_s: float) -> None:
        with replica.client() as client:
            client.execute_command("CLUSTER", "FAILOVER", *([how] if how else []))

        def promoted() -> bool:
            with replica.client() as client:
                return _info(client, "replication").get("role") == "master"

        wait_until(promoted, timeout_s, "the replica to take over")
        with replica.client() as client:
            slots = client.execute_command("CLUSTER", "SLOTS")
        # CLUSTER SLOTS rows: [first, last, [host, port, id] of the primary, replicas...]
        own = {int(row[0]) for row in slots if int(row[2][1]) == replica.port}
        index = next(i for i, (first, _) in enumerate(self.ranges) if first in own)
        old = self.processes[index]
        self.processes[index] = replica
        self.replicas.remove(replica)
        if how is None and old.alive:  # a planned switch: the old primary replicates now
            self.replicas.append(old)
        else:
            self.replaced.append(old)
        wait_until(self.converged, timeout_s, "cluster_state:ok after the take-over")

    def owner_of(self, key: str) -> ServerProcess:
        """The primary that holds `key`'s slot."""
        return self.slot_owner(key_slot(key.encode()))

    def slot_owner(self, slot: int) -> ServerProcess:
        """The primary that holds `slot`: its range's, unless the slot migrated away."""
        if slot in self.moved:
            return self.moved[slot]
        for server, (first, last) in zip(self.processes, self.ranges, strict=True):
            if first <= slot <= last:
                return server
        raise AssertionError(f"slot {slot} is not assigned")

    def begin_migration(self, slot: int, target: ServerProcess) -> ServerProcess:
        """Start moving `slot` to the primary `target`, as resharding does: its owner
        MIGRATING, the target IMPORTING; keys then move with move_keys, and
        end_migration gives the slot away. Returns the owner."""
        source = self.slot_owner(slot)
        with source.client() as client:
            source_id = client.execute_command("CLUSTER", "MYID")
        with target.client() as client:
            target_id = client.execute_command("CLUSTER", "MYID")
            client.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        with source.client() as client:
            client.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        return source

    def move_keys(self, source: ServerProcess, target: ServerProcess, keys: list[str]) -> None:
        """MIGRATE these keys of a migrating slot from `source` to `target`."""
        if keys:
            with source.client() as client:
                client.execute_command(
                    "MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys
                )

    def end_migration(self, slot: int, source: ServerProcess, target: ServerProcess) -> None:
        """Move the slot's remaining keys, then give the slot to `target` on every primary."""
        with source.client() as client:
            rest = client.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100_000)
        self.move_keys(source, target, list(rest))
        with target.client() as client:
            target_id = client.execute_command("CLUSTER", "MYID")
        for primary in self.processes:
            with primary.client() as client:
                client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        self.moved[slot] = target

    def stop(self) -> None:
        """Kill every process (replicas and replaced primaries too), remove every directory."""
        for server in (*self.replicas, *self.replaced):
            server.stop()
        self.replicas.clear()
        self.replaced.clear()
        super().stop()

    def restart(self, server: ServerProcess, timeout_s: float = SETUP_TIMEOUT_S) -> ServerProcess:
        """Start a killed primary again on its port, from its nodes.conf (data is gone)."""
        index = self.processes.index(server)
        server.stop()
        again = spawn(
            self.binary,
            server.workdir,
            self._node_args(self.bus_ports[index]),
            port=server.port,
        )
        self.processes[index] = again
        wait_until(self.converged, timeout_s, "cluster_state:ok after the restart")
        return again


class LocalSentinel(_Topology):
    """One master, `replicas` replicas and `sentinels` sentinels watching `master_name`."""

    def __init__(
        self,
        *,
        binary: str | None = None,
        replicas: int = 1,
        sentinels: int = 3,
        quorum: int = 2,
        master_name: str = "mymaster",
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 3000,
        replica_args: tuple[str, ...] = (),
    ) -> None:
        super().__init__(binary)
        self.replica_count = replicas
        self.sentinel_count = sentinels
        self.quorum = quorum
        self.master_name = master_name
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.replica_args = list(replica_args)
        self.master: ServerProcess | None = None
        self.replicas: list[ServerProcess] = []
        self.sentinels: list[ServerProcess] = []

    @property
    def url(self) -> str:
        """The coordinator URL naming every sentinel and the master name."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.master_name}"

    def _data_args(self) -> list[str]:
        # No diskless-sync delay: the default waits 5 s for more replicas to join.
        return [*EPHEMERAL_ARGS, "--repl-diskless-sync-delay", "0"]

    def start(self, timeout_s: float = SETUP_TIMEOUT_S) -> LocalSentinel:
        """Start master, replicas and sentinels; wait until every sentinel sees them all."""
        root = self._begin()
        try:
            self.master = spawn(self.binary, root / "master", self._data_args())
            self.processes.append(self.master)
            for i in range(self.replica_count):
                args = [
                    *self._data_args(),
                    "--replicaof",
                    "127.0.0.1",
                    str(self.master.port),
                    *self.replica_args,
                ]
                replica = spawn(self.binary, root / f"replica{i}", args)
                self.processes.append(replica)
                self.replicas.append(replica)
            wait_until(self._replicas_linked, timeout_s, "replicas in sync with the master")
            for i in range(self.sentinel_count):
                self._start_sentinel(root / f"sentinel{i}")
            wait_until(self._sentinels_ready, timeout_s, "sentinels seeing replicas and peers")
        except BaseException:
            self.stop()
            raise
        return self

    def _start_sentinel(self, workdir: Path) -> None:
        assert self.master is not None
        workdir.mkdir(parents=True, exist_ok=True)
        conf = workdir / "sentinel.conf"
        name = self.master_name
        conf.write_text(
            f"sentinel monitor {name} 127.0.0.1 {self.master.port} {self.quorum}\n"
            f"sentinel down-after-milliseconds {name} {self.down_after_ms}\n"
            f"sentinel failover-timeout {name} {self.failover_timeout_ms}\n"
            f"sentinel parallel-syncs {name} 1\n"
        )
        sentinel = spawn(self.binary, workdir, ["--sentinel"], config_file=conf)
        self.processes.append(sentinel)
        self.sentinels.append(sentinel)
        with sentinel.client() as client:
            try:
                client.execute_command("SENTINEL", "MASTER", name)
            except redis.ResponseError as exc:
                raise TopologyUnavailableError(
                    f"{self.binary} has no sentinel mode: {exc}"
                ) from exc

    def _replicas_linked(self) -> bool:
        for replica in self.replicas:
            with replica.client() as client:
                if _info(client, "replication").get("master_link_status") != "up":
                    return False
        return True

    def _sentinels_ready(self) -> bool:
        for sentinel in self.sentinels:
            with sentinel.client() as client:
                state = client.sentinel_master(self.master_name)
            if int(state.get("num-slaves", 0)) < self.replica_count:
                return False
            if int(state.get("num-other-sentinels", 0)) < self.sentinel_count - 1:
                return False
        return True

    def all_name_master(self, port: int) -> bool:
        """Whether every live sentinel names the server on `port` as a master it sees
        up, as a client asking any one of them would be told."""
        for sentinel in self.sentinels:
            if not sentinel.alive:
                continue
            try:
                with sentinel.client(0.5) as client:
                    state = client.sentinel_master(self.master_name)
            except redis.RedisError:
                return False
            if int(state.get("port", 0)) != port or state.get("is_master") is not True:
                return False
            if state.get("is_sdown") or state.get("is_odown"):
                return False
        return True

    def master_port(self) -> int | None:
        """The master's port as the first answering sentinel reports it."""
        for sentinel in self.sentinels:
            if not sentinel.alive:
                continue
            try:
                with sentinel.client(0.5) as client:
                    addr = client.sentinel_get_master_addr_by_name(self.master_name)
            except redis.RedisError:
                continue
            if addr:
                return int(addr[1])
        return None

    def isolate_replicas(self) -> None:
        """Stop replication at this point: writes from now on reach the master only.

        The replicas are paused first so they cannot reconnect and catch up, then the
        master drops their links. A later crash_master() then loses exactly the writes
        made in between, as an asynchronous replica lagging behind a crashed master does.
        """
        assert self.master is not None
        for replica in self.replicas:
            replica.pause()
        with self.master.client() as client:
            client.execute_command("CLIENT", "KILL", "TYPE", "replica")

    def crash_master(self) -> float:
        """SIGKILL the master, resume paused replicas; returns the kill's monotonic time."""
        assert self.master is not None
        self.master.kill()
        killed_at = time.monotonic()
        for replica in self.replicas:
            replica.resume()
        return killed_at

    def by_port(self, port: int) -> ServerProcess:
        """The data server (master or replica) listening on `port`."""
        for server in (self.master, *self.replicas):
            if server is not None and server.port == port:
                return server
        raise KeyError(port)

    def role(self, server: ServerProcess) -> str:
        """`master` or `slave`, as the server itself reports it."""
        with server.client(0.5) as client:
            return str(_info(client, "replication").get("role"))


@dataclass
class PoolPlacement:
    """Pool names chosen so that their slots land on different primaries."""

    pools: list[str] = field(default_factory=list)
    owners: dict[str, int] = field(default_factory=dict)  # pool -> primary port


def place_pools(
    cluster: LocalRedisCluster, count: int, prefix: str, key_prefix: str = "lc"
) -> PoolPlacement:
    """`count` pool names spread round-robin over the primaries (by hash slot)."""
    placement = PoolPlacement()
    wanted = [cluster.primaries[i % cluster.size].port for i in range(count)]
    n = 0
    for port in wanted:
        while True:
            n += 1
            if n > 100_000:
                raise AssertionError("could not place pools on distinct primaries")
            pool = f"{prefix}{n}"
            if cluster.owner_of(f"{key_prefix}:{{{pool}}}:meta").port == port:
                placement.pools.append(pool)
                placement.owners[pool] = port
                break
    return placement
