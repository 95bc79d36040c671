"""The mock engine as a real aiohttp server on loopback, sped up with --speed."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from coordinator.models import InstanceSpec
from coordinator.tokens import prompt_tokens_of
from coordinator_cli.main import SUBCOMMANDS
from local_fleet.engine_model import EngineTiming
from local_fleet.mock_engine import (
    MockEngineConfig,
    RunningMockEngine,
    add_arguments,
    config_from_args,
    create_app,
    start_mock_engine,
)
from local_fleet.mock_engine import http as mock_engine
from tests.helpers import wait_for

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDLESS = "100000"  # output tokens no test waits for: the request is cut off first

StartEngine = Callable[..., Awaitable[RunningMockEngine]]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A client session with a generous overall bound."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


@pytest.fixture
async def start_engine() -> AsyncIterator[StartEngine]:
    """Factory of mock engines on free loopback ports (speed 50); stops what it starts."""
    started: list[RunningMockEngine] = []

    async def start(**overrides: Any) -> RunningMockEngine:
        values: dict[str, Any] = {"port": 0, "speed": 50.0, "seed": 1, "model": "m"}
        values.update(overrides)
        running = await start_mock_engine(MockEngineConfig(**values))
        started.append(running)
        return running

    yield start
    for running in started:
        await running.stop()


def chat_body(tokens: int | None = 8, stream: bool = False, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "How many roads must a man walk down?"}],
        "stream": stream,
    }
    if tokens is not None:
        body["max_tokens"] = tokens
    body.update(extra)
    return body


async def read_sse(resp: aiohttp.ClientResponse) -> tuple[list[dict[str, Any]], bool]:
    """All `data:` chunks of a stream and whether it ended with [DONE] (and nothing after)."""
    chunks: list[dict[str, Any]] = []
    done = False
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line:
            continue
        assert line.startswith("data: "), line
        assert not done, f"data after [DONE]: {line}"
        payload = line.removeprefix("data: ")
        if payload == "[DONE]":
            done = True
        else:
            chunks.append(json.loads(payload))
    return chunks, done


async def next_chunk(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    """The next `data:` chunk of a stream."""
    while True:
        raw = await resp.content.readline()
        assert raw, "stream ended"
        line = raw.decode().strip()
        if line.startswith("data: "):
            return dict(json.loads(line.removeprefix("data: ")))


def content_of(chunk: dict[str, Any]) -> str | None:
    if not chunk["choices"]:
        return None
    choice = chunk["choices"][0]
    text = choice["delta"].get("content") if "delta" in choice else choice.get("text")
    return str(text) if text else None


async def metric(http: aiohttp.ClientSession, url: str, name: str, model: str = "m") -> float:
    """One sample of the engine's /metrics."""
    async with http.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    pattern = rf'^{re.escape(name)}\{{model_name="{re.escape(model)}"\}} (\S+)$'
    match = re.search(pattern, text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def running_is(http: aiohttp.ClientSession, url: str, n: float) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await metric(http, url, "vllm:num_requests_running") == n

    return check


# ---------------------------------------------------------------------------
# Serving.


async def test_streaming_chat_chunks_count_usage_and_done(
    start_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    eng = await start_engine()
    body = chat_body(24, stream=True, stream_options={"include_usage": True})
    async with http.post(f"{eng.url}{CHAT}", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        chunks, done = await read_sse(resp)
    assert done
    contents = [c for c in map(content_of, chunks) if c]
    assert len(contents) == 24
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:] if c["choices"])
    final, usage = chunks[-2], chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length"
    assert final["choices"][0]["delta"] == {}
    assert usage["choices"] == []
    prompt = prompt_tokens_of(body)
    assert usage["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": 24,
        "total_tokens": prompt + 24,
    }
    assert len({c["id"] for c in chunks}) == 1


async def test_streaming_completions_without_usage(
    start_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    eng = await start_engine()
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 50, "stream": True}
    headers = {"X-Mock-Output-Tokens": "9"}
    async with http.post(f"{eng.url}{COMPLETIONS}", json=body, headers=headers) as resp:
        assert resp.status == 200
        chunks, done = await read_sse(resp)
    assert done
    assert all(c["object"] == "text_completion" for c in chunks)
    assert all("usage" not in c for c in chunks)
    assert len([c for c in map(content_of, chunks) if c]) == 9
    # The forced length is shorter than max_tokens: a natural stop.
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_stream_is_incremental(
    start_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    eng = await start_engine()
    headers = {"X-Mock-Output-Tokens": ENDLESS}
    async with http.post(f"{eng.url}{CHAT}", json=chat_body(None, True), headers=headers) as resp:
        received = [await next_chunk(resp) for _ in range(3)]
        # The client holds chunks of a stream the engine is still generating.
        assert eng.engine.model.num_running == 1
        assert eng.engine.active_requests == 1
    assert [content_of(c) for c in received] == ["lorem", " ipsum", " dolor"]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_non_streaming_returns_usage(
    start_engine: StartEngine, http: aiohttp.ClientSession, path: str
) -> None:
    eng = await start_engine()
    body = chat_body(6) if path == CHAT else {"prompt": "abcdefgh" * 5, "max_tokens": 6}
    async with http.post(f"{eng.url}{path}", json=body) as resp:
        assert resp.status == 200
        data = await resp.json()
    prompt = prompt_tokens_of(body)
    assert data["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": 6,
        "total_tokens": prompt + 6,
    }
    choice = data["choices"][0]
    text = choice["message"]["content"] if path == CHAT else choice["text"]
    assert len(text.split()) == 6
    assert choice["finish_reason"] == "length"
    assert data["object"] == ("chat.completion" if path == CHAT else "text_completion")
    assert data["model"] == "m"


async def test_output_length_defaults_and_header_override(
    start_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    eng = await start_engine(default_output_tokens=5)
    async with http.post(f"{eng.url}{CHAT}", json=chat_body(None)) as resp:
        assert (await resp.json())["usage"]["completion_tokens"] == 5
    headers = {"X-Mock-Output-Tokens": "3"}
    async with http.post(f"{eng.url}{CHAT}", json=chat_body(40), headers=headers) as resp:
        data = await resp.json()
    assert data["usage"]["completion_tokens"] == 3
    assert data["choices"][0]["finish_reason"] == "stop"


async def test_concurrent_requests_all_complete(
    start_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    eng = await start_engine(max_batch=3)

    async def one(i: int) -> int:
        body = chat_body(5 + i, stream=True)
        async with http.post(f"{eng.url}{CHAT}", json=body) as resp:
            chunks, done = await read_sse(resp)
        assert done
        return len([c for c in map(content_of, chunks) if c])

    counts = await asyncio.gather(*(one(i) for i in range(8)))
    assert counts == [5 + i for i in range(8)]
    assert eng.engine.model.num_running == 0 and eng.engine.model.num_waiting == 0
    assert eng.engine.active_requests == 0


@pytest.mark.parametrize(
    ("path", "data", "headers", "message"),
    [
        (CHAT, b"{not json", {}, "not valid JSON"),
        (CHAT, b"[1, 2]", {}, "JSON object"),
        (CHAT, b'{"prompt": "x"}', {}, "messages"),
        (COMPLETIONS, b'{"messages": []}', {}, "prompt"),
        (CHAT, json.dumps(chat_body()).encode(), {"X-Mock-Output-Tokens": "0"}, "positive"),
        (CHAT, json.dumps(chat_body()).encode(), {"X-Mock-Fault": "boom"}, "X-Mock-Fault"),
    ],
)
async def test_bad_requests_get_400_openai_error(
    start_engine: StartEngine,
    http: aiohttp.ClientSession,
    path: str,
    data: bytes,
    headers: dict[str, str],
    message: str,
) -> None:
    eng = await start_engine()
    headers = {"Content-Type": "application/json", **headers}
    async with http.post(f"{eng.url}{path}", data=data, headers=headers) as resp:
        assert resp.status == 400
        body = await resp.json()
    assert body["error"]["type"] == "invalid_request_error"
    assert message in body["error"]["message"]
    assert eng.engine.active_requests == 0


async def test_models_and_health(start_engine: StartEngine, http: aiohttp.ClientSession) -> None:
    eng = await start_engine(model="llama-mock")
    async with http.get(f"{eng.url}/v1/models") as resp:
        models = await resp.json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["llama-mock"]
    async with http.get(f"{eng.url}/health") as resp:
        assert resp.status == 200
        assert await resp.json() == {"status": "ok"}


async def test_metrics_names_and_running_request(
    start_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    eng = await start_engine(max_batch=4)
    async with http.get(f"{eng.url}/metrics") as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:gpu_cache_usage_perc",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert f'{name}{{model_name="m"' in text or f'{name}{{le="' in text, name
    assert await metric(http, eng.url, "vllm:num_requests_running") == 0
    assert await metric(http, eng.url, "vllm:time_to_first_token_seconds_count") == 0

    async with http.post(f"{eng.url}{CHAT}", json=chat_body(3)) as resp:
        assert resp.status == 200
    assert await metric(http, eng.url, "vllm:time_to_first_token_seconds_count") == 1
    assert await metric(http, eng.url, "vllm:e2e_request_latency_seconds_count") == 1

    headers = {"X-Mock-Output-Tokens": ENDLESS}
    pending = asyncio.create_task(http.post(f"{eng.url}{CHAT}", json=chat_body(), headers=headers))
    try:
        await wait_for(running_is(http, eng.url, 1), what="running == 1")
        assert await metric(http, eng.url, "vllm:gpu_cache_usage_perc") == 0.25
        assert await metric(http, eng.url, "vllm:num_requests_waiting") == 0
    finally:
        pending.cancel()
        with suppress(asyncio.CancelledError):
            await pending
    # A non-streaming client that leaves is noticed although nothing is written to it.
    await wait_for(running_is(http, eng.url, 0), what="running back to 0")
    await wait_for(lambda: eng.engine.active_requests == 0, what="stream forgotten")


async def test_prefix_cache_counts_hits_under_vllm_names(
    start_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    eng = await start_engine(prefix_cache_tokens=100_000, prefix_block_chars=64)
    system = {"role": "system", "content": "You are a careful assistant. " * 40}
    turn1 = chat_body(2, messages=[system, {"role": "user", "content": "first question"}])
    turn2 = chat_body(2, messages=[system, {"role": "user", "content": "another one"}])
    for body in (turn1, turn2):
        async with http.post(f"{eng.url}{CHAT}", json=body) as resp:
            assert resp.status == 200
    queries = await metric(http, eng.url, "vllm:prefix_cache_queries_total")
    hits = await metric(http, eng.url, "vllm:prefix_cache_hits_total")
    assert queries == prompt_tokens_of(turn1) + prompt_tokens_of(turn2)
    # The second turn found the system prompt's whole blocks (16 tokens each).
    shared_blocks = (len("system") + 1 + len(system["content"]) + 1) // 64
    assert hits == shared_blocks * 16
    cache = eng.engine.model.prefix_cache
    assert cache is not None and (cache.queries, cache.hits) == (queries, hits)


async def test_without_a_prefix_cache_the_counters_stay_zero(
    start_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    eng = await start_engine()
    for _ in range(2):
        async with http.post(f"{eng.url}{CHAT}", json=chat_body(2)) as resp:
            assert resp.status == 200
    assert await metric(http, eng.url, "vllm:prefix_cache_hits_total") == 0
    assert eng.engine.model.prefix_cache is None


async def test_two_apps_have_separate_registries() -> None:
    a = create_app(MockEngineConfig(port=0, model="a"))
    b = create_app(MockEngineConfig(port=0, model="b"))
    assert a[mock_engine.METRICS_KEY].registry is not b[mock_engine.METRICS_KEY].registry


# ---------------------------------------------------------------------------
# Client disconnects and faults.


async def test_streaming_disconnect_cancels_the_sequence(
    start_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    eng = await start_engine()
    headers = {"X-Mock-Output-Tokens": ENDLESS}
    resp = await http.post(f"{eng.url}{CHAT}", json=chat_body(None, True), headers=headers)
    await next_chunk(resp)
    assert await metric(http, eng.url, "vllm:num_requests_running") == 1
    resp.close()  # drop the connection mid-stream
    await wait_for(running_is(http, eng.url, 0), what="sequence cancelled")
    # The iteration the cancel fell into still ends (as a GPU step would); after it the
    # engine is idle: no phantom work left. (Asserting idle at once failed whenever the
    # cancel landed mid-iteration.)
    model = eng.engine.model
    await wait_for(lambda: model.next_event_ms() is None, what="the engine to go idle")
    assert eng.engine.active_requests == 0


async def test_disconnect_during_prefill_leaves_no_phantom_decode(
    start_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    # A 300 ms prefill: the client leaves while its sequence is being prefilled.
    eng = await start_engine(speed=1.0, prefill_overhead_ms=300.0)
    headers = {"X-Mock-Output-Tokens": ENDLESS}
    pending = asyncio.create_task(http.post(f"{eng.url}{CHAT}", json=chat_body(), headers=headers))
    await wait_for(lambda: eng.engine.model.num_running == 1, what="prefill started")
    pending.cancel()
    with suppress(asyncio.CancelledError):
        await pending
    await wait_for(lambda: eng.engine.model.num_running == 0, what="orphan cancelled")
    # At most the decode step already begun completes, empty; then the engine idles.
    await wait_for(lambda: eng.engine.model.next_event_ms() is None, what="engine idle")
    assert eng.engine.model.num_running == 0


async def test_forced_error(start_engine: StartEngine, http: aiohttp.ClientSession) -> None:
    eng = await start_engine()
    headers = {"X-Mock-Fault": "error"}
    async with http.post(f"{eng.url}{CHAT}", json=chat_body(4, True), headers=headers) as resp:
        assert resp.status == 500
        body = await resp.json()
    assert body["error"]["message"]
    assert eng.engine.model.next_event_ms() is None


async def test_forced_hang_until_client_timeout(
    start_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    eng = await start_engine()
    headers = {"X-Mock-Fault": "hang"}
    with pytest.raises(TimeoutError):
        await http.post(
            f"{eng.url}{CHAT}",
            json=chat_body(4),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=0.3),
        )
    assert eng.engine.model.num_running == 0  # a hang never reaches the model
    await wait_for(lambda: eng.engine.active_requests == 0, what="hung request released")


async def test_hang_ends_when_the_server_stops(
    start_engine: StartEngine, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Far beyond the wait below: the request must end by itself, not by aiohttp's timeout.
    monkeypatch.setattr(mock_engine, "SHUTDOWN_TIMEOUT_S", 600.0)
    eng = await start_engine()
    pending = asyncio.create_task(
        http.post(f"{eng.url}{CHAT}", json=chat_body(4), headers={"X-Mock-Fault": "hang"})
    )
    await wait_for(lambda: eng.engine.active_requests == 1, what="request parked")
    await asyncio.wait_for(eng.stop(), timeout=10)
    with pytest.raises(aiohttp.ClientError):
        await pending


async def test_forced_crash_truncates_the_stream(
    start_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    eng = await start_engine()
    headers = {"X-Mock-Fault": "crash"}
    chunks: list[dict[str, Any]] = []
    saw_done = False
    async with http.post(f"{eng.url}{CHAT}", json=chat_body(20, True), headers=headers) as resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            async for raw in resp.content:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    saw_done = True
                elif line.startswith("data: "):
                    chunks.append(json.loads(line.removeprefix("data: ")))
    assert not saw_done
    assert 1 <= len(chunks) < 20
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    await wait_for(lambda: eng.engine.model.next_event_ms() is None, what="crash cleaned up")


async def test_forced_crash_without_streaming_drops_the_connection(
    start_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    eng = await start_engine()
    with pytest.raises(aiohttp.ClientError):
        async with http.post(
            f"{eng.url}{CHAT}", json=chat_body(8), headers={"X-Mock-Fault": "crash"}
        ) as resp:
            await resp.read()
    await wait_for(lambda: eng.engine.active_requests == 0, what="crash cleaned up")


async def test_random_faults_follow_the_seed(
    start_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    async def statuses(eng: RunningMockEngine) -> list[int]:
        out = []
        for _ in range(16):
            async with http.post(f"{eng.url}{CHAT}", json=chat_body(2)) as resp:
                out.append(resp.status)
        return out

    first = await statuses(await start_engine(seed=7, error_rate=0.5))
    second = await statuses(await start_engine(seed=7, error_rate=0.5))
    assert first == second
    assert set(first) == {200, 500}
    always = await statuses(await start_engine(seed=3, error_rate=1.0))
    assert set(always) == {500}


# ---------------------------------------------------------------------------
# Self-registration against a fake control plane.


class FakeControlPlane:
    """Records the control-plane calls an engine makes; answers like the real one."""

    def __init__(
        self,
        heartbeat_interval_s: float = 0.05,
        token: str | None = None,
        epochs: dict[str, int] | None = None,
    ) -> None:
        self.heartbeat_interval_s = heartbeat_interval_s
        self.token = token
        self.registrations: list[dict[str, Any]] = []
        self.heartbeats: list[tuple[str, dict[str, Any]]] = []
        self.deletes: list[str] = []
        # The registry: control planes given one dict serve one pool, as nodes do.
        self.epochs: dict[str, int] = {} if epochs is None else epochs
        self.unauthorized = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    def _authorized(self, request: web.Request) -> bool:
        if self.token is None:
            return True
        ok = request.headers.get("Authorization") == f"Bearer {self.token}"
        self.unauthorized += 0 if ok else 1
        return ok

    async def register(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": "unauthorized"}, status=401)
        body = await request.json()
        self.registrations.append(body)
        spec = InstanceSpec.from_dict(body)  # what the real control plane validates
        self.epochs[spec.id] = spec.epoch or 1
        answer = {
            "instance_id": spec.id,
            "epoch": self.epochs[spec.id],
            "heartbeat_interval_s": self.heartbeat_interval_s,
            "ttl_s": 10 * self.heartbeat_interval_s,
        }
        return web.json_response(answer, status=201)

    async def heartbeat(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": "unauthorized"}, status=401)
        instance_id = request.match_info["id"]
        self.heartbeats.append((instance_id, await request.json()))
        if instance_id not in self.epochs:
            return web.json_response({"error": "unknown instance"}, status=404)
        return web.json_response({"epoch": self.epochs[instance_id]})

    async def unregister(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": "unauthorized"}, status=401)
        instance_id = request.match_info["id"]
        self.deletes.append(instance_id)
        self.epochs.pop(instance_id, None)
        return web.json_response({"voided": 0})

    def forget(self, instance_id: str) -> None:
        """Lose an instance, as a restarted control plane would."""
        self.epochs.pop(instance_id, None)

    async def start(self, port: int = 0) -> None:
        app = web.Application()
        app.router.add_post("/v1/instances", self.register)
        app.router.add_post("/v1/instances/{id}/heartbeat", self.heartbeat)
        app.router.add_delete("/v1/instances/{id}", self.unregister)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


@pytest.fixture
async def control_plane() -> AsyncIterator[FakeControlPlane]:
    plane = FakeControlPlane(token="s3cret")
    await plane.start()
    yield plane
    await plane.stop()


async def test_registration_body_heartbeats_and_hints(
    start_engine: StartEngine, http: aiohttp.ClientSession, control_plane: FakeControlPlane
) -> None:
    eng = await start_engine(
        register=control_plane.url, instance_id="eng-1", token="s3cret", speed=10.0, max_batch=8
    )
    await wait_for(lambda: len(control_plane.registrations) == 1, what="registration")
    body = control_plane.registrations[0]
    timing = EngineTiming(max_batch=8).scaled(10.0)
    assert body["id"] == "eng-1"
    assert body["url"] == eng.url == f"http://127.0.0.1:{eng.config.port}"
    assert body["role"] == "mixed"
    assert body["max_slots"] == 8
    assert body["weight"] == 1.0
    assert body["prefill_ms_per_token"] == pytest.approx(EngineTiming().prefill_ms_per_token / 10)
    assert body["prefill_overhead_ms"] == pytest.approx(EngineTiming().prefill_overhead_ms / 10)
    assert body["decode_ms_per_token"] == pytest.approx(timing.nominal_decode_ms_per_token())
    assert body["epoch"] == eng.engine.started_ms > 0
    assert body["model"] == "m"
    assert control_plane.unauthorized == 0

    await wait_for(lambda: len(control_plane.heartbeats) >= 2, what="heartbeats")
    instance_id, beat = control_plane.heartbeats[0]
    assert instance_id == "eng-1"
    assert beat == {"hints": {"engine_running": 0.0, "engine_waiting": 0.0}}

    # Hints follow the engine's load.
    headers = {"X-Mock-Output-Tokens": ENDLESS}
    resp = await http.post(f"{eng.url}{CHAT}", json=chat_body(None, True), headers=headers)
    try:
        await next_chunk(resp)
        seen = len(control_plane.heartbeats)
        await wait_for(
            lambda: any(
                b["hints"]["engine_running"] == 1.0 for _, b in control_plane.heartbeats[seen:]
            ),
            what="a heartbeat with engine_running 1",
        )
    finally:
        resp.close()


async def test_heartbeat_404_triggers_reregistration(
    start_engine: StartEngine, control_plane: FakeControlPlane
) -> None:
    await start_engine(register=control_plane.url, instance_id="eng-2", token="s3cret")
    await wait_for(lambda: len(control_plane.heartbeats) >= 1, what="first heartbeat")
    control_plane.forget("eng-2")
    await wait_for(lambda: len(control_plane.registrations) == 2, what="re-registration")
    assert control_plane.registrations[0] == control_plane.registrations[1]  # same epoch
    beats = len(control_plane.heartbeats)
    await wait_for(lambda: len(control_plane.heartbeats) > beats + 1, what="heartbeats resume")
    assert len(control_plane.registrations) == 2


async def test_stop_unregisters_and_restart_raises_the_epoch(
    start_engine: StartEngine, control_plane: FakeControlPlane
) -> None:
    options = {"register": control_plane.url, "instance_id": "eng-3", "token": "s3cret"}
    first = await start_engine(**options)
    await wait_for(lambda: len(control_plane.registrations) == 1, what="registration")
    await first.stop()
    assert control_plane.deletes == ["eng-3"]
    second = await start_engine(**options)
    await wait_for(lambda: len(control_plane.registrations) == 2, what="second registration")
    old, new = (r["epoch"] for r in control_plane.registrations)
    assert new > old
    assert new == second.engine.started_ms


async def test_control_plane_down_is_retried_with_a_warning(
    start_engine: StartEngine, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    # Reserve a port nobody listens on, so registration gets connection refused.
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    caplog.set_level(logging.WARNING, logger="proxy_node.engine_registration")
    plane = FakeControlPlane()
    try:
        eng = await start_engine(
            register=f"http://127.0.0.1:{port}",
            instance_id="eng-4",
            register_backoff_s=0.05,
            register_backoff_max_s=0.2,
        )
        await wait_for(
            lambda: any(r.levelno == logging.WARNING for r in caplog.records),
            what="a warning about the control plane",
        )
        async with http.get(f"{eng.url}/health") as resp:
            assert resp.status == 200  # the engine serves on
        holder.close()
        await plane.start(port)
        await wait_for(lambda: len(plane.registrations) == 1, what="registration after retry")
        await wait_for(lambda: len(plane.heartbeats) >= 1, what="heartbeat after retry")
    finally:
        holder.close()
        await plane.stop()


async def test_with_several_control_planes_a_dead_one_gives_way_at_once(
    start_engine: StartEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """Nodes' control planes share one registry (the pool in Redis): an engine given
    several keeps heartbeating through the next when its first dies, with the
    heartbeat that failed, not after a backoff, and without registering again."""
    caplog.set_level(logging.INFO, logger="proxy_node.engine_registration")
    pool: dict[str, int] = {}
    first, second = FakeControlPlane(epochs=pool), FakeControlPlane(epochs=pool)
    await first.start()
    await second.start()
    try:
        # A backoff this long would outlast every wait below.
        slow = {"register_backoff_s": 30.0, "register_backoff_max_s": 30.0}
        eng = await start_engine(register=f"{first.url},{second.url}", instance_id="e5", **slow)
        await wait_for(lambda: len(first.heartbeats) >= 2, what="heartbeats through the first")
        assert (second.registrations, second.heartbeats) == ([], [])
        await first.stop()
        await wait_for(lambda: len(second.heartbeats) >= 2, what="heartbeats through the second")
        assert len(first.registrations) == 1 and second.registrations == []
        said = [r.getMessage() for r in caplog.records]
        assert any(f"trying {second.url}" in line for line in said), said
        assert not any("retrying in" in line for line in said), said
        await eng.stop()
        assert second.deletes == ["e5"]  # through the one that answers
        # Started with its first control plane down: it registers through the second.
        eng = await start_engine(register=f"{first.url},{second.url}", instance_id="e6", **slow)
        await wait_for(lambda: len(second.registrations) == 1, what="registration via the second")
        await wait_for(
            lambda: any(iid == "e6" for iid, _ in second.heartbeats), what="its heartbeats"
        )
    finally:
        await first.stop()
        await second.stop()


async def test_one_control_plane_refusing_the_token_gives_way_to_the_next(
    start_engine: StartEngine,
) -> None:
    """A node with another token (misconfigured) must not stop the engine while the
    next control plane accepts it."""
    pool: dict[str, int] = {}
    wrong = FakeControlPlane(token="other", epochs=pool)
    right = FakeControlPlane(token="s3cret", epochs=pool)
    await wrong.start()
    await right.start()
    try:
        eng = await start_engine(
            register=f"{wrong.url},{right.url}", instance_id="e7", token="s3cret"
        )
        await wait_for(lambda: len(right.heartbeats) >= 2, what="heartbeats via the second")
        assert wrong.unauthorized >= 1 and wrong.registrations == []
        task = eng.registration()
        assert task is not None and not task.done()
    finally:
        await wrong.stop()
        await right.stop()


def test_register_takes_comma_separated_urls() -> None:
    config = MockEngineConfig(register="http://a:8002, http://b:8002")
    assert config.register_urls == ["http://a:8002", "http://b:8002"]
    assert MockEngineConfig().register_urls == []
    for bad in ("http://a:8002,", "http://a:8002,b:8002"):
        with pytest.raises(ValueError, match="http"):
            MockEngineConfig(register=bad)


# ---------------------------------------------------------------------------
# Configuration and command line.


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_flags_env_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    assert SUBCOMMANDS["mock-engine"][0] == "local_fleet.mock_engine"
    assert config_from_args(parse([])) == MockEngineConfig()
    monkeypatch.setenv("MOCK_ENGINE_MAX_BATCH", "7")
    monkeypatch.setenv("MOCK_ENGINE_SPEED", "4")
    monkeypatch.setenv("MOCK_ENGINE_TOKEN", "hidden")
    config = config_from_args(parse(["--speed", "9", "--decode-ms-per-token", "30"]))
    assert config.max_batch == 7  # from the environment
    assert config.speed == 9.0  # the flag wins
    assert config.decode_base_ms == 30.0
    assert config.token == "hidden"
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    assert "hidden" not in parser.format_help()
    monkeypatch.setenv("MOCK_ENGINE_MAX_BATCH", "many")
    with pytest.raises(SystemExit):
        parse([])


@pytest.mark.parametrize(
    "overrides",
    [
        {"speed": 0.0},
        {"max_batch": 0},
        {"decode_base_ms": 0.0},
        {"error_rate": 0.7, "crash_rate": 0.7},
        {"hang_rate": -0.1},
        {"default_output_tokens": 0},
        {"port": 70000},
        {"register": "ftp://x"},
    ],
)
def test_invalid_config_raises(overrides: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        MockEngineConfig(**overrides)


def test_registration_needs_a_concrete_port() -> None:
    with pytest.raises(ValueError, match="port"):
        create_app(MockEngineConfig(port=0, register="http://127.0.0.1:1"))


async def test_module_entry_point_registers_and_stops_on_sigterm(
    http: aiohttp.ClientSession,
) -> None:
    plane = FakeControlPlane()
    await plane.start()
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "local_fleet.mock_engine",
        "--port",
        str(port),
        "--register",
        plane.url,
        "--instance-id",
        "sub-1",
        "--log-level",
        "WARNING",
    )
    try:
        await wait_for(lambda: len(plane.registrations) == 1, timeout_s=20, what="registration")
        async with http.get(f"http://127.0.0.1:{port}/health") as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=15) == 0
        assert plane.deletes == ["sub-1"]
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await plane.stop()


async def test_speed_control_changes_the_engine_while_it_runs(
    start_engine: StartEngine, http: aiohttp.ClientSession
) -> None:
    running = await start_engine(speed=2.0)
    async with http.get(running.url + "/control/speed") as resp:
        assert resp.status == 200
        assert (await resp.json())["speed"] == 2.0
    async with http.post(running.url + "/control/speed", json={"speed": 0.5}) as resp:
        doc = await resp.json()
    base = EngineTiming()
    assert doc["speed"] == 0.5
    assert doc["prefill_ms_per_token"] == pytest.approx(base.prefill_ms_per_token / 0.5)
    assert running.engine.model.timing.decode_base_ms == pytest.approx(base.decode_base_ms / 0.5)
    for bad in ({"speed": 0}, {"speed": "fast"}, {"speed": float("inf")}, {}, [1]):
        async with http.post(running.url + "/control/speed", json=bad) as resp:
            assert resp.status == 400, bad
    async with http.post(running.url + "/control/speed", data=b"{") as resp:
        assert resp.status == 400
    assert running.engine.model.timing.prefill_ms_per_token == pytest.approx(
        base.prefill_ms_per_token / 0.5
    )


def test_registered_timing_can_be_none_or_another_speed() -> None:
    own = MockEngineConfig(port=9, speed=2.0).instance_spec(1)
    assert own.prefill_ms_per_token == pytest.approx(EngineTiming().prefill_ms_per_token / 2)
    bare = MockEngineConfig(port=9, speed=2.0, register_timing="none").instance_spec(1)
    assert not bare.has_timing
    shared = MockEngineConfig(port=9, speed=2.0, register_speed=1.0).instance_spec(1)
    assert shared.prefill_ms_per_token == pytest.approx(EngineTiming().prefill_ms_per_token)
    with pytest.raises(ValueError):
        MockEngineConfig(register_timing="guess")
    with pytest.raises(ValueError):
        MockEngineConfig(register_speed=0.0)
