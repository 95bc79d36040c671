"""The mock engine's model in real time: the shared EngineModel on a monotonic clock,
one event queue per request, vLLM-named metrics and fault draws."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from local_fleet.engine_model import EngineEvent, EngineModel, EngineTiming, PrefixCache
from local_fleet.mock_engine.config import MockEngineConfig

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.1  # how often parked requests are checked for a gone client
# vLLM's own bucket boundaries, so dashboards built for vLLM read the mock unchanged.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

# ---------------------------------------------------------------------------
# The engine: the shared model on a monotonic clock, one event queue per request.


@dataclass(slots=True)
class RequestStream:
    queue: asyncio.Queue[EngineEvent | None]  # None = abort (client gone, server stopping)
    gone: Callable[[], bool]  # whether the client has disconnected
    arrived_ms: float
    in_model: bool  # False for a parked (hanging) request
    done: bool = False


class MockEngine:
    """An EngineModel driven in real (monotonic) time, fanning events out per request."""

    def __init__(
        self,
        timing: EngineTiming,
        clock: Callable[[], float] = time.monotonic,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.model = EngineModel(timing, prefix_cache)
        self.started_ms = time.time_ns() // 1_000_000  # registration epoch: rises on restart
        self._clock = clock
        self._t0 = clock()
        self._streams: dict[str, RequestStream] = {}
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
        self,
        rid: str,
        prompt_tokens: int,
        output_tokens: int,
        gone: Callable[[], bool],
        blocks: tuple[str, ...] = (),
    ) -> RequestStream:
        """Queue a request in the model; its events arrive on the returned stream's queue."""
        now = self.now_ms()
        stream = RequestStream(asyncio.Queue(), gone, now, in_model=True)
        self._streams[rid] = stream
        if self.closed:
            stream.queue.put_nowait(None)
            return stream
        self._dispatch(self.model.advance(now))  # the model needs time in order
        self.model.submit(rid, prompt_tokens, output_tokens, now, blocks)
        self._wake.set()
        return stream

    def park(self, rid: str, gone: Callable[[], bool]) -> RequestStream:
        """Hold a request outside the model; its queue only ever receives the abort."""
        stream = RequestStream(asyncio.Queue(), gone, self.now_ms(), in_model=False)
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
        # vLLM v1's prefix cache counters, in tokens (exposed with the _total suffix).
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels,
            registry=reg,
        ).labels(model_name)
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            labels,
            registry=reg,
        ).labels(model_name)
        self._prefix_seen = (0, 0)

    def render(self, model: EngineModel) -> bytes:
        """The text exposition, with the gauges read from the model now."""
        cache = model.prefix_cache
        if cache is not None:
            queries, hits = self._prefix_seen
            self.prefix_queries.inc(cache.queries - queries)
            self.prefix_hits.inc(cache.hits - hits)
            self._prefix_seen = (cache.queries, cache.hits)
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
