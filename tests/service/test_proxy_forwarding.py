"""The service plane: pass-through, streaming, release on every path, bad input."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from coordinator import InstanceSpec
from local_fleet.embedded import free_port
from proxy_node import app as app_module
from tests.fake_engine import FakeEngine, Harness, NodeServer, settled
from tests.helpers import counters, wait_for

pytestmark = pytest.mark.timeout(30)

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello there"}]}


async def node_with(
    harness: Harness, *engines: FakeEngine, timing: bool = False, **config: Any
) -> NodeServer:
    node = await harness.node(**config)
    for i, engine in enumerate(engines):
        extra: dict[str, Any] = {}
        if timing:
            extra = {
                "prefill_ms_per_token": 0.1,
                "prefill_overhead_ms": 50.0,
                "decode_ms_per_token": 1.0,
            }
        await node.coordinator.register_instance(InstanceSpec(id=f"e{i}", url=engine.url, **extra))
    return node


async def post(
    harness: Harness, node: NodeServer, body: Any, path: str = "/v1/chat/completions", **kw: Any
) -> aiohttp.ClientResponse:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return await harness.http.post(node.url + path, data=data, **kw)


async def assert_settled(node: NodeServer) -> None:
    await wait_for(lambda: settled(node.coordinator), what="every counter back to 0")


async def metric(harness: Harness, url: str, name: str, **labels: str) -> float:
    """The value of one sample of a node's /metrics (0.0 when absent)."""
    async with harness.http.get(url + "/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return 0.0


async def test_streaming_chunks_arrive_incrementally(harness: Harness) -> None:
    engine = await harness.engine(chunks=4, gate_after=1)
    node = await node_with(harness, engine)
    resp = await post(harness, node, {**CHAT, "stream": True}, headers={"X-Request-Id": "client-1"})
    async with resp:
        assert resp.status == 200
        assert resp.headers["X-Instance-Id"] == "e0"
        assert resp.headers["X-Request-Id"] == "client-1"
        # No timing registered: the documented default timing predicts until learned.
        assert int(resp.headers["X-Predicted-TTFT-Ms"]) >= 0
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
        # The engine is still held at its gate: the chunk was relayed, not buffered.
        assert b"t0" in first and engine.completed == 0
        await wait_for(
            lambda: _decode_count(node, "e0", 1), what="first token marked on the first chunk"
        )
        engine.gate.set()
        rest = await resp.read()
    events = [e for e in (first + rest).split(b"\n\n") if e]
    assert len(events) == 4 + 2  # content chunks, the final chunk, [DONE]
    assert events[-1] == b"data: [DONE]"
    assert engine.request_ids == ["client-1"]
    # The final chunk's usage taught the pool this model's output length.
    await node.coordinator.sync_timing()
    assert node.coordinator.expected_output_tokens("fake-model") == 4
    await assert_settled(node)


async def _decode_count(node: NodeServer, instance: str, n: int) -> bool:
    return (await counters(node.coordinator))["active_decode"].get(instance) == n


async def test_non_streaming_round_trip_marks_first_token_at_prediction(harness: Harness) -> None:
    engine = await harness.engine(chunks=5, gate_after=0)
    node = await node_with(harness, engine, timing=True)
    pending = asyncio.create_task(
        post(harness, node, CHAT, headers={"X-Request-Id": "not a valid id!"})
    )
    # Held by the engine, the reservation still moves to decode at the predicted TTFT.
    await wait_for(lambda: _decode_count(node, "e0", 1), what="first token at predicted time")
    assert not pending.done()
    engine.gate.set()
    async with await pending as resp:
        assert resp.status == 200
        doc = await resp.json()
        predicted = resp.headers["X-Predicted-TTFT-Ms"]
        rid = resp.headers["X-Request-Id"]
    assert doc["choices"][0]["message"]["content"] == "t0 t1 t2 t3 t4 "
    assert doc["usage"]["completion_tokens"] == 5
    assert int(predicted) >= 50  # the prefill overhead of the timing model
    assert re.fullmatch(r"[0-9a-f]{32}", rid) and engine.request_ids == [rid]
    assert json.loads(engine.bodies[0]) == CHAT  # forwarded unchanged
    await assert_settled(node)


async def test_instance_without_timing_model_round_trip_logs_no_error(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    engine = await harness.engine()
    node = await node_with(harness, engine)  # like a static --instance: no timing model
    for stream in (True, False):
        async with await post(harness, node, {**CHAT, "stream": stream}) as resp:
            assert resp.status == 200
            await resp.read()
    # The default timing predicts (README "Prediction sources"): the streamed request's
    # first token is compared with it; the non-streamed one has no first token to time.
    name = "proxy_ttft_prediction_relative_error_count"
    assert await metric(harness, node.url, name, instance="e0") == 1
    await assert_settled(node)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []


async def test_completions_endpoint_and_models(harness: Harness) -> None:
    engine = await harness.engine(chunks=2)
    node = await node_with(harness, engine)
    async with await post(
        harness, node, {"model": "fake-model", "prompt": "hi", "stream": True}, "/v1/completions"
    ) as resp:
        assert resp.status == 200
        assert b'"text": "t1 "' in await resp.read()
    async with harness.http.get(node.url + "/v1/models") as resp:
        assert resp.status == 200
        assert [m["id"] for m in (await resp.json())["data"]] == ["fake-model"]
    await assert_settled(node)


async def test_release_on_client_disconnect_mid_stream(harness: Harness) -> None:
    engine = await harness.engine(chunks=4, gate_after=1)
    node = await node_with(harness, engine)
    resp = await post(harness, node, {**CHAT, "stream": True})
    assert resp.status == 200
    await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
    assert (await counters(node.coordinator))["inflight"]["e0"] == 1
    resp.close()  # the client goes away while the engine is still generating
    await assert_settled(node)
    assert (
        await metric(harness, node.url, "proxy_request_outcomes_total", outcome="client_disconnect")
        == 1
    )


async def test_release_on_client_disconnect_while_waiting_for_the_answer(
    harness: Harness,
) -> None:
    engine = await harness.engine(gate_after=0)  # holds non-streaming answers
    node = await node_with(harness, engine)
    pending = asyncio.create_task(post(harness, node, CHAT))
    await wait_for(lambda: engine.active == 1, what="the engine holding the request")
    assert (await counters(node.coordinator))["inflight"]["e0"] == 1
    pending.cancel()  # the client gives up before any byte of the answer
    with pytest.raises(asyncio.CancelledError):
        await pending
    await assert_settled(node)
    # The proxy dropped its upstream connection too: the engine saw the client leave.
    await wait_for(lambda: engine.active == 0, what="the engine's request ending")


async def test_release_on_engine_crash_mid_stream(harness: Harness) -> None:
    engine = await harness.engine(chunks=4, crash_after=2)
    node = await node_with(harness, engine)
    resp = await post(harness, node, {**CHAT, "stream": True})
    async with resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()  # truncated: the proxy cut the client's connection too
    await assert_settled(node)
    assert (
        await metric(harness, node.url, "proxy_request_outcomes_total", outcome="upstream_failed")
        == 1
    )


async def test_release_on_timeout_before_and_during_the_answer(harness: Harness) -> None:
    hanging = await harness.engine(hang=True)
    node = await node_with(harness, hanging, request_timeout_s=0.3)
    async with await post(harness, node, CHAT) as resp:
        assert resp.status == 504
        assert (await resp.json())["error"]["code"] == "upstream_timeout"
        assert resp.headers["X-Instance-Id"] == "e0"
    await assert_settled(node)
    hanging.hang = False
    hanging.gate_after = 1
    async with await post(harness, node, {**CHAT, "stream": True}) as resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
    await assert_settled(node)


async def test_connection_refused_is_retried_on_another_instance(harness: Harness) -> None:
    live = await harness.engine()
    node = await harness.node()
    await node.coordinator.register_instance(
        InstanceSpec(id="dead", url=f"http://127.0.0.1:{free_port()}")
    )
    await node.coordinator.register_instance(InstanceSpec(id="live", url=live.url))
    for stream in (False, True, False, True):
        async with await post(harness, node, {**CHAT, "stream": stream}) as resp:
            assert resp.status == 200
            assert resp.headers["X-Instance-Id"] == "live"
            await resp.read()
    # Ties between the two idle instances rotate, so the dead one was chosen first at least once.
    assert await metric(harness, node.url, "proxy_upstream_connect_retries_total") >= 1
    assert live.requests == 4
    await assert_settled(node)


async def test_only_unreachable_instances_give_502(harness: Harness) -> None:
    node = await harness.node()
    await node.coordinator.register_instance(
        InstanceSpec(id="dead", url=f"http://127.0.0.1:{free_port()}")
    )
    async with await post(harness, node, CHAT) as resp:
        assert resp.status == 502
        assert (await resp.json())["error"]["code"] == "upstream_unreachable"
    await assert_settled(node)


@pytest.mark.parametrize(
    ("body", "headers", "status", "code"),
    [
        (b'{"model": "x", ', {}, 400, "invalid_json"),
        (b"[1, 2, 3]", {}, 400, "invalid_body"),
        (b'{"messages": "' + b"x" * 600 + b'"}', {}, 413, "body_too_large"),
        (json.dumps(CHAT).encode(), {"X-Prompt-Tokens": "-3"}, 400, "invalid_header"),
    ],
    ids=["malformed-json", "not-an-object", "oversized", "bad-prompt-tokens-header"],
)
async def test_bad_input_is_rejected_without_a_reservation(
    harness: Harness, body: bytes, headers: dict[str, str], status: int, code: str
) -> None:
    engine = await harness.engine()
    node = await node_with(harness, engine, max_body_bytes=512)
    async with await post(harness, node, body, headers=headers) as resp:
        assert resp.status == status
        error = (await resp.json())["error"]
        assert error["code"] == code and error["message"] and error["type"]
        assert resp.headers["X-Request-Id"]
    assert engine.requests == 0
    assert await settled(node.coordinator)
    assert await metric(harness, node.url, "proxy_requests_total", status=str(status)) == 1


async def test_oversized_chunked_body_is_413(harness: Harness) -> None:
    engine = await harness.engine()
    node = await node_with(harness, engine, max_body_bytes=512)

    async def body() -> AsyncIterator[bytes]:  # no Content-Length: read up to the limit
        for _ in range(6):
            yield b" " * 100

    async with harness.http.post(node.url + "/v1/chat/completions", data=body()) as resp:
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "body_too_large"
    assert engine.requests == 0
    assert await settled(node.coordinator)


async def test_no_alive_instance_is_503(harness: Harness) -> None:
    node = await harness.node()
    async with await post(harness, node, CHAT) as resp:
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == "no_instance"
    assert await settled(node.coordinator)


async def test_pool_full_is_429_with_retry_after(harness: Harness) -> None:
    engine = await harness.engine(gate_after=1)
    coordinator = await harness.coordinator(enforce_max_slots=True)
    node = await harness.node(coordinator)
    await coordinator.register_instance(InstanceSpec(id="e0", url=engine.url, max_slots=1))
    held = await post(harness, node, {**CHAT, "stream": True})
    await asyncio.wait_for(held.content.readuntil(b"\n\n"), 5)
    async with await post(harness, node, CHAT) as resp:
        assert resp.status == 429
        assert int(resp.headers["Retry-After"]) >= 1
        assert (await resp.json())["error"]["code"] == "pool_full"
    engine.gate.set()
    async with held:
        await held.read()
    await assert_settled(node)


async def test_upstream_5xx_becomes_502_and_4xx_passes_through(harness: Harness) -> None:
    engine = await harness.engine(status=503)
    node = await node_with(harness, engine)
    async with await post(harness, node, CHAT) as resp:
        assert resp.status == 502
        error = (await resp.json())["error"]
        assert error["code"] == "upstream_error" and "503" in error["message"]
        assert resp.headers["X-Instance-Id"] == "e0"
    await assert_settled(node)
    engine.status = 400
    engine.error_body = b'{"error": {"message": "context too long", "code": 400}, "extra": [1]}'
    async with await post(harness, node, {**CHAT, "stream": True}) as resp:
        assert resp.status == 400
        assert await resp.read() == engine.error_body
        assert resp.headers["X-Instance-Id"] == "e0"
    await assert_settled(node)


async def test_openai_client_works_unchanged(harness: Harness) -> None:
    engine = await harness.engine(chunks=3)
    node = await node_with(harness, engine)
    async with AsyncOpenAI(base_url=node.url + "/v1", api_key="x", max_retries=0) as client:
        reply = await client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.choices[0].message.content == "t0 t1 t2 "
        assert reply.usage is not None and reply.usage.completion_tokens == 3
        stream = await client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        parts = [chunk.choices[0].delta.content async for chunk in stream if chunk.choices]
        assert "".join(p for p in parts if p) == "t0 t1 t2 "
        models = await client.models.list()
        assert [m.id for m in models.data] == ["fake-model"]
    await assert_settled(node)


async def test_a_streamed_first_token_measures_the_prediction_error(harness: Harness) -> None:
    engine = await harness.engine(chunks=2, delay_s=0.3)  # first chunk >= 300 ms
    node = await node_with(harness, engine, timing=True)
    name = "proxy_ttft_prediction_relative_error"
    sent = asyncio.get_running_loop().time()
    async with await post(harness, node, {**CHAT, "stream": True}) as resp:
        assert resp.status == 200
        predicted_ms = float(resp.headers["X-Predicted-TTFT-Ms"])
        await resp.content.readuntil(b"\n\n")
        client_ttft_ms = (asyncio.get_running_loop().time() - sent) * 1000
        await resp.read()
    assert 0 < predicted_ms < 300
    assert await metric(harness, node.url, f"{name}_count", instance="e0") == 1
    # The node saw the first token between the engine's delay and the client's view.
    error = await metric(harness, node.url, f"{name}_sum", instance="e0")
    assert 1 - predicted_ms / 300 <= error <= 1 - predicted_ms / client_ttft_ms
    # A non-streamed answer has no first-token signal: nothing is measured.
    async with await post(harness, node, CHAT) as resp:
        assert resp.status == 200
    assert await metric(harness, node.url, f"{name}_count", instance="e0") == 1
    await assert_settled(node)


async def test_metrics_are_written_off_the_event_loop(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writing out every instance's series took the node's CPU for 0.75 s at 10,000
    instances; on the event loop that stalled every request and let Redis replies
    time out (the node went degraded on each scrape). While a scrape's writing is
    held, the node still answers."""
    engine = await harness.engine()
    node = await node_with(harness, engine, timing=True)
    entered, release = threading.Event(), threading.Event()
    real = app_module.render_metrics

    def held(*args: Any) -> bytes:
        entered.set()
        assert release.wait(30), "never released"
        return real(*args)

    monkeypatch.setattr(app_module, "render_metrics", held)

    async def scrape() -> str:
        async with harness.http.get(node.control_url + "/metrics") as resp:
            assert resp.status == 200
            return await resp.text()

    scraping = asyncio.create_task(scrape())
    try:
        await wait_for(entered.is_set, what="the scrape to start writing")
        async with harness.http.get(node.url + "/healthz") as resp:
            assert resp.status == 200 and (await resp.json())["alive_instances"] == 1
        async with await post(harness, node, CHAT) as resp:
            assert resp.status == 200
        assert not scraping.done()
    finally:
        release.set()
    assert 'proxy_instance_alive{instance="e0",pool=' in await scraping


async def test_health_and_metrics_on_both_planes(harness: Harness) -> None:
    engine = await harness.engine()
    node = await node_with(harness, engine, timing=True)
    async with await post(harness, node, CHAT) as resp:
        assert resp.status == 200

    async def released() -> bool:  # the release rides on a later call (carry_ms)
        return await metric(harness, node.url, "proxy_instance_inflight", instance="e0") == 0

    await wait_for(released, what="the release to reach the node's view")
    for url in (node.url, node.control_url):
        async with harness.http.get(url + "/healthz") as resp:
            health = await resp.json()
        assert health == {
            "status": "ok",
            "node_id": node.coordinator.node_id,
            "pool": node.coordinator.pool,
            "coordination": "ok",
            "node_id_shared": False,
            "alive_instances": 1,
            "ejected_instances": 0,
            "cordoned_instances": 0,
        }
        assert (
            await metric(harness, url, "proxy_requests_total", endpoint="chat", status="200") == 1
        )
        assert await metric(harness, url, "proxy_decision_seconds_count") == 1
        assert await metric(harness, url, "proxy_ttft_seconds_count") == 1
        assert await metric(harness, url, "proxy_coordination_degraded") == 0
        assert await metric(harness, url, "proxy_instance_inflight", instance="e0") == 0
        assert await metric(harness, url, "proxy_instance_alive", instance="e0") == 1
        assert await metric(harness, url, "proxy_reservations_reaped_total") == 0
        assert await metric(harness, url, "proxy_node_info", node_id=node.coordinator.node_id) == 1
