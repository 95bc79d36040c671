"""The local cluster as real processes: Redis, 3 nodes, 4 mock engines (issue 4)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
from redis import Redis

from local_fleet.cluster import LocalCluster, free_port_block
from tests.helpers import COUNTER_COLUMNS, decode_counters

pytestmark = [pytest.mark.slow, pytest.mark.real]


@pytest.fixture
def cluster(redis_url: str) -> Iterator[LocalCluster]:
    """A running cluster on the session's real server (its own pool), stopped after."""
    pool = f"c{random.randrange(10**9)}"
    running = LocalCluster(
        nodes=3,
        engines=4,
        base_port=free_port_block(3, 4),
        redis_url=redis_url,
        speed=20.0,
        pool=pool,
    ).start()
    try:
        yield running
    finally:
        running.stop()
        client = Redis.from_url(redis_url)
        for key in client.scan_iter(match=f"lc:{{{pool}}}:*"):
            client.delete(key)
        client.close()


async def _stream(session: aiohttp.ClientSession, url: str, i: int) -> tuple[int, str, int]:
    body = {
        "model": "mock",
        "messages": [{"role": "user", "content": "tell me something " * (i % 20 + 1)}],
        "max_tokens": 8 + i % 24,
        "stream": True,
    }
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        chunks = [line async for line in response.content if line.startswith(b"data:")]
        return response.status, response.headers.get("X-Instance-Id", ""), len(chunks)


async def test_burst_through_every_node_then_counters_are_zero(cluster: LocalCluster) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        results = await asyncio.gather(
            *(_stream(session, cluster.node_urls[i % 3], i) for i in range(60))
        )
    assert [status for status, _, _ in results] == [200] * 60
    assert all(chunks >= 2 for _, _, chunks in results)
    assert {instance for _, instance, _ in results} == {f"engine-{j}" for j in range(4)}
    assert cluster.redis_url is not None
    client = Redis.from_url(cluster.redis_url, decode_responses=True)
    stem = f"lc:{{{cluster.pool}}}"
    try:
        deadline = time.monotonic() + 10
        while True:
            counters = decode_counters(
                client.hgetall(f"{stem}:slot"), client.get(f"{stem}:state") or ""
            )
            if all(v == 0 for name in COUNTER_COLUMNS for v in counters[name].values()):
                break
            assert time.monotonic() < deadline, counters
            await asyncio.sleep(0.05)
        assert client.hlen(f"{stem}:reservations") == 0
        assert len(counters["inflight"]) == 4
    finally:
        client.close()


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_cluster_command_leaves_nothing_behind_after_sigterm(tmp_path: Path) -> None:
    base = free_port_block(2, 2)
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "coordinator_cli.main",
            "cluster",
            "--nodes",
            "2",
            "--engines",
            "2",
            "--base-port",
            str(base),
            "--speed",
            "10",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = []
        deadline = time.monotonic() + 60
        for line in proc.stdout:
            lines.append(line)
            if "cluster is up" in line or time.monotonic() > deadline:
                break
        assert any("cluster is up" in line for line in lines), "".join(lines)
        assert any("redis-cli" in line for line in lines)
        # The private server is named: its binary's path and version.
        server = next(line for line in lines if line.startswith("redis "))
        assert "(private: /" in server and "-server, " in server and " v=" in server, server
        children = _children(proc.pid)
        assert len(children) == 5  # redis + 2 nodes + 2 engines
        # The server runs inside its temporary directory (--dir): its cwd is that directory.
        redis_dirs = [
            Path(os.readlink(f"/proc/{pid}/cwd"))
            for pid in children
            if b"-server" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        assert len(redis_dirs) == 1 and redis_dirs[0].name.startswith("coordinator-redis-")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    assert "stopped." in out
    assert [pid for pid in children if _alive(pid)] == []
    assert not redis_dirs[0].exists()


def test_demo_runs_prints_its_table_and_leaves_no_key(redis_url: str) -> None:
    # Against a Redis of the user's (REDIS_URL), as the README offers.
    env = {**os.environ, "REDIS_URL": redis_url}
    client = Redis.from_url(redis_url)
    other = "lc:{demo2}:meta"  # another pool's key: the demo must not touch it
    client.set(other, "x")
    base = free_port_block(3, 4)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "coordinator_cli.main",
            "demo",
            "--duration",
            "5",
            "--base-port",
            str(base),
            "--speed",
            "4",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Per-instance results" in out.stdout
    assert "TTFT p50" in out.stdout and "ALL" in out.stdout
    assert "least_load pressure over time" in out.stdout
    assert " 0 failed" in out.stdout
    # The closing hint says where to look, with the Redis URL, and why the pool is empty.
    assert f"coordinator inspect --redis-url {redis_url} --pool demo" in out.stdout
    assert "keys were deleted" in out.stdout
    try:
        assert list(client.scan_iter(match="lc:{demo}:*")) == []
        assert client.get(other) == b"x"
    finally:
        client.delete(other)
        client.close()


def _pid_of(parent: int, *words: bytes) -> int:
    """The child of `parent` whose command line has all these words."""
    return next(
        pid
        for pid in _children(parent)
        if all(w in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for w in words)
    )


def _until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_killed_node_or_engine_is_reported_and_the_rest_serve_on() -> None:
    """kill -9 of one node: the cluster serves on, and the engines registered through
    it stay alive (they heartbeat through the other node) for many times their TTL.
    Then an engine, reported; then the last node: nothing serves, exit 1."""
    base = free_port_block(2, 2)
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    ttl_ms = 1500  # heartbeats every 300 ms: a missed one shows within seconds
    env.update(COORD_INSTANCE_TTL_MS=str(ttl_ms), COORD_HEARTBEAT_INTERVAL_MS="300")
    argv = ["cluster", "--nodes", "2", "--engines", "2", "--base-port", str(base)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "coordinator_cli.main", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    said: list[str] = []
    try:
        assert proc.stdout is not None and proc.stderr is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "cluster is up" in line:
                break
        assert any("cluster is up" in line for line in lines), "".join(lines)
        errors = proc.stderr
        reader = threading.Thread(target=lambda: said.extend(errors), daemon=True)
        reader.start()
        instances = f"http://127.0.0.1:{base + 1}/v1/instances"  # node-0's control plane

        def alive() -> set[str]:
            with urllib.request.urlopen(instances, timeout=5) as response:
                return {row["id"] for row in json.load(response)["instances"] if row["alive"]}

        assert alive() == {"engine-0", "engine-1"}
        os.kill(_pid_of(proc.pid, b"proxy_node", b"node-1"), signal.SIGKILL)
        _until(lambda: any("node-1 exited with code -9" in line for line in said), "the report")
        # engine-1 registered through node-1: it must not lapse. Watched for 4 TTLs.
        watch_until = time.monotonic() + 4 * ttl_ms / 1000
        while time.monotonic() < watch_until:
            assert alive() == {"engine-0", "engine-1"}
            time.sleep(0.1)
        assert proc.poll() is None
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        request = urllib.request.Request(
            f"http://127.0.0.1:{base}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200
        os.kill(_pid_of(proc.pid, b"local_fleet.mock_engine", b"engine-0"), signal.SIGKILL)
        _until(lambda: any("engine-0 exited with code -9" in line for line in said), "report")
        _until(lambda: alive() == {"engine-1"}, "engine-0 no longer alive")
        assert proc.poll() is None
        os.kill(_pid_of(proc.pid, b"proxy_node", b"node-0"), signal.SIGKILL)
        proc.wait(timeout=30)
        out = proc.stdout.read()
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    assert proc.returncode == 1, said
    assert any("node-0 exited with code -9; no node is left" in line for line in said), said
    assert "stopped." in out
