"""`cluster`, `demo` and `mock-engine` fail fast, with the cause in one line.

Each case is a real process on loopback; none needs the cluster to come up, so they
run in the default tier.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from local_fleet.cluster import free_port_block
from local_fleet.embedded import free_port

pytestmark = pytest.mark.timeout(60)

PROCESS_TIMEOUT_S = 40  # a bound on a hung process, far above a normal failure


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `coordinator ARGS` as a process; its output is captured."""
    environment = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    environment.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "coordinator_cli.main", *args],
        capture_output=True,
        text=True,
        env=environment,
        timeout=PROCESS_TIMEOUT_S,
        check=False,
    )


class _Squatter(BaseHTTPRequestHandler):
    """Another program on the ports: it answers every GET and POST with 200.

    It even claims alive instances, as a second cluster on the same ports would: a
    launcher that only polls URLs would take it for its own children.
    """

    status = 200

    def _answer(self) -> None:
        self.server.hits += 1  # type: ignore[attr-defined]  # counted before the client hears
        body = json.dumps({"instances": [{"id": f"x{i}", "alive": True} for i in range(8)]})
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    do_GET = _answer
    do_POST = _answer
    do_DELETE = _answer

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def squatting(
    ports: list[int], handler: type[BaseHTTPRequestHandler] = _Squatter
) -> Iterator[list[ThreadingHTTPServer]]:
    """HTTP servers holding `ports` on 127.0.0.1 for the duration of the block."""
    servers = []
    try:
        for port in ports:
            server = ThreadingHTTPServer(("127.0.0.1", port), handler)
            server.hits = 0  # type: ignore[attr-defined]
            servers.append(server)
            threading.Thread(target=server.serve_forever, daemon=True).start()
        yield servers
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def cluster_ports(base: int, nodes: int, engines: int) -> list[int]:
    """The ports `coordinator cluster --base-port base` binds."""
    return [base + i for i in range(2 * nodes)] + [base + 100 + j for j in range(engines)]


def test_cluster_on_taken_ports_fails_and_names_them() -> None:
    base = free_port_block(1, 1)
    with squatting(cluster_ports(base, 1, 1)):
        out = run_cli("cluster", "--nodes", "1", "--engines", "1", "--base-port", str(base))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "cluster is up" not in out.stdout
    assert f"already in use on 127.0.0.1: {base} (node-0)" in out.stderr, out.stderr
    assert f"{base + 100} (engine-0)" in out.stderr
    assert "--base-port" in out.stderr


def test_demo_on_a_taken_engine_port_fails_and_names_it() -> None:
    base = free_port_block(3, 4)
    with squatting([base + 103]):
        out = run_cli("demo", "--duration", "1", "--base-port", str(base))
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"port already in use on 127.0.0.1: {base + 103} (engine-3)" in out.stderr


def test_cluster_with_unreachable_redis_says_so() -> None:
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    base = free_port_block(1, 1)
    out = run_cli(
        "cluster", "--nodes", "1", "--engines", "1", "--base-port", str(base), "--redis-url", url
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Redis at redis://***@127.0.0.1:" in out.stderr and "does not answer" in out.stderr
    assert "Connect" in out.stderr or "refused" in out.stderr  # the cause itself
    assert "hunter2" not in out.stderr + out.stdout
    assert "engines registered" not in out.stderr


def test_demo_with_unreachable_redis_says_so() -> None:
    # Its own free ports: the default ones may be taken on this machine, which the
    # demo reports first.
    base = free_port_block(3, 4)
    out = run_cli(
        "demo",
        "--duration",
        "1",
        "--base-port",
        str(base),
        env={"REDIS_URL": f"redis://127.0.0.1:{free_port()}"},
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "does not answer" in out.stderr


def test_cluster_shows_the_nodes_own_error_line() -> None:
    base = free_port_block(1, 1)
    out = run_cli(
        "cluster", "--nodes", "1", "--engines", "1", "--base-port", str(base), "--pool", "a{b}"
    )
    assert out.returncode == 1, out.stdout + out.stderr
    # The launcher's words, then the node's own: which child, its code, its error.
    line = next(line for line in out.stderr.splitlines() if "failed to start" in line)
    assert "node-0 exited with code 2: " in line
    assert "pool 'a{b}' must match" in line
    assert "Traceback" not in out.stderr


def mock_engine(*args: str) -> subprocess.CompletedProcess[str]:
    """Run `python -m local_fleet.mock_engine ARGS` to its end."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOCK_ENGINE_")}
    return subprocess.run(
        [sys.executable, "-m", "local_fleet.mock_engine", "--log-level", "WARNING", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=PROCESS_TIMEOUT_S,
        check=False,
    )


def test_mock_engine_on_a_taken_port_prints_one_line() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        out = mock_engine("--port", str(port))
    assert out.returncode == 1
    assert out.stderr.splitlines() == [
        f"mock-engine: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]


@pytest.mark.parametrize("status", [401, 403])
def test_mock_engine_stops_when_its_registration_is_denied(status: int) -> None:
    class Denying(_Squatter):
        pass

    Denying.status = status
    control = free_port()
    with squatting([control], Denying) as (server,):
        out = mock_engine("--port", str(free_port()), "--register", f"http://127.0.0.1:{control}")
        hits = server.hits  # type: ignore[attr-defined]
    assert out.returncode == 1, out.stderr
    lines = [line for line in out.stderr.splitlines() if "mock-engine: error:" in line]
    assert len(lines) == 1, out.stderr
    assert f"registration with http://127.0.0.1:{control} failed" in lines[0]
    assert f"refused: {status}" in lines[0] and "bearer token" in lines[0]
    assert "Traceback" not in out.stderr
    assert hits == 1  # asked once: no retry loop
