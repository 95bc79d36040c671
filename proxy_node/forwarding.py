"""The service plane's pass-through: reserve, forward, relay the stream, release.

One `Exchange` per client request. The reservation is released in `finally` on every
path: completion, engine error, connection failure, client disconnect, timeout.
aiohttp does not cancel a handler when its client goes away, so a watcher task polls
the client's transport and ends the exchange when it closes.

Waits are bounded three ways (docs/reliability.md): connecting to the engine
(`connect_timeout_s`), from sending the request to the first response byte
(`first_byte_timeout_s`), and between two chunks (`idle_timeout_s`); and a client that
stops reading is dropped after `send_timeout_s`. A failure before
any byte went to the client (an engine's 5xx, 429 or 408, refused, connect or
first-byte timeout, empty 200) is retried once on another instance; otherwise the
client gets a JSON error (502/504, or the engine's own 429/408 with its Retry-After),
or a cut connection when part of the answer already went out. Every failed
exchange is reported to passive health (proxy_node/health.py), which may eject the
instance.

The reservation id is always the node's own: a client's `X-Request-Id` is kept for
logs and headers only, so two requests that share it still hold two reservations.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from contextlib import suppress
from functools import partial
from typing import NoReturn

import aiohttp
from aiohttp import web

from coordinator.errors import (
    InvalidArgumentError,
    NoInstanceError,
    PoolFullError,
)
from coordinator.keys import ID_RE
from coordinator.models import Reservation
from proxy_node.bodies import read_up_to
from proxy_node.errors import json_error
from proxy_node.headers import copy_response_headers, request_headers
from proxy_node.intake import RequestRejectedError, parse_completion
from proxy_node.state import CONFIG, COORDINATOR, HEALTH, METRICS, SESSION, STATE
from proxy_node.usage import OutputCounter

log = logging.getLogger(__name__)

THREAD_PARSE_BYTES = 256 * 1024  # a larger body is parsed in a worker thread
DISCONNECT_POLL_S = 0.2  # how soon a vanished client frees its reservation when idle
ERROR_DETAIL_BYTES = 512  # of an engine's error body, quoted in the error's message
MAX_ATTEMPTS = 2  # instances tried for one request when nothing reached the client
# An engine's 4xx that says "not now" rather than "bad request": overloaded, or timed
# out waiting for the request. Another instance may take it (the SGLang Model Gateway
# retries both); the client keeps the status, so its own backoff applies if all refuse.
REFUSALS = frozenset({408, 429})


class _RetryableError(Exception):
    """The exchange failed before any byte reached the client: another instance may serve it."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        res: Reservation,
        logged: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.res = res  # the failed attempt's reservation (its headers go on the error)
        self.logged = logged or message  # what the log says: no engine body (it may echo
        # the prompt: docs/security.md)
        self.headers = headers or {}  # extra headers of the error, if it is the last


def endpoint_of(path: str) -> str:
    """The metrics label of a service-plane path."""
    return "chat" if path.endswith("/chat/completions") else "completions"


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions and /v1/completions: the OpenAI-compatible pass-through."""
    exchange = Exchange(request)
    try:
        return await exchange.run()
    except Exception:
        log.exception("request %s failed", exchange.request_id)
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
        self.health = app[HEALTH]
        # The reservation id is always generated here (a client's id could collide).
        self.rid = uuid.uuid4().hex
        client_rid = request.headers.get("X-Request-Id", "")
        # The id the client and the engine see, and logs show: the client's when valid.
        self.request_id = client_rid if ID_RE.match(client_rid) else self.rid
        self.status = 500
        self.outcome = "error"
        self.body = b""
        self.stream = False
        self.prompt_tokens = 0
        self.expected_output_tokens = 0
        self.prefix_hashes: list[str] = []
        self.cached_tokens: dict[str, int] | None = None  # looked up once per request
        self.model: str | None = None
        self.sent_at = 0.0  # loop time the request went to the engine
        self.response: web.StreamResponse | None = None
        self._mark_handle: asyncio.TimerHandle | None = None
        self.reserved_at = self.started  # loop time the current attempt got its reservation

    # ------------------------------------------------------------------ flow

    async def run(self) -> web.StreamResponse:
        """Validate, reserve, forward (another instance after a retryable failure), release."""
        rejected = await self._read_request()
        if rejected is not None:
            return rejected
        excluded: set[str] = set()
        failure: _RetryableError | None = None
        for attempt in range(MAX_ATTEMPTS):
            reservation = await self._reserve(excluded, failure)
            if isinstance(reservation, web.StreamResponse):
                return reservation
            try:
                return await self._attempt(reservation)
            except _RetryableError as exc:
                failure = exc
                excluded.add(reservation.instance_id)
                log.warning("request %s: %s", self.request_id, exc.logged)
                if attempt + 1 < MAX_ATTEMPTS:
                    self.metrics.connect_retries.inc()
        assert failure is not None
        return self._failed(failure)

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
        *,
        closing: bool = False,
    ) -> web.Response:
        self.status = status
        self.outcome = code
        headers = self._headers(res)
        headers.update(extra or {})
        return json_error(status, message, code, headers, closing=closing)

    def _failed(self, failure: _RetryableError) -> web.Response:
        """The client's answer when the last instance tried failed too."""
        return self._error(
            failure.status, failure.message, failure.code, failure.res, failure.headers
        )

    def _headers(self, res: Reservation | None) -> dict[str, str]:
        if res is None:
            return {"X-Request-Id": self.request_id}
        ttft = "" if res.predicted_ttft_ms is None else str(res.predicted_ttft_ms)
        return {
            "X-Instance-Id": res.instance_id,
            "X-Predicted-TTFT-Ms": ttft,
            "X-Prefix-Cached-Tokens": str(res.cached_tokens),
            "X-Request-Id": self.request_id,
            "X-Reservation-Id": res.rid,
        }

    # ------------------------------------------------------------------ request

    async def _read_request(self) -> web.StreamResponse | None:
        """Read and check the body; an error response when it is unacceptable."""
        request = self.request
        limit = self.config.max_body_bytes
        too_large = f"request body is larger than {limit} bytes"
        if request.content_length is not None and request.content_length > limit:
            # The unread body must not be parsed as a request: the connection ends.
            return self._error(413, too_large, "body_too_large", closing=True)
        data = bytearray()
        try:
            # One deadline for the whole body: a client trickling bytes cannot hold the
            # handler longer than a stalled one.
            async with asyncio.timeout(self.config.body_timeout_s):
                async for chunk in request.content.iter_any():
                    data += chunk
                    if len(data) > limit:
                        return self._error(413, too_large, "body_too_large", closing=True)
        except ConnectionError:
            self.status, self.outcome = 499, "client_disconnect"
            return web.Response(status=499)
        except TimeoutError:
            return self._error(
                408,
                f"request body not received within {self.config.body_timeout_s:g} s",
                "body_timeout",
                closing=True,
            )
        except web.RequestPayloadError as exc:  # e.g. a body that fails its Content-Encoding
            message = f"unreadable request body: {_cause(exc)}"
            return self._error(400, message, "invalid_body", closing=True)
        self.body = bytes(data)
        parse = partial(
            parse_completion,
            self.body,
            request.headers.get("X-Prompt-Tokens"),
            self.coordinator.expected_output_tokens(None),
            self.coordinator.prefix.hashes,
        )
        try:
            # Decoding and hashing take about 10 ms per MB of JSON (a long chat's many
            # messages): a large body's, in a worker thread, so that requests already
            # in flight go on meanwhile.
            parsed = await asyncio.to_thread(parse) if len(data) > THREAD_PARSE_BYTES else parse()
        except RequestRejectedError as exc:
            return self._error(exc.status, exc.message, exc.code)
        self.prompt_tokens = parsed.prompt_tokens
        self.model = parsed.model
        # The pool's learned output length of this model, bounded by the client's cap.
        self.expected_output_tokens = self.coordinator.expected_output_tokens(
            parsed.model, parsed.output_cap
        )
        self.stream = parsed.stream
        self.prefix_hashes = parsed.prefix_hashes
        return None

    async def _reserve(
        self, excluded: set[str], failure: _RetryableError | None
    ) -> Reservation | web.StreamResponse:
        """Reserve an instance: not one that failed this request, nor an ejected one.

        Ejected instances are used only when nothing else is alive (Envoy's panic mode:
        an ejected instance beats none); cordoned ones never. Answers 503 (none alive
        besides the failed), 429 (pool full) or 400; after a failure, that failure's
        502/504.
        """
        started = time.perf_counter()
        ejected = self.health.ejected_ids()
        # Cordoned instances never (an operator's drain must end); ejected ones last.
        excluded = excluded | self.health.cordoned_ids()
        prefix = self.coordinator.prefix
        if self.cached_tokens is None:
            self.cached_tokens = await prefix.cached_tokens(self.prefix_hashes)
        sizes = (self.prompt_tokens, self.expected_output_tokens)
        try:
            try:
                res = await self.coordinator.reserve(
                    *sizes,
                    rid=self.rid,
                    exclude=excluded | ejected,
                    cached_tokens=self.cached_tokens,
                )
            except NoInstanceError:
                if not ejected - excluded:
                    raise
                res = await self.coordinator.reserve(
                    *sizes, rid=self.rid, exclude=excluded, cached_tokens=self.cached_tokens
                )
            # Spawned: the next turn of this conversation may already be on its way.
            held = self.cached_tokens.get(res.instance_id, 0)
            prefix.routed(self.prefix_hashes)
            self.state.spawn(prefix.record(res.instance_id, self.prefix_hashes, held))
            return res
        except NoInstanceError as exc:
            if failure is not None:
                return self._failed(failure)
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
        self.reserved_at = self.loop.time()
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
            self._release(res.rid)

    def _release(self, rid: str) -> None:
        # Held for this node's next reserve (Coordinator.release_soon): nothing here
        # waits for Redis, and a handler cancelled at shutdown still gives it back.
        try:
            self.coordinator.release_soon(rid)
        except Exception:
            log.exception("releasing %s failed", rid)

    def _mark_first_token(self, rid: str) -> None:
        # Held like the release: the first token goes to the client without waiting.
        try:
            self.coordinator.first_token_soon(rid)
        except Exception:
            log.exception("marking the first token of %s failed", rid)

    def _mark_at_predicted_time(self, rid: str) -> None:
        self._mark_handle = None
        self._mark_first_token(rid)

    def _report(self, res: Reservation, ok: bool, reason: str = "") -> None:
        # Spawned: a client hanging up must not cancel the report.
        self.state.spawn(self.health.report(res.instance_id, ok, reason))

    async def _forward(self, res: Reservation) -> web.StreamResponse:
        """Send the body to the instance; relay its answer (502 instead of its 5xx)."""
        cfg = self.config
        url = res.url.rstrip("/") + self.request.raw_path
        headers = request_headers(self.request.headers, self.request_id)
        if not self.stream and res.predicted_ttft_ms is not None:
            # No chunk marks a non-streaming first token: the prediction stands in for it.
            self._mark_handle = self.loop.call_later(
                res.predicted_ttft_ms / 1000, self._mark_at_predicted_time, res.rid
            )
        timeout = aiohttp.ClientTimeout(
            total=cfg.request_timeout_s, sock_connect=cfg.connect_timeout_s
        )
        name = res.instance_id
        upstream: aiohttp.ClientResponse | None = None
        self.sent_at = self.loop.time()
        try:
            try:
                async with asyncio.timeout(cfg.first_byte_timeout_s):
                    upstream = await self.session.post(
                        url, data=self.body, headers=headers, timeout=timeout, allow_redirects=False
                    )
                    if upstream.status >= 500 or upstream.status in REFUSALS:
                        await self._engine_error(upstream, res)
                    first = await upstream.content.readany()
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                phase = "connect" if isinstance(exc, aiohttp.ConnectionTimeoutError) else ""
                if phase:
                    self.metrics.upstream_timeouts.labels(phase).inc()
                self._report(res, False, "connect_timeout" if phase else "connect_failed")
                raise _RetryableError(
                    502,
                    f"instance {name} could not be reached: {exc or type(exc).__name__}",
                    "upstream_unreachable",
                    res,
                ) from exc
            except TimeoutError as exc:
                self.metrics.upstream_timeouts.labels("first_byte").inc()
                self._report(res, False, "first_byte_timeout")
                limit = min(cfg.first_byte_timeout_s, cfg.request_timeout_s)
                raise _RetryableError(
                    504,
                    f"instance {name} sent no response within {limit:g} s",
                    "upstream_timeout",
                    res,
                ) from exc
            except aiohttp.ClientError as exc:
                # The engine took the request and failed before answering: not retried.
                self._report(res, False, "disconnected")
                return self._error(502, f"instance {name} failed: {exc!r}", "upstream_error", res)
            if not first and 200 <= upstream.status < 300:
                self._report(res, False, "empty_response")
                raise _RetryableError(
                    502,
                    f"instance {name} answered {upstream.status} with no body",
                    "upstream_error",
                    res,
                )
            return await self._relay(upstream, res, first)
        finally:
            if upstream is not None:
                upstream.release()  # closes the connection unless the body was read to the end

    async def _engine_error(self, upstream: aiohttp.ClientResponse, res: Reservation) -> NoReturn:
        """The engine answered 5xx, 429 or 408 before any byte reached the client: another
        instance is tried (as the SGLang Model Gateway retries 408, 429, 500, 502, 503 and
        504 on another worker). The last one's answer becomes a JSON error quoting the
        start of its body: 502 for a 5xx; a 429 or 408 keeps its status and Retry-After,
        so the client's own backoff applies when every instance refused. All but a 429
        count against the engine for passive health."""
        status = upstream.status
        detail = ""
        with suppress(aiohttp.ClientError, TimeoutError):
            raw = await read_up_to(upstream.content, ERROR_DETAIL_BYTES)
            detail = raw.decode("utf-8", "replace")
        if status != 429:
            # A 429 is a healthy engine that is full: ejecting it would take capacity
            # away just when the fleet needs it (Envoy's outlier detection and nginx's
            # max_fails leave it out too). A 408 is an engine that could not read a request.
            self._report(res, False, f"status_{status}")
        answered = f"instance {res.instance_id} answered {status}"
        message = f"{answered}: {detail}".rstrip(": ")
        if status not in REFUSALS:
            raise _RetryableError(502, message, "upstream_error", res, logged=answered)
        retry_after = upstream.headers.get("Retry-After", "")
        headers = {"Retry-After": retry_after} if retry_after else {}
        code = "upstream_overloaded" if status == 429 else "upstream_request_timeout"
        raise _RetryableError(status, message, code, res, logged=answered, headers=headers)

    async def _relay(
        self, upstream: aiohttp.ClientResponse, res: Reservation, first: bytes
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
        encoding = upstream.headers.get("Content-Encoding", "")
        counter = OutputCounter(self.stream, encoding) if ok else None
        chunk, marked = first, not ok
        first_at = self.loop.time()
        idle_s = self.config.idle_timeout_s
        while chunk:
            try:
                async with asyncio.timeout(self.config.send_timeout_s):
                    await response.write(chunk)
            except ConnectionError:
                self.status, self.outcome = 499, "client_disconnect"
                return response
            except TimeoutError:
                return self._client_stalled(response)
            if not marked:
                marked = True
                first_at = self.loop.time()
                self.metrics.ttft.observe(first_at - self.started)
                if self.stream:
                    if res.predicted_ttft_ms is not None:
                        observed_ms = (self.loop.time() - self.reserved_at) * 1000
                        self.metrics.observe_prediction_error(
                            res.instance_id, res.predicted_ttft_ms, observed_ms
                        )
                    self._mark_first_token(res.rid)
            if counter is not None:
                counter.feed(chunk)
            idle = asyncio.timeout(idle_s)
            try:
                async with idle:
                    chunk = await upstream.content.readany()
            except (aiohttp.ClientError, TimeoutError) as exc:
                if isinstance(exc, TimeoutError):
                    phase = "idle" if idle.expired() else "total"
                    self.metrics.upstream_timeouts.labels(phase).inc()
                    self.outcome, reason = "timeout", f"{phase}_timeout"
                else:
                    self.outcome, reason = "upstream_failed", "cut_stream"
                log.warning(
                    "request %s: instance %s failed mid-response: %s",
                    self.request_id,
                    res.instance_id,
                    reason if isinstance(exc, TimeoutError) else repr(exc),
                )
                self._report(res, False, reason)
                # Bytes already went out: no error status is possible. Cut the client's
                # connection so it sees a truncated response instead of a clean end.
                response.force_close()
                transport = self.request.transport
                if transport is not None:
                    transport.close()
                return response
        try:
            async with asyncio.timeout(self.config.send_timeout_s):
                await response.write_eof()
        except ConnectionError:
            pass
        except TimeoutError:
            return self._client_stalled(response)
        problem = counter.problem() if counter is not None else None
        if problem is not None:
            log.warning(
                "request %s: instance %s answered %d with a broken body: %s",
                self.request_id,
                res.instance_id,
                upstream.status,
                problem,
            )
        self._report(res, problem is None, problem or "")
        if counter is not None and problem is None:
            self._learn(res, counter.tokens(), first_at)
        return response

    def _client_stalled(self, response: web.StreamResponse) -> web.StreamResponse:
        """The client read nothing for `send_timeout_s`: its connection is dropped with
        what it did not take, which ends the engine's stream and frees the reservation
        (a reader that stopped would hold both for good). The engine is not at fault."""
        self.status, self.outcome = 499, "client_stalled"
        log.warning(
            "request %s: the client took no response bytes for %g s: connection dropped",
            self.request_id,
            self.config.send_timeout_s,
        )
        response.force_close()
        transport = self.request.transport
        if transport is not None:
            transport.abort()  # close() would wait to flush what the client does not read
        return response

    def _learn(self, res: Reservation, tokens: int | None, first_at: float) -> None:
        """Hand a completed exchange's timing to the pool's learned estimates."""
        if not self.stream:  # one chunk carries the whole answer: only its length teaches
            self.coordinator.observe(res, output_tokens=tokens, model=self.model)
            return
        self.coordinator.observe(
            res,
            ttft_ms=(first_at - self.sent_at) * 1000,
            output_tokens=tokens,
            decode_ms=(self.loop.time() - first_at) * 1000,
            model=self.model,
        )


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
