"""A mock OpenAI-compatible inference engine whose timing is the shared EngineModel.

One `EngineModel` (local_fleet/engine_model.py, the same model the simulator runs)
sits inside the server. A driver task sleeps until the model's next iteration ends
on a monotonic clock, advances the model and hands each token event to the queue of
the request it belongs to, so streams are truly incremental. `--speed S` divides
every duration, to replay traces faster than real time.

Run it with `coordinator mock-engine --port P` or `python -m local_fleet.mock_engine`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from coordinator.prefix import block_hashes, block_tokens, canonical_prompt, salt_key
from coordinator.tokens import max_output_tokens_of, prompt_tokens_of
from local_fleet.engine_model import EngineEvent, PrefixCache
from local_fleet.mock_engine.config import (
    FAULT_HEADER,
    FAULTS,
    OUTPUT_TOKENS_HEADER,
    MockEngineConfig,
    add_arguments,
    config_from_args,
)
from local_fleet.mock_engine.engine import (
    EngineMetrics,
    FaultPicker,
    MockEngine,
    RequestStream,
)
from proxy_node.engine_registration import Registrar, RegistrationDeniedError
from proxy_node.entry import standalone_main

CONFIG_KEY = web.AppKey("mock_engine_config", MockEngineConfig)
SPEED_KEY = web.AppKey("mock_engine_speed", list)  # [the current speed]
ENGINE_KEY = web.AppKey("mock_engine", MockEngine)
METRICS_KEY = web.AppKey("mock_engine_metrics", EngineMetrics)
FAULTS_KEY = web.AppKey("mock_engine_faults", FaultPicker)
REGISTRAR_KEY = web.AppKey("mock_engine_registrar", Registrar)
REGISTRATION_KEY = web.AppKey("mock_engine_registration", list[asyncio.Task[None]])

log = logging.getLogger(__name__)

# The engine's cache is private: any fixed key works (the node salts its own index).
ENGINE_PREFIX_KEY = salt_key("mock-engine", "")
MAX_BODY_BYTES = 64 * 1024 * 1024  # long-context prompts from traces exceed aiohttp's 1 MiB
SHUTDOWN_TIMEOUT_S = 5.0  # requests are aborted at shutdown; this only bounds stragglers
WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit")

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
    blocks: tuple[str, ...]  # prefix block hashes of the prompt (empty without a cache)

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
        blocks=_prefix_blocks(config, body),
    )


def _prefix_blocks(config: MockEngineConfig, body: dict[str, Any]) -> tuple[str, ...]:
    """The prompt's blocks, cut and chained as the node does (coordinator/prefix.py)."""
    if config.prefix_cache_tokens == 0:
        return ()
    text = canonical_prompt(body)
    return tuple(block_hashes(text, ENGINE_PREFIX_KEY, config.prefix_block_chars, 1 << 20))


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
    stream = engine.submit(job.rid, job.prompt_tokens, job.output_tokens, gone, job.blocks)
    # A crash cuts the output half-way, after at least one token.
    crash_after = max(1, job.output_tokens // 2) if job.fault == "crash" else None
    try:
        if job.stream:
            return await _stream_tokens(request, job, stream, crash_after)
        return await _collect_tokens(request, job, stream, crash_after)
    finally:
        engine.finish(job.rid)


def _observe(request: web.Request, event: EngineEvent, stream: RequestStream) -> None:
    metrics = request.app[METRICS_KEY]
    seconds = max(0.0, event.at_ms - stream.arrived_ms) / 1000.0
    if event.kind == "first_token":
        metrics.ttft.observe(seconds)
    elif event.kind == "done":
        metrics.e2e.observe(seconds)


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


async def _stream_tokens(
    request: web.Request, job: _Job, stream: RequestStream, crash_after: int | None
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
    request: web.Request, job: _Job, stream: RequestStream, crash_after: int | None
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


async def control_speed(request: web.Request) -> web.Response:
    """GET/POST /control/speed: read or change the engine's speed while it runs.

    POST {"speed": S} divides the configured durations by S from the next engine
    iteration on (the one in progress keeps its end); for drift tests and demos.
    """
    config, engine = request.app[CONFIG_KEY], request.app[ENGINE_KEY]
    if request.method == "POST":
        try:
            speed = (await request.json())["speed"]
        except (ValueError, KeyError, TypeError):
            return _bad_request('expected a JSON body {"speed": <number > 0>}')
        if isinstance(speed, bool) or not isinstance(speed, int | float):
            return _bad_request("speed must be a number")
        if not (math.isfinite(speed) and speed > 0):
            return _bad_request(f"speed must be finite and > 0, got {speed}")
        engine.model.timing = config.timing(float(speed))
        request.app[SPEED_KEY][0] = float(speed)
    timing = engine.model.timing
    return web.json_response(
        {
            "speed": request.app[SPEED_KEY][0],
            "prefill_ms_per_token": timing.prefill_ms_per_token,
            "prefill_overhead_ms": timing.prefill_overhead_ms,
            "decode_base_ms": timing.decode_base_ms,
            "decode_ms_per_seq": timing.decode_ms_per_seq,
        }
    )


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
        app[REGISTRATION_KEY].append(task)  # serve() stops the engine if it fails
        yield
        task.cancel()
        # A denied registration was reported by serve(); it ends the task, not shutdown.
        with suppress(asyncio.CancelledError, RegistrationDeniedError):
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
    cache = None
    if config.prefix_cache_tokens > 0:
        cache = PrefixCache(config.prefix_cache_tokens, block_tokens(config.prefix_block_chars))
    engine = MockEngine(config.timing(), prefix_cache=cache)
    app[CONFIG_KEY] = config
    app[ENGINE_KEY] = engine
    app[METRICS_KEY] = EngineMetrics(config.model, config.max_batch)
    app[FAULTS_KEY] = FaultPicker(config)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app[SPEED_KEY] = [config.speed]
    app.router.add_get("/control/speed", control_speed)
    app.router.add_post("/control/speed", control_speed)
    app.cleanup_ctx.append(_engine_tasks)
    if config.register is not None:

        def hints() -> dict[str, float]:
            return {
                "engine_running": float(engine.model.num_running),
                "engine_waiting": float(engine.model.num_waiting),
            }

        app[REGISTRATION_KEY] = []
        app[REGISTRAR_KEY] = Registrar(
            config.register_urls,
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

    def registration(self) -> asyncio.Task[None] | None:
        """The task keeping the engine registered (None without --register)."""
        tasks = self.app.get(REGISTRATION_KEY) or []
        return tasks[0] if tasks else None

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


class MockEngineError(Exception):
    """The mock engine cannot run (port taken, registration denied); one line says why."""


async def serve(config: MockEngineConfig) -> None:
    """Run a mock engine until SIGINT or SIGTERM, then stop it cleanly.

    Raises MockEngineError when the port cannot be bound or the control plane
    refuses the engine's credentials.
    """
    try:
        running = await start_mock_engine(config)
    except OSError as exc:
        raise MockEngineError(
            f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}"
        ) from exc
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
    waits: set[asyncio.Future[Any]] = {asyncio.ensure_future(stop.wait())}
    registration = running.registration()
    if registration is not None:
        waits.add(registration)
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if registration is not None and registration.done() and not registration.cancelled():
            failure = registration.exception()
            if failure is not None:
                raise MockEngineError(
                    f"registration with {config.register} failed: {failure}"
                ) from failure
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        for wait in waits - {registration}:
            wait.cancel()
        await running.stop()


def run(args: argparse.Namespace) -> int:
    """Run the mock engine in the foreground until interrupted."""
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"mock-engine: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(config))
    except MockEngineError as exc:
        print(f"mock-engine: error: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m local_fleet.mock_engine`: the same flags as `coordinator mock-engine`."""
    return standalone_main(
        "python -m local_fleet.mock_engine",
        "Run a mock OpenAI-compatible inference engine.",
        add_arguments,
        run,
        argv,
    )


if __name__ == "__main__":
    sys.exit(main())
