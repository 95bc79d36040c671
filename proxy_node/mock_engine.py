"""A mock OpenAI-compatible inference engine whose timing is the shared EngineModel.

One `EngineModel` (coordinator/engine_model.py, the same model the simulator runs)
sits inside the server. A driver task sleeps until the model's next iteration ends
on a monotonic clock, advances the model and hands each token event to the queue of
the request it belongs to, so streams are truly incremental. `--speed S` divides
every duration, to replay traces faster than real time.

Run it with `coordinator mock-engine --port P` or `python -m proxy_node.mock_engine`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, fields, replace
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from coordinator.engine_model import EngineEvent, EngineModel, EngineTiming
from coordinator.models import InstanceSpec
from coordinator.tokens import max_output_tokens_of, prompt_tokens_of
from proxy_node.engine_registration import Registrar

log = logging.getLogger(__name__)

ENV_PREFIX = "MOCK_ENGINE_"
FAULTS = ("error", "hang", "crash")
FAULT_HEADER = "X-Mock-Fault"  # forces one fault on one request (tests)
OUTPUT_TOKENS_HEADER = "X-Mock-Output-Tokens"  # forces the output length (trace replay)
DISCONNECT_POLL_S = 0.1  # how often parked requests are checked for a gone client
MAX_BODY_BYTES = 64 * 1024 * 1024  # long-context prompts from traces exceed aiohttp's 1 MiB
SHUTDOWN_TIMEOUT_S = 5.0  # requests are aborted at shutdown; this only bounds stragglers
# vLLM's own bucket boundaries, so dashboards built for vLLM read the mock unchanged.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit")

_T = EngineTiming()  # the shared model's documented defaults


@dataclass(frozen=True, slots=True)
class MockEngineConfig:
    """Mock engine settings; the CLI flags (and MOCK_ENGINE_<FLAG> variables) map onto them."""

    host: str = "127.0.0.1"  # address to bind
    port: int = 8000  # port to bind; 0 picks a free one (start_mock_engine only)
    model: str = "mock-model"  # served model name (/v1/models, responses, metric label)
    max_batch: int = _T.max_batch  # running sequences at most
    prefill_ms_per_token: float = _T.prefill_ms_per_token  # prefill time per prompt token
    prefill_overhead_ms: float = _T.prefill_overhead_ms  # fixed cost of one prefill
    decode_base_ms: float = _T.decode_base_ms  # one decode step at batch size 1
    decode_ms_per_seq: float = _T.decode_ms_per_seq  # extra step time per running sequence
    speed: float = 1.0  # every duration is divided by this
    register: str | None = None  # control plane URL to self-register with
    instance_id: str | None = None  # registered id; None = mock-<port>
    token: str | None = None  # bearer token for control-plane writes
    advertise_url: str | None = None  # URL registered; None = http://host:port
    error_rate: float = 0.0  # fraction of requests answered 500 before any byte
    hang_rate: float = 0.0  # fraction of requests never answered
    crash_rate: float = 0.0  # fraction of requests whose stream stops mid-way
    seed: int | None = None  # seed of the fault draws; None = nondeterministic
    default_output_tokens: int = 128  # output length when the request names no cap
    register_backoff_s: float = 0.5  # first retry delay after a control-plane error
    register_backoff_max_s: float = 10.0  # the retry delay doubles up to this

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not self.model:
            raise ValueError("model must not be empty")
        if not (math.isfinite(self.speed) and self.speed > 0):
            raise ValueError(f"speed must be a finite number > 0, got {self.speed}")
        self.timing()  # EngineTiming validates the timing constants
        rates = (self.error_rate, self.hang_rate, self.crash_rate)
        if not all(0.0 <= r <= 1.0 for r in rates) or sum(rates) > 1.0:
            raise ValueError("error/hang/crash rates must be in [0, 1] and sum to at most 1")
        if self.default_output_tokens < 1:
            raise ValueError("default_output_tokens must be >= 1")
        if self.register is not None:
            if not self.register.startswith(("http://", "https://")):
                raise ValueError(f"--register must be an http(s) URL, got {self.register!r}")
        if self.register_backoff_s <= 0 or self.register_backoff_max_s < self.register_backoff_s:
            raise ValueError("need 0 < register_backoff_s <= register_backoff_max_s")

    def timing(self) -> EngineTiming:
        """The engine timing with every duration divided by `speed`."""
        return EngineTiming(
            self.prefill_ms_per_token,
            self.prefill_overhead_ms,
            self.decode_base_ms,
            self.decode_ms_per_seq,
            self.max_batch,
        ).scaled(self.speed)

    @property
    def url(self) -> str:
        """The URL other processes reach this engine at."""
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"  # a wildcard bind is reachable on loopback at least
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def instance_spec(self, epoch: int) -> InstanceSpec:
        """What this engine registers: its scaled timing model and its start epoch."""
        timing = self.timing()
        return InstanceSpec(
            id=self.instance_id or f"mock-{self.port}",
            url=self.url,
            role="mixed",
            max_slots=self.max_batch,
            weight=1.0,
            prefill_ms_per_token=timing.prefill_ms_per_token,
            prefill_overhead_ms=timing.prefill_overhead_ms,
            decode_ms_per_token=timing.nominal_decode_ms_per_token(),
            epoch=epoch,
            model=self.model,
        )


# ---------------------------------------------------------------------------
# The engine: the shared model on a monotonic clock, one event queue per request.


@dataclass(slots=True)
class _Stream:
    queue: asyncio.Queue[EngineEvent | None]  # None = abort (client gone, server stopping)
    gone: Callable[[], bool]  # whether the client has disconnected
    arrived_ms: float
    in_model: bool  # False for a parked (hanging) request
    done: bool = False


class MockEngine:
    """An EngineModel driven in real (monotonic) time, fanning events out per request."""

    def __init__(self, timing: EngineTiming, clock: Callable[[], float] = time.monotonic) -> None:
        self.model = EngineModel(timing)
        self.started_ms = time.time_ns() // 1_000_000  # registration epoch: rises on restart
        self._clock = clock
        self._t0 = clock()
        self._streams: dict[str, _Stream] = {}
        # Cancelled while being prefilled: EngineModel.cancel cannot reach that sequence,
        # so it is cancelled as soon as its prefill ends (see _dispatch).
        self._orphans: set[str] = set()
        self._wake = asyncio.Event()
        self.closed = False

    def now_ms(self) -> float:
        """Model time: monotonic ms since the engine started."""
        return (self._clock() - self._t0) * 1000.0

    @property
    def active_requests(self) -> int:
        """Requests holding a stream (in the model or parked)."""
        return len(self._streams)

    def submit(
        self, rid: str, prompt_tokens: int, output_tokens: int, gone: Callable[[], bool]
    ) -> _Stream:
        """Queue a request in the model; its events arrive on the returned stream's queue."""
        now = self.now_ms()
        stream = _Stream(asyncio.Queue(), gone, now, in_model=True)
        self._streams[rid] = stream
        if self.closed:
            stream.queue.put_nowait(None)
            return stream
        self._dispatch(self.model.advance(now))  # the model needs time in order
        self.model.submit(rid, prompt_tokens, output_tokens, now)
        self._wake.set()
        return stream

    def park(self, rid: str, gone: Callable[[], bool]) -> _Stream:
        """Hold a request outside the model; its queue only ever receives the abort."""
        stream = _Stream(asyncio.Queue(), gone, self.now_ms(), in_model=False)
        self._streams[rid] = stream
        if self.closed:
            stream.queue.put_nowait(None)
        return stream

    def finish(self, rid: str) -> None:
        """Forget a request; work it left in the model is cancelled (idempotent)."""
        stream = self._streams.pop(rid, None)
        if stream is None or stream.done or not stream.in_model:
            return
        if not self.model.cancel(rid):
            self._orphans.add(rid)

    def abort(self, rid: str) -> None:
        """End a request now: cancel its work and wake its handler with None."""
        stream = self._streams.get(rid)
        self.finish(rid)
        if stream is not None:
            stream.queue.put_nowait(None)

    def abort_all(self) -> None:
        """Abort every request and refuse new work (server shutdown)."""
        self.closed = True
        for rid in list(self._streams):
            self.abort(rid)

    async def drive(self) -> None:
        """Advance the model at each iteration end, forever; a submit wakes it early."""
        while True:
            self._wake.clear()
            due = self.model.next_event_ms()
            if due is None:
                await self._wake.wait()
                continue
            delay_s = (due - self.now_ms()) / 1000.0
            if delay_s > 0:
                with suppress(TimeoutError):
                    async with asyncio.timeout(delay_s):
                        await self._wake.wait()
            self._dispatch(self.model.advance(self.now_ms()))

    async def watch_disconnects(self, interval_s: float = DISCONNECT_POLL_S) -> None:
        """Abort requests whose client went away (aiohttp does not cancel handlers)."""
        while True:
            await asyncio.sleep(interval_s)
            for rid, stream in list(self._streams.items()):
                if stream.gone():
                    self.abort(rid)

    def _dispatch(self, events: list[EngineEvent]) -> None:
        for event in events:
            if event.rid in self._orphans:
                if event.kind == "done" or self.model.cancel(event.rid):
                    self._orphans.discard(event.rid)
                continue
            stream = self._streams.get(event.rid)
            if stream is None:
                continue
            if event.kind == "done":
                stream.done = True
            stream.queue.put_nowait(event)


# ---------------------------------------------------------------------------
# Metrics (per-app registry, vLLM's names) and fault draws.


class EngineMetrics:
    """vLLM-named Prometheus metrics in a registry of their own."""

    def __init__(self, model_name: str, max_batch: int) -> None:
        self.registry = CollectorRegistry()
        self.max_batch = max_batch
        labels = ["model_name"]
        reg = self.registry
        self.running = Gauge(
            "vllm:num_requests_running", "Requests in the running batch.", labels, registry=reg
        ).labels(model_name)
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting for prefill.", labels, registry=reg
        ).labels(model_name)
        self.cache_usage = Gauge(
            "vllm:gpu_cache_usage_perc",
            "KV-cache usage stand-in: running / max batch (0..1).",
            labels,
            registry=reg,
        ).labels(model_name)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token, in seconds.",
            labels,
            registry=reg,
            buckets=TTFT_BUCKETS,
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency, in seconds.",
            labels,
            registry=reg,
            buckets=E2E_BUCKETS,
        ).labels(model_name)

    def render(self, model: EngineModel) -> bytes:
        """The text exposition, with the gauges read from the model now."""
        self.running.set(model.num_running)
        self.waiting.set(model.num_waiting)
        self.cache_usage.set(min(1.0, model.num_running / self.max_batch))
        return generate_latest(self.registry)


class FaultPicker:
    """Draws one fault (or none) per request from a seeded generator."""

    def __init__(self, config: MockEngineConfig) -> None:
        self._rng = random.Random(config.seed)
        self._thresholds = (
            ("error", config.error_rate),
            ("hang", config.error_rate + config.hang_rate),
            ("crash", config.error_rate + config.hang_rate + config.crash_rate),
        )

    def pick(self, forced: str | None = None) -> str | None:
        """A fault name or None; a forced fault wins but the draw still happens."""
        # Drawing every time keeps the seeded sequence independent of forced faults.
        u = self._rng.random()
        if forced is not None:
            return forced
        for name, threshold in self._thresholds:
            if u < threshold:
                return name
        return None


CONFIG_KEY = web.AppKey("mock_engine_config", MockEngineConfig)
ENGINE_KEY = web.AppKey("mock_engine", MockEngine)
METRICS_KEY = web.AppKey("mock_engine_metrics", EngineMetrics)
FAULTS_KEY = web.AppKey("mock_engine_faults", FaultPicker)
REGISTRAR_KEY = web.AppKey("mock_engine_registrar", Registrar)


# ---------------------------------------------------------------------------
# HTTP handlers.


def _error(status: int, message: str, kind: str, code: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return web.json_response(body, status=status)


def _bad_request(message: str) -> web.Response:
    return _error(400, message, "invalid_request_error")


def _token_text(n: int) -> str:
    """Text of the n-th generated token (1-based)."""
    word = WORDS[(n - 1) % len(WORDS)]
    return word if n == 1 else f" {word}"


def _client_gone(request: web.BaseRequest) -> Callable[[], bool]:
    def gone() -> bool:
        transport = request.transport
        return transport is None or transport.is_closing()

    return gone


def _close_connection(request: web.BaseRequest) -> None:
    if request.transport is not None:
        request.transport.close()


@dataclass(slots=True)
class _Job:
    """One parsed completion request."""

    chat: bool
    rid: str
    created: int
    model: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    stream: bool
    include_usage: bool
    fault: str | None

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }

    def chunk(self, text: str | None, n: int, finish: str | None = None) -> dict[str, Any]:
        """One streamed chunk: a token (text), or the final one (finish, no text)."""
        choice: dict[str, Any]
        if self.chat:
            delta: dict[str, Any] = {}
            if n == 1 and text is not None:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        out: dict[str, Any] = {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if self.include_usage:
            out["usage"] = None  # as OpenAI: every chunk but the last carries usage: null
        return out

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": self.usage(completion_tokens),
        }

    def response(self, completion_tokens: int) -> dict[str, Any]:
        text = "".join(_token_text(i) for i in range(1, completion_tokens + 1))
        choice: dict[str, Any]
        if self.chat:
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice["finish_reason"] = self.finish_reason
        return {
            "id": self.rid,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(completion_tokens),
        }


def _parse_job(request: web.Request, raw: bytes, chat: bool) -> _Job | web.Response:
    config = request.app[CONFIG_KEY]
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return _bad_request(f"request body is not valid JSON: {exc}")
    if not isinstance(body, dict):
        return _bad_request("request body must be a JSON object")
    if chat and not isinstance(body.get("messages"), list):
        return _bad_request("'messages' must be a list")
    if not chat and not isinstance(body.get("prompt"), str | list):
        return _bad_request("'prompt' must be a string or a list of strings")
    forced_fault = request.headers.get(FAULT_HEADER)
    if forced_fault is not None and forced_fault not in FAULTS:
        return _bad_request(f"{FAULT_HEADER} must be one of {FAULTS}")
    cap = max_output_tokens_of(body)
    output_tokens = cap or config.default_output_tokens
    forced_output = request.headers.get(OUTPUT_TOKENS_HEADER)
    if forced_output is not None:
        try:
            output_tokens = int(forced_output)
        except ValueError:
            output_tokens = 0
        if output_tokens < 1:
            return _bad_request(f"{OUTPUT_TOKENS_HEADER} must be a positive integer")
    options = body.get("stream_options")
    return _Job(
        chat=chat,
        rid=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=config.model,
        prompt_tokens=prompt_tokens_of(body),
        output_tokens=output_tokens,
        finish_reason="length" if cap is not None and output_tokens >= cap else "stop",
        stream=body.get("stream") is True,
        include_usage=isinstance(options, dict) and options.get("include_usage") is True,
        fault=request.app[FAULTS_KEY].pick(forced_fault),
    )


async def _completion(request: web.Request, chat: bool) -> web.StreamResponse:
    job = _parse_job(request, await request.read(), chat)
    if isinstance(job, web.Response):
        return job
    if job.fault == "error":
        return _error(500, "mock engine: injected error", "internal_server_error")
    engine = request.app[ENGINE_KEY]
    gone = _client_gone(request)
    if job.fault == "hang":
        parked = engine.park(job.rid, gone)
        try:
            await parked.queue.get()  # only the abort arrives: client gone or server stopping
        finally:
            engine.finish(job.rid)
        _close_connection(request)
        return web.Response(status=503)  # never reaches the client: the connection is closed
    stream = engine.submit(job.rid, job.prompt_tokens, job.output_tokens, gone)
    # A crash cuts the output half-way, after at least one token.
    crash_after = max(1, job.output_tokens // 2) if job.fault == "crash" else None
    try:
        if job.stream:
            return await _stream_tokens(request, job, stream, crash_after)
        return await _collect_tokens(request, job, stream, crash_after)
    finally:
        engine.finish(job.rid)


def _observe(request: web.Request, event: EngineEvent, stream: _Stream) -> None:
    metrics = request.app[METRICS_KEY]
    seconds = max(0.0, event.at_ms - stream.arrived_ms) / 1000.0
    if event.kind == "first_token":
        metrics.ttft.observe(seconds)
    elif event.kind == "done":
        metrics.e2e.observe(seconds)


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


async def _stream_tokens(
    request: web.Request, job: _Job, stream: _Stream, crash_after: int | None
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    try:
        await resp.prepare(request)
        while True:
            # Events that arrived together go out in one write: fewer syscalls when the
            # engine runs fast (high --speed, big batches), same SSE chunks on the wire.
            out: list[bytes] = []
            event = await stream.queue.get()
            while True:
                if event is None:  # client gone or server stopping: drop the connection
                    _close_connection(request)
                    return resp
                _observe(request, event, stream)
                if event.kind == "done":
                    out.append(_sse(job.chunk(None, event.generated, job.finish_reason)))
                    if job.include_usage:
                        out.append(_sse(job.usage_chunk(event.generated)))
                    out.append(b"data: [DONE]\n\n")
                    await resp.write(b"".join(out))
                    await resp.write_eof()
                    return resp
                out.append(_sse(job.chunk(_token_text(event.generated), event.generated)))
                if crash_after is not None and event.generated >= crash_after:
                    await resp.write(b"".join(out))
                    _close_connection(request)  # no final chunk, no [DONE]: truncated
                    return resp
                if stream.queue.empty():
                    break
                event = stream.queue.get_nowait()
            await resp.write(b"".join(out))
    except ConnectionError:
        pass  # the client went away mid-write; the caller cancels what is left
    return resp


async def _collect_tokens(
    request: web.Request, job: _Job, stream: _Stream, crash_after: int | None
) -> web.StreamResponse:
    while True:
        event = await stream.queue.get()
        if event is None:
            _close_connection(request)
            return web.Response(status=503)  # never reaches the client
        _observe(request, event, stream)
        if crash_after is not None and event.generated >= crash_after:
            _close_connection(request)
            return web.Response(status=500)  # never reaches the client
        if event.kind == "done":
            return web.json_response(job.response(event.generated))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    return await _completion(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    return await _completion(request, chat=False)


async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models: the one served model."""
    config = request.app[CONFIG_KEY]
    created = request.app[ENGINE_KEY].started_ms // 1000
    model = {"id": config.model, "object": "model", "created": created, "owned_by": "mock"}
    return web.json_response({"object": "list", "data": [model]})


async def health(request: web.Request) -> web.Response:
    """GET /health."""
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics in the Prometheus text format."""
    body = request.app[METRICS_KEY].render(request.app[ENGINE_KEY].model)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})


# ---------------------------------------------------------------------------
# The application and how to run it.


async def _engine_tasks(app: web.Application) -> AsyncIterator[None]:
    engine = app[ENGINE_KEY]
    tasks = [
        asyncio.create_task(engine.drive(), name="mock-engine-driver"),
        asyncio.create_task(engine.watch_disconnects(), name="mock-engine-disconnects"),
    ]
    yield
    for task in tasks:
        task.cancel()
    for task in tasks:
        with suppress(asyncio.CancelledError):
            await task


async def _registration(app: web.Application) -> AsyncIterator[None]:
    registrar = app[REGISTRAR_KEY]
    async with registrar:
        task = asyncio.create_task(registrar.run(), name="mock-engine-registration")
        yield
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task
        await registrar.unregister()


async def _abort_requests(app: web.Application) -> None:
    # Runs before aiohttp waits for handlers: hanging requests must not hold shutdown.
    app[ENGINE_KEY].abort_all()


def create_app(config: MockEngineConfig) -> web.Application:
    """The mock engine as an aiohttp application."""
    if config.register is not None and config.port == 0 and config.advertise_url is None:
        # start_mock_engine binds first and passes the real port; create_app cannot.
        raise ValueError("registration needs a concrete port or an advertise URL")
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    engine = MockEngine(config.timing())
    app[CONFIG_KEY] = config
    app[ENGINE_KEY] = engine
    app[METRICS_KEY] = EngineMetrics(config.model, config.max_batch)
    app[FAULTS_KEY] = FaultPicker(config)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.cleanup_ctx.append(_engine_tasks)
    if config.register is not None:

        def hints() -> dict[str, float]:
            return {
                "engine_running": float(engine.model.num_running),
                "engine_waiting": float(engine.model.num_waiting),
            }

        app[REGISTRAR_KEY] = Registrar(
            config.register,
            config.instance_spec(engine.started_ms),
            hints,
            token=config.token,
            backoff_s=config.register_backoff_s,
            backoff_max_s=config.register_backoff_max_s,
        )
        app.cleanup_ctx.append(_registration)
    app.on_shutdown.append(_abort_requests)
    return app


@dataclass(slots=True)
class RunningMockEngine:
    """A started mock engine; `stop()` shuts it down (and unregisters it)."""

    app: web.Application
    runner: web.AppRunner
    config: MockEngineConfig  # with the port actually bound
    stopped: bool = False

    @property
    def url(self) -> str:
        """Base URL of the engine."""
        return self.config.url

    @property
    def engine(self) -> MockEngine:
        """The engine inside (for in-process inspection)."""
        return self.app[ENGINE_KEY]

    async def stop(self) -> None:
        """Stop serving, abort requests in flight, unregister (idempotent)."""
        if not self.stopped:
            self.stopped = True
            await self.runner.cleanup()


def _listening_socket(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        # Listening now lets connections queue while the app starts up.
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


async def start_mock_engine(config: MockEngineConfig) -> RunningMockEngine:
    """Bind (port 0 picks a free port), start the engine, and return a handle to it."""
    sock = _listening_socket(config.host, config.port)
    try:
        config = replace(config, port=sock.getsockname()[1])
        app = create_app(config)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        await runner.setup()
    except BaseException:
        sock.close()
        raise
    try:
        await web.SockSite(runner, sock).start()
    except BaseException:
        await runner.cleanup()
        sock.close()
        raise
    return RunningMockEngine(app, runner, config)


async def serve(config: MockEngineConfig) -> None:
    """Run a mock engine until SIGINT or SIGTERM, then stop it cleanly."""
    running = await start_mock_engine(config)
    timing = running.config.timing()
    log.info(
        "mock engine %r on %s: max_batch %d, speed %g, prefill %.3g ms + %.3g ms/token, "
        "decode %.3g ms + %.3g ms/seq per step",
        config.model,
        running.url,
        timing.max_batch,
        config.speed,
        timing.prefill_overhead_ms,
        timing.prefill_ms_per_token,
        timing.decode_base_ms,
        timing.decode_ms_per_seq,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await running.stop()


# ---------------------------------------------------------------------------
# Command line.

# (flag, config field, type, help)
_FLAGS: tuple[tuple[str, str, Callable[[str], Any], str], ...] = (
    ("--host", "host", str, "address to bind"),
    ("--port", "port", int, "port to bind (0 picks a free one)"),
    ("--model", "model", str, "served model name"),
    ("--max-batch", "max_batch", int, "running sequences at most"),
    ("--prefill-ms-per-token", "prefill_ms_per_token", float, "prefill time per prompt token"),
    ("--prefill-overhead-ms", "prefill_overhead_ms", float, "fixed time of one prefill"),
    (
        "--decode-ms-per-token",
        "decode_base_ms",
        float,
        "decode step time at batch size 1 (decode_base_ms)",
    ),
    ("--decode-ms-per-seq", "decode_ms_per_seq", float, "extra decode step time per sequence"),
    ("--speed", "speed", float, "divide every duration by this (replay faster than real time)"),
    ("--register", "register", str, "control-plane URL to self-register with and heartbeat"),
    ("--instance-id", "instance_id", str, "registered instance id; unset means mock-<port>"),
    ("--token", "token", str, "bearer token for control-plane writes"),
    ("--advertise-url", "advertise_url", str, "URL to register; unset means http://host:port"),
    ("--error-rate", "error_rate", float, "fraction of requests answered 500"),
    ("--hang-rate", "hang_rate", float, "fraction of requests never answered"),
    ("--crash-rate", "crash_rate", float, "fraction of requests cut off mid-stream"),
    ("--seed", "seed", int, "seed of the fault draws; unset means random"),
    ("--default-output-tokens", "default_output_tokens", int, "output length without max_tokens"),
)


_SECRETS = ("token",)  # taken from the environment without showing up in --help
_METAVARS = {"model": "NAME", "register": "URL", "instance_id": "ID", "advertise_url": "URL"}


def _env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the mock engine's flags; each defaults to MOCK_ENGINE_<FLAG> when set."""
    defaults = MockEngineConfig()
    parser.epilog = (
        f"Every flag may also be set by an environment variable {ENV_PREFIX}<FLAG>, "
        f"e.g. {_env_name('--max-batch')}=64; a flag on the command line wins. "
        f"Per request, the header {OUTPUT_TOKENS_HEADER}: N forces the output length and "
        f"{FAULT_HEADER}: error|hang|crash forces a fault."
    )
    for flag, name, kind, help_text in _FLAGS:
        # argparse converts string defaults with `type`, so a bad variable is a clean error.
        env_value = os.environ.get(_env_name(flag))
        if name in _SECRETS:
            env_value = None  # read in config_from_args, so --help never prints it
        default = env_value if env_value is not None else getattr(defaults, name)
        parser.add_argument(
            flag,
            dest=f"mock_{name}",
            type=kind,
            default=default,
            metavar=_METAVARS.get(name, "N" if kind is int else "X" if kind is float else "TEXT"),
            help=f"{help_text} [env {_env_name(flag)}]",
        )


def config_from_args(args: argparse.Namespace) -> MockEngineConfig:
    """The config named by parsed arguments (raises ValueError on a bad value)."""
    values = {
        f.name: getattr(args, f"mock_{f.name}")
        for f in fields(MockEngineConfig)
        if hasattr(args, f"mock_{f.name}")
    }
    for name in _SECRETS:
        if values.get(name) is None:
            values[name] = os.environ.get(_env_name(f"--{name.replace('_', '-')}"))
    return MockEngineConfig(**values)


def run(args: argparse.Namespace) -> int:
    """Run the mock engine in the foreground until interrupted."""
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"mock-engine: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(config))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m proxy_node.mock_engine`: the same flags as `coordinator mock-engine`."""
    parser = argparse.ArgumentParser(
        prog="python -m proxy_node.mock_engine",
        description=__doc__.splitlines()[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
