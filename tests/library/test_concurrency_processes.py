"""Exact counters under real concurrency: several OS processes, one pool, one real server.

Each process is its own node (own Coordinator, own connection pool) and runs
reserve -> mark_first_token -> release cycles in concurrent batches. The parent
samples the pool while they run: reads in MULTI/EXEC are atomic with respect to the
scripts, so every sample must satisfy the §6 invariant exactly, not just at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from coordinator import Coordinator, Settings
from coordinator.keys import PoolKeys
from tests.helpers import (
    COUNTER_COLUMNS,
    assert_counters_match_reservations,
    decode_counters,
    spec,
)

PROCESSES = 4
CYCLES = 500  # per process
BATCH = 10  # concurrent cycles inside one process
INSTANCES = 8
ROOT = Path(__file__).resolve().parents[2]
# Instances must stay alive for the whole run, however slow the machine is.
WORKER_SETTINGS = Settings(instance_ttl_ms=600_000, redis_timeout_ms=5_000, lease_ms=60_000)


def worker_main(redis_url: str, pool: str, node_id: str) -> None:
    """Entry point of one worker process; prints a JSON summary on its last line."""
    print(json.dumps(asyncio.run(_worker(redis_url, pool, node_id))), flush=True)


async def _worker(redis_url: str, pool: str, node_id: str) -> dict[str, Any]:
    c = await Coordinator.connect(redis_url, pool=pool, node_id=node_id, settings=WORKER_SETTINGS)
    ready = c.keys.column("test-ready")
    try:
        # Start together so the processes really overlap (bounded wait).
        await c.redis.incr(ready)
        deadline = time.monotonic() + 30
        while int(await c.redis.get(ready) or 0) < PROCESSES:
            if time.monotonic() > deadline:
                raise RuntimeError("the other workers never became ready")
            await asyncio.sleep(0.01)
        done = {"cycles": 0, "first_token_ok": 0, "released_ok": 0}
        instances: dict[str, int] = {}

        async def cycle(k: int) -> None:
            r = await c.reserve(50 + k % 200, 10 + k % 50)
            instances[r.instance_id] = instances.get(r.instance_id, 0) + 1
            if await c.mark_first_token(r.rid):
                done["first_token_ok"] += 1
            if await c.release(r.rid):
                done["released_ok"] += 1
            done["cycles"] += 1

        for start in range(0, CYCLES, BATCH):
            await asyncio.gather(*(cycle(k) for k in range(start, min(start + BATCH, CYCLES))))
        return {
            "node": node_id,
            **done,
            "instances": instances,
            "degraded_entries": c.stats.degraded_entries,
            "local_left": len(c.local_reservations),
        }
    finally:
        await c.close()


async def sample(client: Redis, keys: PoolKeys) -> dict[str, Any]:
    """Counters and reservation records read atomically (one MULTI/EXEC)."""
    pipe = client.pipeline(transaction=True)
    pipe.hgetall(keys.column("slot"))
    pipe.getrange(keys.column("state"), 0, -1)
    pipe.hgetall(keys.column("reservations"))
    slots, state, records = await pipe.execute()
    out: dict[str, Any] = decode_counters(slots, state)
    out["reservations"] = {rid: json.loads(raw) for rid, raw in records.items()}
    return out


def check_sample(s: dict[str, Any]) -> None:
    """Counters are never negative and equal the records in each phase, at every instant."""
    expected: dict[str, dict[str, int]] = {name: {} for name in COUNTER_COLUMNS}
    for rec in s["reservations"].values():
        iid = rec["instance"]
        expected["inflight"][iid] = expected["inflight"].get(iid, 0) + 1
        phase = "pending_prefill" if rec["phase"] == "prefill" else "active_decode"
        expected[phase][iid] = expected[phase].get(iid, 0) + 1
    for name in COUNTER_COLUMNS:
        assert all(v >= 0 for v in s[name].values()), (name, s[name])
        nonzero = {k: v for k, v in s[name].items() if v}
        assert nonzero == expected[name], (name, nonzero, expected[name])


@pytest.mark.slow
@pytest.mark.real
async def test_processes_hammering_one_pool_leave_exact_zero(
    redis_url: str, real_client: Redis, pool: str
) -> None:
    setup = Coordinator(real_client, pool=pool, node_id="setup", settings=WORKER_SETTINGS)
    for i in range(INSTANCES):
        await setup.register_instance(spec(i))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            "import sys; from tests.library.test_concurrency_processes import worker_main; "
            "worker_main(*sys.argv[1:])",
            redis_url,
            pool,
            f"proc-{k}",
            cwd=str(ROOT),
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        for k in range(PROCESSES)
    ]
    outputs = [asyncio.ensure_future(p.communicate()) for p in procs]
    samples = 0
    busy_samples = 0
    deadline = time.monotonic() + 100
    try:
        while not all(o.done() for o in outputs):
            assert time.monotonic() < deadline, "workers did not finish in time"
            s = await sample(real_client, setup.keys)
            check_sample(s)
            samples += 1
            busy_samples += bool(s["reservations"])
            await asyncio.sleep(0.05)
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
        results = await asyncio.gather(*outputs)
    summaries = []
    for p, (out, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err.decode()[-3000:]
        summaries.append(json.loads(out.decode().strip().splitlines()[-1]))

    for summary in summaries:
        assert summary["cycles"] == CYCLES, summary
        assert summary["first_token_ok"] == CYCLES, summary
        assert summary["released_ok"] == CYCLES, summary
        assert summary["degraded_entries"] == 0, summary
        assert summary["local_left"] == 0, summary
    per_instance: dict[str, int] = {}
    for summary in summaries:
        for iid, n in summary["instances"].items():
            per_instance[iid] = per_instance.get(iid, 0) + n
    assert sum(per_instance.values()) == PROCESSES * CYCLES
    assert set(per_instance) == {f"i{i}" for i in range(INSTANCES)}, per_instance
    # Sampling did happen while reservations were live, so the invariant was exercised.
    assert busy_samples >= 1, (samples, busy_samples)

    final = await sample(real_client, setup.keys)
    assert final["reservations"] == {}
    for name in (*COUNTER_COLUMNS, "pending_prefill_ms"):
        assert final[name] == {f"i{i}": 0 for i in range(INSTANCES)}, (name, final[name])
    assert await real_client.zcard(setup.keys.column("by_instance")) == 0
    for k in range(PROCESSES):
        assert await real_client.scard(setup.keys.node_rids(f"proc-{k}")) == 0
    await assert_counters_match_reservations(setup)
