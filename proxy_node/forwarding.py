"""The service plane's pass-through: reserve, forward, relay the stream, release.

One `Exchange` per client request. The reservation is released in `finally` on every
path: completion, engine error, connection failure, client disconnect, timeout.
aiohttp does not cancel a handler when its client goes away, so a watcher task polls
the client's transport and ends the exchange when it closes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from contextlib import suppress

import aiohttp
from aiohttp import web

from coordinator.errors import (
    InvalidArgumentError,
    NoInstanceError,
    PoolFullError,
)
from coordinator.keys import ID_RE
from coordinator.models import Reservation
from proxy_node.errors import json_error
from proxy_node.headers import copy_response_headers, request_headers
from proxy_node.intake import RequestRejectedError, parse_completion
from proxy_node.state import CONFIG, COORDINATOR, METRICS, SESSION, STATE
from proxy_node.usage import OutputCounter

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.2  # how soon a vanished client frees its reservation when idle
CONNECT_TIMEOUT_S = 5.0  # an unreachable engine fails fast enough to retry elsewhere
ERROR_DETAIL_BYTES = 512  # of an engine's 5xx body, quoted in the 502 message


class _ConnectFailedError(Exception):
    """The engine could not be reached; nothing was sent to it (safe to retry)."""


def endpoint_of(path: str) -> str:
    """The metrics label of a service-plane path."""
    return "chat" if path.endswith("/chat/completions") else "completions"


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions and /v1/completions: the OpenAI-compatible pass-through."""
    exchange = Exchange(request)
    try:
        return await exchange.run()
    except Exception:
        log.exception("request %s failed", exchange.rid)
        if exchange.response is not None:
            raise  # bytes went out: aiohttp closes the connection
        return exchange.fail(500, "internal error in the proxy node", "internal_error")
    finally:
        metrics = request.app[METRICS]
        metrics.requests.labels(endpoint_of(request.path), str(exchange.status)).inc()
        metrics.outcomes.labels(exchange.outcome).inc()


class Exchange:
    """One client request on its way through the node."""

    def __init__(self, request: web.Request) -> None:
        app = request.app
        self.request = request
        self.config = app[CONFIG]
        self.coordinator = app[COORDINATOR]
        self.session = app[SESSION]
        self.metrics = app[METRICS]
        self.state = app[STATE]
        self.loop = asyncio.get_running_loop()
        self.started = self.loop.time()
        client_rid = request.headers.get("X-Request-Id", "")
        self.rid = client_rid if ID_RE.match(client_rid) else uuid.uuid4().hex
        self.status = 500
        self.outcome = "error"
        self.body = b""
        self.stream = False
        self.prompt_tokens = 0
        self.expected_output_tokens = 0
        self.response: web.StreamResponse | None = None
        self._mark_handle: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ flow

    async def run(self) -> web.StreamResponse:
        """Validate, reserve, forward (retrying once on a refused connection), release."""
        rejected = await self._read_request()
        if rejected is not None:
            return rejected
        excluded: set[str] = set()
        failure = ""
        for attempt in range(2):
            reservation = await self._reserve(excluded)
            if isinstance(reservation, web.StreamResponse):
                return reservation
            try:
                return await self._attempt(reservation)
            except _ConnectFailedError as exc:
                failure = str(exc)
                excluded.add(reservation.instance_id)
                log.warning("cannot connect to %s: %s", reservation.instance_id, exc)
                if attempt == 0:
                    self.metrics.connect_retries.inc()
        return self._error(502, f"no instance could be reached: {failure}", "upstream_unreachable")

    def fail(self, status: int, message: str, code: str) -> web.Response:
        """Answer an error before any byte of a response went out."""
        return self._error(status, message, code)

    def _error(
        self,
        status: int,
        message: str,
        code: str,
        res: Reservation | None = None,
        extra: dict[str, str] | None = None,
    ) -> web.Response:
        self.status = status
        self.outcome = code
        headers = self._headers(res)
        headers.update(extra or {})
        return json_error(status, message, code, headers)

    def _headers(self, res: Reservation | None) -> dict[str, str]:
        if res is None:
            return {"X-Request-Id": self.rid}
        ttft = "" if res.predicted_ttft_ms is None else str(res.predicted_ttft_ms)
        return {
            "X-Instance-Id": res.instance_id,
            "X-Predicted-TTFT-Ms": ttft,
            "X-Request-Id": self.rid,
        }

    # ------------------------------------------------------------------ request

    async def _read_request(self) -> web.StreamResponse | None:
        """Read and check the body; an error response when it is unacceptable."""
        request = self.request
        limit = self.config.max_body_bytes
        too_large = f"request body is larger than {limit} bytes"
        if request.content_length is not None and request.content_length > limit:
            response = self._error(413, too_large, "body_too_large")
            response.force_close()  # the unread body must not be parsed as a request
            return response
        data = bytearray()
        try:
            # One deadline for the whole body: a client trickling bytes cannot hold the
            # handler longer than a stalled one.
            async with asyncio.timeout(self.config.body_timeout_s):
                async for chunk in request.content.iter_any():
                    data += chunk
                    if len(data) > limit:
                        response = self._error(413, too_large, "body_too_large")
                        response.force_close()
                        return response
        except ConnectionError:
            self.status, self.outcome = 499, "client_disconnect"
            return web.Response(status=499)
        except TimeoutError:
            response = self._error(
                408,
                f"request body not received within {self.config.body_timeout_s:g} s",
                "body_timeout",
            )
            response.force_close()
            return response
        except web.RequestPayloadError as exc:  # e.g. a body that fails its Content-Encoding
            response = self._error(400, f"unreadable request body: {_cause(exc)}", "invalid_body")
            response.force_close()
            return response
        self.body = bytes(data)
        try:
            parsed = parse_completion(
                self.body,
                request.headers.get("X-Prompt-Tokens"),
                self.state.expected_output_tokens(),
            )
        except RequestRejectedError as exc:
            return self._error(exc.status, exc.message, exc.code)
        self.prompt_tokens = parsed.prompt_tokens
        self.expected_output_tokens = parsed.expected_output_tokens
        self.stream = parsed.stream
        return None

    async def _reserve(self, excluded: set[str]) -> Reservation | web.StreamResponse:
        """Reserve an instance not in `excluded` (ones that refused a connection).

        Answers 503 (none alive besides the excluded), 429 (pool full) or 400.
        """
        started = time.perf_counter()
        try:
            return await self.coordinator.reserve(
                self.prompt_tokens, self.expected_output_tokens, rid=self.rid, exclude=excluded
            )
        except NoInstanceError as exc:
            if excluded:
                return self._error(
                    502,
                    "no other instance is available after a connection failure",
                    "upstream_unreachable",
                )
            return self._error(503, str(exc), "no_instance")
        except PoolFullError as exc:
            retry_after = max(1, math.ceil(exc.retry_after_ms / 1000))
            return self._error(429, str(exc), "pool_full", extra={"Retry-After": str(retry_after)})
        except InvalidArgumentError as exc:
            return self._error(400, str(exc), "invalid_request")
        finally:
            self.metrics.decisions.observe(time.perf_counter() - started)

    # ------------------------------------------------------------------ one attempt

    async def _attempt(self, res: Reservation) -> web.StreamResponse:
        """Forward to the reserved instance while watching the client; always release."""
        exchange = asyncio.create_task(self._forward(res))
        watcher = asyncio.create_task(_client_gone(self.request))
        try:
            await asyncio.wait((exchange, watcher), return_when=asyncio.FIRST_COMPLETED)
            if exchange.done():
                return exchange.result()
            self.status, self.outcome = 499, "client_disconnect"
            return self.response or web.Response(status=499)
        finally:
            for task in (watcher, exchange):
                task.cancel()
            await asyncio.wait((watcher, exchange))
            for task in (watcher, exchange):
                if not task.cancelled():
                    task.exception()  # retrieved: it was returned or raised above
            if self._mark_handle is not None:
                self._mark_handle.cancel()
                self._mark_handle = None
            await self._release(res.rid)

    async def _release(self, rid: str) -> None:
        # Shielded: a handler cancelled at shutdown must still give its reservation back.
        await asyncio.shield(self.state.spawn(self._release_now(rid)))

    async def _release_now(self, rid: str) -> None:
        try:
            await self.coordinator.release(rid)
        except Exception:
            log.exception("releasing %s failed", rid)

    async def _mark_first_token(self, rid: str) -> None:
        try:
            await self.coordinator.mark_first_token(rid)
        except Exception:
            log.exception("marking the first token of %s failed", rid)

    def _mark_at_predicted_time(self, rid: str) -> None:
        self._mark_handle = None
        self.state.spawn(self._mark_first_token(rid))

    async def _forward(self, res: Reservation) -> web.StreamResponse:
        """Send the body to the instance; relay its answer (502 instead of its 5xx)."""
        url = res.url.rstrip("/") + self.request.raw_path
        headers = request_headers(self.request.headers, self.rid)
        if not self.stream and res.predicted_ttft_ms is not None:
            # No chunk marks a non-streaming first token: the prediction stands in for it.
            self._mark_handle = self.loop.call_later(
                res.predicted_ttft_ms / 1000, self._mark_at_predicted_time, res.rid
            )
        total = self.config.request_timeout_s
        timeout = aiohttp.ClientTimeout(total=total, sock_connect=min(CONNECT_TIMEOUT_S, total))
        try:
            upstream = await self.session.post(
                url, data=self.body, headers=headers, timeout=timeout, allow_redirects=False
            )
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            raise _ConnectFailedError(str(exc) or type(exc).__name__) from exc
        except TimeoutError:
            return self._error(
                504, f"instance {res.instance_id} did not answer in time", "upstream_timeout", res
            )
        except aiohttp.ClientError as exc:
            return self._error(
                502, f"instance {res.instance_id} failed: {exc!r}", "upstream_error", res
            )
        try:
            if upstream.status >= 500:
                detail = ""
                with suppress(aiohttp.ClientError, TimeoutError):
                    raw = await upstream.content.read(ERROR_DETAIL_BYTES)
                    detail = raw.decode("utf-8", "replace")
                return self._error(
                    502,
                    f"instance {res.instance_id} answered {upstream.status}: {detail}".rstrip(": "),
                    "upstream_error",
                    res,
                )
            return await self._relay(upstream, res)
        finally:
            upstream.release()  # closes the connection unless the body was read to the end

    async def _relay(
        self, upstream: aiohttp.ClientResponse, res: Reservation
    ) -> web.StreamResponse:
        """Stream the engine's answer to the client chunk by chunk, as it arrives."""
        ok = 200 <= upstream.status < 300
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        copy_response_headers(upstream.headers, response)
        response.headers.update(self._headers(res))
        self.status = upstream.status
        self.outcome = "completed" if ok else "passed_through"
        try:
            await response.prepare(self.request)
        except ConnectionError:
            self.status, self.outcome = 499, "client_disconnect"
            return response
        self.response = response
        counter = OutputCounter(self.stream) if ok else None
        first = True
        try:
            async for chunk, _ in upstream.content.iter_chunks():
                if not chunk:
                    continue
                try:
                    await response.write(chunk)
                except ConnectionError:
                    self.status, self.outcome = 499, "client_disconnect"
                    return response
                if first:
                    first = False
                    if ok:
                        self.metrics.ttft.observe(self.loop.time() - self.started)
                        if self.stream:
                            await self._mark_first_token(res.rid)
                if counter is not None:
                    counter.feed(chunk)
        except (aiohttp.ClientError, TimeoutError) as exc:
            # Bytes already went out: no error status is possible. Cut the client's
            # connection so it sees a truncated response instead of a clean end.
            self.outcome = "timeout" if isinstance(exc, TimeoutError) else "upstream_failed"
            log.warning("instance %s failed mid-response: %r", res.instance_id, exc)
            response.force_close()
            transport = self.request.transport
            if transport is not None:
                transport.close()
            return response
        with suppress(ConnectionError):
            await response.write_eof()
        if counter is not None:
            tokens = counter.tokens()
            if tokens is not None:
                self.state.observe_output(tokens)
        return response


def _cause(exc: BaseException) -> str:
    """The readable part of aiohttp's payload error (its cause's message)."""
    cause = exc.__cause__ or exc
    return str(getattr(cause, "message", "") or type(cause).__name__)


async def _client_gone(request: web.Request) -> None:
    """Return once the client's connection has closed."""
    while True:
        await asyncio.sleep(DISCONNECT_POLL_S)
        transport = request.transport
        if transport is None or transport.is_closing():
            return
