"""A minimal OpenAI-ish engine for proxy tests, and a harness that runs nodes on loopback.

The engine streams `chunks` SSE chunks with a per-chunk delay, and can be told to
answer an error status, to cut the connection mid-stream, to hang, or to hold at a
gate (an asyncio.Event) after some chunks. It counts what it receives.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from redis.asyncio import Redis

from coordinator import Coordinator, Settings
from proxy_node.app import create_app, create_control_app
from proxy_node.config import NodeConfig
from tests.helpers import counters, delete_pool, live_reservations


@dataclass
class FakeEngine:
    """An engine on 127.0.0.1; every knob may be changed while it runs."""

    chunks: int = 3  # content chunks of a streamed answer (= completion tokens)
    delay_s: float = 0.0  # sleep before each chunk
    status: int = 200  # anything else: answer this status with `error_body`
    error_body: bytes = b'{"error":{"message":"nope","type":"invalid_request_error","code":"fake"}}'
    error_headers: dict[str, str] = field(default_factory=dict)  # sent with `status`
    crash_after: int | None = None  # cut the connection after this many chunks
    fail_every: int = 0  # answer every n-th completion request 500 (0: none)
    hang: bool = False  # read the request and never answer (until stop)
    raw_body: bytes | None = None  # answer 200 with exactly these bytes (b"": empty body)
    omit_done: bool = False  # end a stream cleanly but without its final chunk and [DONE]
    compress: bool = False  # compress answers as the request's Accept-Encoding allows
    error_event: bytes | None = None  # a stream's last event before [DONE] (vLLM's error)
    gate_after: int | None = None  # chunks sent before waiting for `gate` (None: no gate)
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    model: str = "fake-model"
    metrics_text: str = ""  # served at /metrics
    requests: int = 0  # completion requests received
    active: int = 0  # completion requests being answered now
    completed: int = 0  # answers written to the end
    request_ids: list[str] = field(default_factory=list)
    scraped_by: list[str] = field(default_factory=list)  # X-Node-Id of each /metrics read
    bodies: list[bytes] = field(default_factory=list)
    url: str = ""
    _runner: web.AppRunner | None = None
    _stopping: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self) -> FakeEngine:
        """Listen on a free loopback port."""
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        """Release every held request and stop listening."""
        self._stopping.set()
        self.gate.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _wait(self, request: web.Request, event: asyncio.Event) -> None:
        """Wait for `event`, for stop, or for the caller to hang up (like vLLM's abort)."""
        waiters = [
            asyncio.ensure_future(event.wait()),
            asyncio.ensure_future(self._stopping.wait()),
            asyncio.ensure_future(_hung_up(request)),
        ]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "fake"}]}
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        self.scraped_by.append(request.headers.get("X-Node-Id", ""))
        return web.Response(text=self.metrics_text, content_type="text/plain")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.requests += 1
        self.request_ids.append(request.headers.get("X-Request-Id", ""))
        self.bodies.append(raw)
        self.active += 1
        try:
            return await self._answer(request, json.loads(raw))
        except ConnectionError:  # the proxy went away (client disconnect, timeout)
            return web.Response(status=499)
        finally:
            self.active -= 1

    async def _answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if self.hang:
            await self._wait(request, self._stopping)
            return web.Response(status=503)
        failing = self.fail_every > 0 and self.requests % self.fail_every == 0
        if self.status != 200 or failing:
            return web.Response(
                status=500 if failing else self.status,
                body=self.error_body,
                content_type="application/json",
                headers=self.error_headers,
            )
        if self.raw_body is not None:
            return web.Response(body=self.raw_body, content_type="application/json")
        chat = request.path.endswith("/chat/completions")
        if not body.get("stream"):
            if self.gate_after is not None:
                await self._wait(request, self.gate)
            for _ in range(self.chunks):
                await asyncio.sleep(self.delay_s)
            self.completed += 1
            answer = web.json_response(self._full(chat))
            if self.compress:
                answer.enable_compression()
            return answer
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        if self.compress:
            response.enable_compression()
        await response.prepare(request)
        for i in range(self.chunks):
            if self.crash_after is not None and i >= self.crash_after:
                return self._crash(request, response)
            if self.gate_after is not None and i == self.gate_after:
                await self._wait(request, self.gate)
            await asyncio.sleep(self.delay_s)
            await response.write(_sse(self._chunk(chat, i)))
        if self.crash_after is not None and self.crash_after >= self.chunks:
            return self._crash(request, response)
        if self.omit_done:
            await response.write_eof()
            return response
        if self.error_event is not None:
            await response.write(b"data: " + self.error_event + b"\n\n")
        else:
            await response.write(_sse(self._chunk(chat, None)))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        self.completed += 1
        return response

    def _crash(self, request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
        response.force_close()
        if request.transport is not None:
            request.transport.close()
        return response

    def _chunk(self, chat: bool, i: int | None) -> dict[str, Any]:
        choice: dict[str, Any]
        if chat:
            delta = {"content": f"t{i} "} if i is not None else {}
            choice = {
                "index": 0,
                "delta": delta,
                "finish_reason": None if i is not None else "stop",
            }
        else:
            text = f"t{i} " if i is not None else ""
            choice = {"index": 0, "text": text, "finish_reason": None if i is not None else "stop"}
        chunk: dict[str, Any] = {
            "id": "fake-1",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
        }
        if i is None:
            chunk["usage"] = self._usage()
        return chunk

    def _usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": 1,
            "completion_tokens": self.chunks,
            "total_tokens": self.chunks + 1,
        }

    def _full(self, chat: bool) -> dict[str, Any]:
        text = "".join(f"t{i} " for i in range(self.chunks))
        choice: dict[str, Any]
        if chat:
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
        else:
            choice = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
        return {
            "id": "fake-1",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": self._usage(),
        }


async def _hung_up(request: web.Request) -> None:
    while True:  # aiohttp signals a vanished client to nobody: poll, as the proxy does
        transport = request.transport
        if transport is None or transport.is_closing():
            return
        await asyncio.sleep(0.02)


def _sse(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


@dataclass
class NodeServer:
    """A running proxy node: both planes on free loopback ports."""

    coordinator: Coordinator
    config: NodeConfig
    url: str
    control_url: str
    app: web.Application
    runners: list[web.AppRunner]


class Harness:
    """Starts engines, coordinators and nodes for one test; `close()` stops them all."""

    def __init__(self, redis_url: str, pool: str) -> None:
        self.redis_url = redis_url
        self.pool = pool
        self.engines: list[FakeEngine] = []
        self.coordinators: list[Coordinator] = []
        self.nodes: list[NodeServer] = []
        self._http: aiohttp.ClientSession | None = None

    @property
    def http(self) -> aiohttp.ClientSession:
        """A client session for the test's own requests."""
        if self._http is None:
            self._http = aiohttp.ClientSession()
        return self._http

    async def engine(self, **knobs: Any) -> FakeEngine:
        """A started fake engine."""
        engine = await FakeEngine(**knobs).start()
        self.engines.append(engine)
        return engine

    async def coordinator(self, node_id: str | None = None, **settings: Any) -> Coordinator:
        """A coordinator on the test pool (no background task until a node starts it)."""
        settings.setdefault("redis_timeout_ms", 1000)
        coordinator = await Coordinator.connect(
            self.redis_url,
            pool=self.pool,
            node_id=node_id,
            settings=Settings(**settings),
            background=False,
        )
        self.coordinators.append(coordinator)
        return coordinator

    async def node(self, coordinator: Coordinator | None = None, **config: Any) -> NodeServer:
        """A node serving both planes; its coordinator is made unless one is given."""
        coordinator = coordinator or await self.coordinator()
        config.setdefault("scrape_interval_s", 0.0)
        cfg = NodeConfig(
            redis_url=self.redis_url,
            pool=self.pool,
            port=0,
            control_port=0,
            settings=coordinator.settings,
            **config,
        )
        app = create_app(cfg, coordinator)
        runners = []
        urls = []
        for application in (app, None):
            runner = web.AppRunner(
                application if application is not None else create_control_app(app),
                shutdown_timeout=1.0,
            )
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
        node = NodeServer(coordinator, cfg, urls[0], urls[1], app, runners)
        self.nodes.append(node)
        return node

    async def close(self) -> None:
        """Stop nodes, then engines; delete the pool's keys; close coordinators.

        Each step is bounded: a teardown that hangs (seen about once in 30 runs of a
        node with a 50 ms hint scraper, cause not found yet) is reported on stderr
        instead of stalling the suite until the per-test timeout.
        """
        for node in self.nodes:
            for runner in reversed(node.runners):
                await _bounded(runner.cleanup(), f"stopping node {node.url}")
        for engine in self.engines:
            await _bounded(engine.stop(), "stopping an engine")
        if self._http is not None:
            await _bounded(self._http.close(), "closing the test HTTP session")
        client = Redis.from_url(self.redis_url, decode_responses=True, socket_timeout=1)
        try:
            await delete_pool(client, "lc", self.pool)
        except Exception:  # a private server may be gone already
            pass
        finally:
            await client.aclose()
        for coordinator in self.coordinators:
            await _bounded(coordinator.close(), "closing a coordinator")


async def _bounded(step: Awaitable[None], what: str, timeout_s: float = 10.0) -> None:
    try:
        await asyncio.wait_for(step, timeout_s)
    except TimeoutError:
        print(f"teardown: {what} took over {timeout_s} s; abandoned", file=sys.stderr)


async def settled(coordinator: Coordinator) -> bool:
    """True when no reservation is left and every counter of the pool is 0."""
    stored = await counters(coordinator)
    return not await live_reservations(coordinator) and all(
        v == 0 for column in stored.values() for v in column.values()
    )
