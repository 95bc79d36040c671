"""Randomized multi-process fault stress (issue 13, "Tests to add").

Worker processes, each its own node with its own Coordinator (lease loop running),
interleave reserve / first token / release / double release from several tasks,
and keep a few reservations open to the end. Meanwhile the parent, driven by a
seeded random schedule, injects every fault class in turn: kill -9 of a worker
(restarted under its old id or a new one, or not at all), SIGSTOP beyond the lease,
SCRIPT FLUSH, FLUSHDB, a Redis restart (empty), an OOM window (`maxmemory` +
`noeviction`), lost replies (the workers reach Redis through
tests/faults/fault_proxy.py, which then executes their calls but drops the replies),
and one pool key deleted (eviction, or a hand edit). It samples the pool throughout:
every sample, one MULTI/EXEC, must satisfy the invariants below, except between a
key's loss and the audit's rebuild of the pool (lua/renew_lease.lua), which must
come within a few audit periods.

At the end the workers stop issuing requests and report the reservations they
still hold, once they are back to `coordination=ok`. Then, in one MULTI/EXEC:
- every counter, `pending_prefill_ms` and the per-instance index equal what the
  reservation records imply;
- every reservation belongs to a node with a live lease (a dead node's are reaped
  within about one lease);
- the records are exactly the reservations the live workers hold: nothing leaked,
  nothing lost.
Finally the workers release everything, and the pool must drain to zero.

Seeds: COORD_STRESS_SEEDS="0-9" (or "3,7") picks them; the default keeps CI short.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from coordinator import Coordinator, InstanceSpec, Settings
from coordinator.invariants import lex_member
from coordinator.keys import PoolKeys
from local_fleet.embedded import ServerUnavailableError
from tests.faults.conftest import RedisServer, _die_with_parent
from tests.faults.fault_proxy import FaultProxy
from tests.helpers import decode_counters, spec

pytestmark = [pytest.mark.slow, pytest.mark.real, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
POOL = "stress"
LEASE_MS = 600
WORKERS = 3
CLIENTS = 6  # concurrent request loops per worker
HOLD_MAX = 3  # reservations a worker keeps open until the end
INSTANCES = 4
COUNTERS = ("inflight", "pending_prefill", "active_decode")
WORKER_SETTINGS = Settings(
    lease_ms=LEASE_MS,
    redis_timeout_ms=200,
    recovery_interval_ms=50,
    instance_ttl_ms=600_000,  # engines never die here; only nodes and Redis do
    audit_interval_ms=200,
)
FAULTS = (
    "kill9",
    "sigstop",
    "script_flush",
    "flushdb",
    "restart_empty",
    "oom",
    "lost_replies",
    "lost_key",
)
# Keys whose loss breaks a relation the audit checks while reservations are live.
LOSABLE = ("reservations", "by_instance", "state", "meta")


def _seeds() -> list[int]:
    raw = os.environ.get("COORD_STRESS_SEEDS", "0-2")
    out: list[int] = []
    for part in raw.split(","):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


def _specs() -> list[InstanceSpec]:
    return [spec(i, prefill_ms_per_token=0.2, decode_ms_per_token=5.0) for i in range(INSTANCES)]


# ---------------------------------------------------------------------- worker


def worker_main(redis_url: str, node_id: str, seed: str, control: str) -> None:
    """Entry point of one worker process (see the module docstring)."""
    asyncio.run(_worker(redis_url, node_id, int(seed), Path(control)))


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


async def _until(predicate: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def _worker(redis_url: str, node_id: str, seed: int, control: Path) -> None:
    c = await Coordinator.connect(redis_url, pool=POOL, node_id=node_id, settings=WORKER_SETTINGS)
    for s in _specs():  # static instances, as with --instance on every node
        await c.register_instance(s)
    (control / f"{node_id}.ready").touch()
    rng = random.Random(seed)
    held: set[str] = set()
    errors: list[str] = []
    ops = {"reserve": 0, "first_token": 0, "release": 0, "release_noop": 0, "double_release": 0}

    async def client() -> None:
        while not (control / "stop").exists():
            try:
                res = await c.reserve(rng.randrange(10, 400), rng.randrange(1, 60))
                ops["reserve"] += 1
                await asyncio.sleep(rng.random() * 0.03)
                if rng.random() < 0.8:
                    await c.mark_first_token(res.rid)
                    ops["first_token"] += 1
                # Mostly short requests; some long streams outlive a fault and its
                # recovery, so what the re-assert restores is still live afterwards.
                await asyncio.sleep(rng.random() * (0.8 if rng.random() < 0.25 else 0.06))
                if len(held) < HOLD_MAX and rng.random() < 0.05:
                    held.add(res.rid)
                    continue
                # False is fine after a fault: reaped, flushed or lost with the pool.
                ops["release" if await c.release(res.rid) else "release_noop"] += 1
                if rng.random() < 0.1:
                    if await c.release(res.rid):
                        errors.append(f"second release of {res.rid} returned True")
                    ops["double_release"] += 1
            except Exception as exc:  # every error is a finding: report it
                errors.append(f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(0.01)

    await asyncio.gather(*(client() for _ in range(CLIENTS)))
    ok = await _until(lambda: c.coordination == "ok", 30)
    _write_json(
        control / f"{node_id}.held.json",
        {
            "node": node_id,
            "ok": ok,
            "held": sorted(c.local_reservations),
            "errors": errors,
            "ops": ops,
        },
    )
    await _until(lambda: (control / "release").exists(), 90)
    for rid in sorted(c.local_reservations):
        await c.release(rid)
    ok = await _until(lambda: c.coordination == "ok", 30)
    _write_json(
        control / f"{node_id}.done.json",
        {"node": node_id, "ok": ok, "left": sorted(c.local_reservations)},
    )
    await c.close()


# ---------------------------------------------------------------------- parent


@dataclass
class Worker:
    """One worker process under the parent's control."""

    node_id: str
    process: asyncio.subprocess.Process
    log: Path
    alive: bool = True


@dataclass
class Pool:
    """One atomic read of everything the invariants need."""

    counters: dict[str, dict[str, int]]
    pending_ms: dict[str, int]
    records: dict[str, dict[str, Any]]
    epochs: dict[str, int]
    index: list[str]
    leases: dict[str, int]
    now_ms: int
    voids: set[str]
    total: int  # meta's inflight_total

    def problems(self) -> list[str]:
        """Counters, pending_prefill_ms and the index against the records."""
        found: list[str] = []
        expected = {name: dict.fromkeys(self.epochs, 0) for name in COUNTERS}
        expected_ms = dict.fromkeys(self.epochs, 0)
        for rid, rec in self.records.items():
            iid = rec["instance"]
            if self.epochs.get(iid) != rec["epoch"]:
                if iid not in self.voids:  # void records wait for a bounded sweep
                    found.append(f"{rid} on {iid}: epoch {rec['epoch']} void, not queued")
                continue
            expected["inflight"][iid] += 1
            if rec["phase"] == "prefill":
                expected["pending_prefill"][iid] += 1
                expected_ms[iid] += int(rec["prefill_ms"])
            else:
                expected["active_decode"][iid] += 1
        for name in COUNTERS:
            if self.counters[name] != expected[name]:
                found.append(f"{name} {self.counters[name]} != records {expected[name]}")
        if self.pending_ms != expected_ms:
            found.append(f"pending_prefill_ms {self.pending_ms} != records {expected_ms}")
        if self.total != sum(self.counters["inflight"].values()):
            found.append(f"inflight_total {self.total} != counters {self.counters['inflight']}")
        index = sorted(
            lex_member(r["instance"], r["epoch"], r["end_at_ms"], rid)
            for rid, r in self.records.items()
        )
        if sorted(self.index) != index:
            found.append(f"by_instance {sorted(self.index)} != records {index}")
        return found

    def unleased(self) -> dict[str, str]:
        """Reservations whose node holds no live lease: rid -> node."""
        return {
            rid: rec["node"]
            for rid, rec in self.records.items()
            if self.leases.get(rec["node"], -1) < self.now_ms
        }


async def read_pool(client: Redis) -> Pool:
    """Read the pool in one MULTI/EXEC."""
    keys = PoolKeys("lc", POOL)
    pipe = client.pipeline(transaction=True)
    for name in ("slot", "reservations", "epoch"):
        pipe.hgetall(keys.column(name))
    pipe.getrange(keys.column("state"), 0, -1)
    pipe.zrange(keys.column("by_instance"), 0, -1)
    pipe.zrange(keys.column("nodes"), 0, -1, withscores=True)
    pipe.time()
    pipe.smembers(keys.column("voids"))
    pipe.hget(keys.column("meta"), "inflight_total")
    (
        slots,
        records,
        epochs,
        state,
        index,
        leases,
        (seconds, micros),
        voids,
        total,
    ) = await pipe.execute()
    decoded = decode_counters(slots, state)
    return Pool(
        counters={name: decoded[name] for name in COUNTERS},
        pending_ms=decoded["pending_prefill_ms"],
        records={rid: json.loads(raw) for rid, raw in records.items()},
        epochs={k: int(v) for k, v in epochs.items()},
        index=list(index),
        leases={str(n): int(score) for n, score in leases},
        now_ms=int(seconds) * 1000 + int(micros) // 1000,
        voids={str(v) for v in voids},
        total=int(total or 0),
    )


@dataclass
class Run:
    """The parent's side of one seed."""

    server: RedisServer
    proxy: FaultProxy
    control: Path
    rng: random.Random
    workers: dict[str, Worker] = field(default_factory=dict)
    count: int = 0
    violations: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    samples: int = 0
    damaged: bool = False  # a key is lost and the audit has not rebuilt the pool yet

    async def spawn(self, node_id: str | None = None) -> Worker:
        """Start a worker process (a new node id unless one is given)."""
        if node_id is None:
            node_id = f"w{self.count}"
            self.count += 1
        log = self.control / f"{node_id}.{time.monotonic_ns()}.log"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        with open(log, "wb") as out:  # noqa: ASYNC230 - a local file, opened once
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                "import sys; from tests.faults.test_fault_stress import worker_main; "
                "worker_main(*sys.argv[1:])",
                f"redis://127.0.0.1:{self.proxy.port}/0",
                node_id,
                str(self.rng.randrange(1 << 30)),
                str(self.control),
                cwd=str(ROOT),
                env=env,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
        worker = Worker(node_id, process, log)
        self.workers[node_id] = worker
        return worker

    def alive(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.alive]

    async def admin(self) -> Redis:
        return Redis.from_url(self.server.url, decode_responses=True, socket_timeout=5)

    async def sampler(self, stop: asyncio.Event) -> None:
        """Check the invariants on atomic samples for the whole run."""
        client = await self.admin()
        try:
            while not stop.is_set():
                try:
                    pool = await read_pool(client)
                except (RedisError, OSError):
                    await asyncio.sleep(0.05)  # Redis is down or restarting
                    continue
                if self.damaged:
                    await asyncio.sleep(0.03)
                    continue
                self.samples += 1
                self.violations += [f"sample {self.samples}: {p}" for p in pool.problems()]
                await asyncio.sleep(0.03)
        finally:
            await client.aclose()

    async def fault(self, kind: str) -> None:
        """Inject one fault, and undo it where it has an end."""
        lease_s = LEASE_MS / 1000
        self.faults.append(kind)
        if kind == "kill9":
            victim = self.rng.choice(self.alive())
            victim.process.kill()
            await victim.process.wait()
            victim.alive = False
            then = self.rng.choice(["same-id", "new-id", "none"])
            self.faults[-1] += f"({victim.node_id}, {then})"
            if then != "none":
                await self.spawn(victim.node_id if then == "same-id" else None)
        elif kind == "sigstop":
            victim = self.rng.choice(self.alive())
            self.faults[-1] += f"({victim.node_id})"
            os.kill(victim.process.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(lease_s * self.rng.uniform(1.5, 2.5))
            finally:
                os.kill(victim.process.pid, signal.SIGCONT)
        elif kind == "lost_replies":
            # A node makes one decision at a time, so one window loses at most one
            # reserve reply per node: several short windows.
            for _ in range(4):
                await self.proxy.set_mode("mute")
                try:
                    await asyncio.sleep(self.rng.uniform(0.25, 0.4))
                finally:
                    await self.proxy.set_mode("pass")
                await asyncio.sleep(self.rng.uniform(0.2, 0.3))
        elif kind == "lost_key":
            await self.lose_key()
        elif kind == "restart_empty":
            self.server.kill()
            await asyncio.sleep(self.rng.uniform(0.05, 0.3))
            await self.server.restart_empty()
        else:
            client = await self.admin()
            try:
                if kind == "script_flush":
                    await client.script_flush()
                elif kind == "flushdb":
                    await client.flushdb()
                elif kind == "oom":
                    await client.config_set("maxmemory-policy", "noeviction")
                    await client.config_set("maxmemory", "1")
                    try:
                        await asyncio.sleep(lease_s * self.rng.uniform(0.3, 2.0))
                    finally:
                        await client.config_set("maxmemory", "0")
            finally:
                await client.aclose()

    async def lose_key(self) -> None:
        """Delete one pool key; then the pool must be consistent again within a few
        audit periods (rebuilt by a reset, or undamaged: an empty key lost nothing)."""
        name = self.rng.choice(LOSABLE)
        self.faults[-1] += f"({name})"
        keys = PoolKeys("lc", POOL)
        client = await self.admin()
        try:
            reset_before = await client.hget(keys.column("meta"), "audit_reset_ms")
            self.damaged = True
            await client.delete(keys.column(name))
            deadline = time.monotonic() + 20 * WORKER_SETTINGS.audit_interval_ms / 1000 + 2
            while time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                try:
                    reset = await client.hget(keys.column("meta"), "audit_reset_ms")
                    if (
                        reset not in (None, reset_before)
                        or not (await read_pool(client)).problems()
                    ):
                        return
                except (RedisError, OSError):
                    continue
            self.violations.append(f"the pool was not rebuilt after losing {name}")
        finally:
            self.damaged = False
            await client.aclose()


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data


async def _wait_ready(paths: list[Path], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"workers never became ready: {paths}"
        await asyncio.sleep(0.05)


async def _wait_files(paths: list[Path], timeout_s: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = [_read(p) for p in paths]
        if all(f is not None for f in found):
            return [f for f in found if f is not None]
        assert time.monotonic() < deadline, f"workers never reported: {paths}"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("seed", _seeds())
async def test_random_faults_leave_exact_counters(seed: int, tmp_path: Path) -> None:
    try:
        server = RedisServer().start()
    except ServerUnavailableError as exc:
        pytest.skip(f"no Redis-compatible server: {exc}")
    proxy = await FaultProxy("127.0.0.1", server.port).start()
    run = Run(server, proxy, tmp_path, random.Random(seed))
    stop_sampling = asyncio.Event()
    sampler: asyncio.Task[None] | None = None
    try:
        for _ in range(WORKERS):
            await run.spawn()
        await _wait_ready([tmp_path / f"{w.node_id}.ready" for w in run.alive()], 60)
        sampler = asyncio.create_task(run.sampler(stop_sampling))
        schedule = list(FAULTS)
        run.rng.shuffle(schedule)
        for kind in schedule:
            await asyncio.sleep(run.rng.uniform(0.1, 0.4))
            await run.fault(kind)
        await asyncio.sleep(run.rng.uniform(0.1, 0.3))
        (tmp_path / "stop").touch()

        alive = run.alive()
        reports = await _wait_files([tmp_path / f"{w.node_id}.held.json" for w in alive], 60)
        context = f"seed {seed}, faults {run.faults}"
        for report in reports:
            assert report["ok"], f"{report['node']} never recovered ({context})"
            assert report["errors"] == [], f"{report['node']}: {report['errors'][:5]} ({context})"
        assert sum(r["ops"]["reserve"] for r in reports) > 0, reports
        held = {rid for report in reports for rid in report["held"]}
        admin = await run.admin()
        try:
            # A dead worker's reservations go within about one lease (plus a renewal
            # period for some live node to notice); the live ones' are all there.
            deadline = time.monotonic() + 3 * LEASE_MS / 1000 + 2
            while True:
                pool = await read_pool(admin)
                settled = not pool.problems() and not pool.unleased() and set(pool.records) == held
                if settled or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            pool = await read_pool(admin)  # the final check: one MULTI/EXEC
            assert pool.problems() == [], context
            assert pool.unleased() == {}, f"reservations without a lease ({context})"
            assert set(pool.records) == held, (
                f"missing {sorted(held - set(pool.records))}, "
                f"leaked {sorted(set(pool.records) - held)} ({context})"
            )
            assert {rec["node"] for rec in pool.records.values()} <= {w.node_id for w in alive}

            (tmp_path / "release").touch()
            done = await _wait_files([tmp_path / f"{w.node_id}.done.json" for w in alive], 60)
            assert all(d["ok"] and d["left"] == [] for d in done), done
            for w in alive:
                assert await asyncio.wait_for(w.process.wait(), 30) == 0, w.log.read_text()[-3000:]
            pool = await read_pool(admin)
            assert pool.records == {} and pool.problems() == [], context
            assert all(v == 0 for column in pool.counters.values() for v in column.values())
            assert all(v == 0 for v in pool.pending_ms.values())
        finally:
            await admin.aclose()
        stop_sampling.set()
        await sampler
        assert run.violations == [], run.violations[:5]
        assert run.samples > 0
    finally:
        stop_sampling.set()
        if sampler is not None and not sampler.done():
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        for w in run.workers.values():
            if w.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.process.pid, signal.SIGCONT)
                    w.process.kill()
                await w.process.wait()
        await proxy.close()
        server.stop()
