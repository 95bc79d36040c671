"""The HTTP edge below the handlers: malformed requests, slow heads, connection floods.

aiohttp answers a request its parser refuses (a 64 KiB header, 200 headers, a bad
Content-Length, Content-Length with chunked, ...) with a plain-text 400 and logs an
ERROR with a traceback; it has no head-read timeout of its own besides the keep-alive
timer, and no cap on connections. `EdgeRunner` is an `AppRunner` whose connections:

- answer parser errors as JSON (proxy_node/errors.py shape) and log one line;
- are closed when a request head does not arrive within `header_timeout_s` (aiohttp's
  keep-alive timer, which runs from the accept and between requests, and which fires
  only while no complete head is buffered);
- are refused with a 503 once `max_connections` are open (nginx `worker_connections`,
  HAProxy `maxconn`), before the process runs out of file descriptors.

`AcceptErrorLog` rate-limits asyncio's `socket.accept() out of system resource`
message (logged on every failed accept when the process is out of descriptors) and
counts every occurrence for /metrics.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_server import Server

from proxy_node.errors import error_body, json_error

log = logging.getLogger(__name__)

ACCEPT_ERROR_MESSAGE = "socket.accept() out of system resource"  # asyncio's own wording
ACCEPT_ERROR_LOG_INTERVAL_S = 10.0  # at most one log line per interval
MIN_AUTO_CONNECTIONS = 64  # the automatic cap never goes below this


def auto_max_connections() -> int:
    """A quarter of the open-file limit: each proxied request also holds an engine socket."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return 16384
    return max(MIN_AUTO_CONNECTIONS, soft // 4)


def _refusal() -> bytes:
    body = json.dumps(
        error_body(503, "too many open connections; retry shortly", "too_many_connections")
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Retry-After: 1\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


REFUSAL = _refusal()


class EdgeRequestHandler(RequestHandler):
    """aiohttp's connection protocol with JSON parser errors and a connection cap."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Refuse the connection (503, close) when the server is at its cap."""
        server = self._manager
        if isinstance(server, EdgeServer) and not server.admit():
            self._manager = None  # connection_lost then does nothing
            if isinstance(transport, asyncio.WriteTransport):
                transport.write(REFUSAL)
            transport.close()
            return
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        """Free the connection's slot."""
        server = self._manager
        if isinstance(server, EdgeServer):
            server.release()
        super().connection_lost(exc)

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """A request the parser refused: one log line and a JSON error (500s keep aiohttp's)."""
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        detail = _parser_detail(exc, message)
        if isinstance(self._manager, EdgeServer):
            self._manager.on_malformed()
        log.warning("refused a malformed request from %s: %d %s", request.remote, status, detail)
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already sent; cannot send the error")
        return json_error(
            status, f"malformed HTTP request: {detail}", "malformed_request", closing=True
        )


def _parser_detail(exc: BaseException | None, message: str | None) -> str:
    text = getattr(exc, "message", None) or message or (type(exc).__name__ if exc else "")
    text = " ".join(str(text).split())  # the parser quotes the raw bytes across lines
    return text[:200]


class EdgeServer(Server):
    """aiohttp's Server making EdgeRequestHandlers, counting open connections."""

    def __init__(
        self,
        base: Server,
        max_connections: int,
        on_refused: Callable[[], None],
        on_malformed: Callable[[], None],
    ) -> None:
        super().__init__(
            base.request_handler,
            request_factory=base.request_factory,
            handler_cancellation=base.handler_cancellation,
            loop=base._loop,
            **base._kwargs,
        )
        self.max_connections = max_connections
        self.open_connections = 0
        self.on_refused = on_refused
        self.on_malformed = on_malformed

    def admit(self) -> bool:
        """Take a connection slot; False (and counted) when every slot is taken."""
        if self.open_connections >= self.max_connections:
            self.on_refused()
            return False
        self.open_connections += 1
        return True

    def release(self) -> None:
        """Give a slot back."""
        self.open_connections = max(0, self.open_connections - 1)

    def __call__(self) -> RequestHandler:
        """A protocol instance for one accepted connection."""
        return EdgeRequestHandler(self, loop=self._loop, **self._kwargs)


class EdgeRunner(web.AppRunner):
    """An AppRunner whose server is an EdgeServer (see the module docstring)."""

    def __init__(
        self,
        app: web.Application,
        *,
        max_connections: int,
        on_refused: Callable[[], None] = lambda: None,
        on_malformed: Callable[[], None] = lambda: None,
        **kwargs: Any,
    ) -> None:
        super().__init__(app, **kwargs)
        self._max_connections = max_connections
        self._on_refused = on_refused
        self._on_malformed = on_malformed

    async def _make_server(self) -> Server:
        base = await super()._make_server()
        return EdgeServer(base, self._max_connections, self._on_refused, self._on_malformed)


class AcceptErrorLog:
    """A loop exception handler that counts accept() failures and logs them rarely."""

    def __init__(
        self,
        count: Callable[[], None],
        interval_s: float = ACCEPT_ERROR_LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.count = count
        self.interval_s = interval_s
        self.clock = clock
        self.suppressed = 0
        self._last_log = -float("inf")

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """Handle one loop exception: ours are counted and rate-limited, others pass on."""
        if context.get("message") != ACCEPT_ERROR_MESSAGE:
            loop.default_exception_handler(context)
            return
        self.count()
        now = self.clock()
        if now - self._last_log < self.interval_s:
            self.suppressed += 1
            return
        log.error(
            "%s: %s (%d more since the last report; lower the connection cap "
            "--max-connections or raise the open-file limit)",
            ACCEPT_ERROR_MESSAGE,
            context.get("exception"),
            self.suppressed,
        )
        self.suppressed = 0
        self._last_log = now
