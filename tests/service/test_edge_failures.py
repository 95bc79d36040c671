"""The proxy as a production edge against failing engines (issue 14 items 1, 3, 6; 13.7).

Passive health ejects an engine that keeps failing, on every node; waits are bounded
by connect, first-byte and idle timeouts; the output caps the node reads are checked;
a client's X-Request-Id never becomes a reservation id.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any
from urllib.parse import urlparse

import aiohttp
import pytest
from rich.console import Console

from coordinator import InstanceSpec
from coordinator.outliers import OutlierPolicy
from proxy_node.forwarding import THREAD_PARSE_BYTES
from proxy_node.inspect import read_pool, render
from proxy_node.state import STATE
from tests.fake_engine import FakeEngine, Harness, NodeServer, settled
from tests.helpers import live_reservations, wait_for
from tests.service.test_proxy_forwarding import CHAT, metric, post

pytestmark = pytest.mark.timeout(60)

STREAM = {**CHAT, "stream": True}
EJECT = {"eject_consecutive_failures": 2, "eject_base_s": 60.0, "eject_max_s": 600.0}


async def register(node: NodeServer, *engines: FakeEngine) -> None:
    for i, engine in enumerate(engines):
        await node.coordinator.register_instance(InstanceSpec(id=f"e{i}", url=engine.url))


async def loads(harness: Harness, node: NodeServer) -> dict[str, dict[str, Any]]:
    async with harness.http.get(node.control_url + "/debug/instance_loads") as resp:
        assert resp.status == 200
        doc = await resp.json()
    return {row["id"]: row for row in doc["instances"]}


async def ejected(harness: Harness, node: NodeServer, instance: str) -> bool:
    return bool((await loads(harness, node))[instance]["outlier"]["ejected"])


async def in_redis_ejected(node: NodeServer, instance: str) -> bool:
    # What Redis holds, not this node's view of it (which /debug/instance_loads shows).
    return instance in (await node.coordinator.read_outliers()).ejected_ids()


async def chat(harness: Harness, node: NodeServer, body: Any = CHAT) -> tuple[int, str, bytes]:
    async with await post(harness, node, body) as resp:
        return resp.status, resp.headers.get("X-Instance-Id", ""), await resp.read()


# ---------------------------------------------------------------------- ejection


async def test_a_failing_engine_is_ejected_on_every_node(harness: Harness) -> None:
    bad, good = await harness.engine(status=500), await harness.engine()
    first = await harness.node(**EJECT)
    second = await harness.node(**EJECT)
    await register(first, bad, good)
    # Requests through the first node until its failures eject e0 (ties rotate).
    for _ in range(20):
        await chat(harness, first)
        if await in_redis_ejected(first, "e0"):
            break
    await wait_for(lambda: ejected(harness, first, "e0"), what="e0 ejected")
    row = (await loads(harness, first))["e0"]
    assert row["rank"] is None and row["outlier"]["last_failure_reason"] == "status_500"
    # The other node reads the ejection from Redis and avoids e0 too.
    await wait_for(lambda: ejected(harness, second, "e0"), what="the second node to see it")
    served_before = bad.requests
    for _ in range(8):
        status, instance, _ = await chat(harness, second)
        assert (status, instance) == (200, "e1")
    assert bad.requests == served_before
    assert await metric(harness, second.url, "proxy_instance_ejected", instance="e0") == 1
    assert await metric(harness, second.url, "proxy_instance_ejected", instance="e1") == 0
    async with harness.http.get(second.control_url + "/healthz") as resp:
        assert (await resp.json())["ejected_instances"] == 1
    async with harness.http.get(second.control_url + "/v1/instances") as resp:
        flags = {row["id"]: row["ejected"] for row in (await resp.json())["instances"]}
    assert flags == {"e0": True, "e1": False}
    await wait_for(lambda: settled(first.coordinator), what="counters back to 0")


@pytest.mark.parametrize(
    ("knobs", "reason"),
    [
        ({"status": 503}, "status_503"),
        ({"crash_after": 1}, "cut_stream"),
        ({"omit_done": True}, "truncated_stream"),
        ({"raw_body": b""}, "empty_response"),
        ({"raw_body": b"<html>not json"}, "malformed_response"),
    ],
)
async def test_each_kind_of_failure_counts(
    harness: Harness, knobs: dict[str, Any], reason: str
) -> None:
    bad, good = await harness.engine(**knobs), await harness.engine()
    node = await harness.node(eject_consecutive_failures=1, eject_base_s=60.0)
    await register(node, bad, good)
    body = CHAT if "raw_body" in knobs else STREAM
    for _ in range(10):
        try:
            await chat(harness, node, body)
        except aiohttp.ClientPayloadError:
            assert "crash_after" in knobs  # a cut stream reaches the client as a cut
        if await in_redis_ejected(node, "e0"):
            break
    await wait_for(lambda: ejected(harness, node, "e0"), what="e0 ejected")
    row = (await loads(harness, node))["e0"]
    assert row["outlier"]["ejected"], row["outlier"]
    assert row["outlier"]["last_failure_reason"] == reason
    assert await metric(harness, node.url, "proxy_upstream_failures_total", reason=reason) >= 1
    await wait_for(lambda: settled(node.coordinator), what="counters back to 0")


async def test_ejection_never_takes_more_than_the_configured_share(harness: Harness) -> None:
    engines = [await harness.engine(status=500) for _ in range(2)]
    node = await harness.node(
        eject_consecutive_failures=1, eject_base_s=60.0, eject_max_percent=50.0
    )
    await register(node, *engines)
    for _ in range(10):
        status, _, _ = await chat(harness, node)
        assert status == 502
    view = await loads(harness, node)
    assert sorted(row["outlier"]["ejected"] for row in view.values()) == [False, True]
    # The one left in keeps serving (and failing) rather than leaving nothing; each
    # request is tried on both (its retry finds only the ejected one: panic mode).
    assert sum(engine.requests for engine in engines) == 20


async def test_a_success_resets_the_count_and_ejection_backs_off(harness: Harness) -> None:
    coordinator = await harness.coordinator()
    await coordinator.register_instance(InstanceSpec(id="e0", url="http://127.0.0.1:9"))
    await coordinator.register_instance(InstanceSpec(id="e1", url="http://127.0.0.1:10"))
    policy = OutlierPolicy(
        consecutive_failures=3,
        failure_window_ms=60_000,
        base_ejection_ms=300,
        max_ejection_ms=60_000,
    )
    states = [(await coordinator.record_outcome("e0", False, policy, "x")).state for _ in range(2)]
    assert states == ["counted", "counted"]
    assert (await coordinator.record_outcome("e0", True, policy)).state == "ok"
    assert (await coordinator.record_outcome("e0", False, policy)).consecutive_failures == 1
    await coordinator.record_outcome("e0", False, policy)
    first = await coordinator.record_outcome("e0", False, policy)
    assert first.state == "ejected" and first.ejected_until_ms - first.now_ms == 300
    assert (await coordinator.record_outcome("e0", True, policy)).state == "already"
    assert (await coordinator.read_outliers()).ejected_ids() == {"e0"}

    async def readmitted() -> bool:
        return not (await coordinator.read_outliers()).ejected_ids()

    await wait_for(readmitted, what="e0 re-admitted after its ejection")
    for _ in range(2):
        await coordinator.record_outcome("e0", False, policy)
    second = await coordinator.record_outcome("e0", False, policy)
    # Ejected again soon after: the ejection doubles.
    assert second.state == "ejected" and second.ejected_until_ms - second.now_ms == 600
    assert second.ejections == 2


async def test_an_engine_failing_one_request_in_three_is_ejected(harness: Harness) -> None:
    """Never 5 failures in a row (the consecutive rule), but a third of them: this
    node's failure share over its last 20 exchanges with it (20%) ejects it."""
    flaky, good = await harness.engine(fail_every=3), await harness.engine()
    node = await harness.node(eject_base_s=60.0, eject_max_s=600.0)
    await register(node, flaky, good)
    served = []
    for _ in range(60):
        status, instance, _ = await chat(harness, node)
        assert status == 200  # each 500 is retried on the other engine
        served.append(instance)
        if await in_redis_ejected(node, "e0"):
            break
    assert await in_redis_ejected(node, "e0")
    # Judged on 20 exchanges, never 2 failures in a row: the consecutive rule alone
    # would have kept it in.
    assert flaky.requests >= 20
    state = (await node.coordinator.read_outliers()).state("e0")
    # What inspect and /debug/instance_loads show: the last failure, and the rule.
    assert state.consecutive_failures == 0
    assert state.reason.startswith("status_500; ") and "% of the last 20 failed" in state.reason
    for _ in range(6):
        assert (await chat(harness, node))[:2] == (200, "e1")
    assert await metric(harness, node.url, "proxy_ejections_total") == 1


@pytest.mark.parametrize("body", [CHAT, STREAM], ids=["json", "stream"])
@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_compressed_answer_is_no_failure(
    harness: Harness, body: dict[str, Any], encoding: str
) -> None:
    """The client asked for a compressed answer and the engine compressed it: read as
    it came, every such answer was a broken body, and 2 of them ejected the engine."""
    engine = await harness.engine(compress=True)
    node = await harness.node(**EJECT)
    await register(node, engine)
    for _ in range(3):
        async with await post(harness, node, body, headers={"Accept-Encoding": encoding}) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Encoding"] == encoding
            answer = await resp.read()  # decoded by the client
        assert (b"[DONE]" in answer) if body is STREAM else json.loads(answer)["usage"]
    await wait_for(lambda: not node.app[STATE].tasks, what="the outcomes reported")
    assert await metric(harness, node.url, "proxy_upstream_failures_total") == 0
    assert (await node.coordinator.read_outliers()).states == {}
    assert engine.completed == 3


async def test_an_engine_that_fails_mid_stream_is_ejected(harness: Harness) -> None:
    """vLLM reports a failure during generation as a 200 stream ending in an error event
    and [DONE]: each is a failure, and two in a row eject the engine."""
    error = b'{"error": {"message": "CUDA error: an illegal memory access", "code": 500}}'
    failing, good = await harness.engine(error_event=error), await harness.engine()
    node = await harness.node(**EJECT)
    await register(node, failing, good)
    for _ in range(20):
        status, instance, answer = await chat(harness, node, STREAM)
        assert status == 200  # bytes had reached the client: no retry
        assert (error in answer) == (instance == "e0")
        if await in_redis_ejected(node, "e0"):
            break
    assert await in_redis_ejected(node, "e0")
    assert (await node.coordinator.read_outliers()).state("e0").reason == "error_event"
    for _ in range(4):
        assert (await chat(harness, node, STREAM))[:2] == (200, "e1")


async def test_ejection_can_be_turned_off(harness: Harness) -> None:
    bad, good = await harness.engine(status=500), await harness.engine()
    node = await harness.node(eject_consecutive_failures=0, eject_failure_percent=0.0)
    # Zero timing: nothing predicted, so every decision is a tie and ties rotate (with
    # the default timing a few ms left on one prefill cursor would break them).
    for i, engine in enumerate((bad, good)):
        spec = InstanceSpec(
            id=f"e{i}",
            url=engine.url,
            prefill_ms_per_token=0.0,
            prefill_overhead_ms=0.0,
            decode_ms_per_token=0.0,
        )
        await node.coordinator.register_instance(spec)
    for _ in range(24):
        assert (await chat(harness, node))[:2] == (200, "e1")  # e0's 500s retried on e1
    # Each request tries e0 first (its retry e1). 24 failures in a row on e0: past
    # both default rules (5 in a row; 20% of 20), yet never ejected.
    assert bad.requests == 24 and good.requests == 24


# ---------------------------------------------------------------------- bounded waits


async def test_no_first_byte_in_time_retries_on_another_instance(harness: Harness) -> None:
    hanging, good = await harness.engine(hang=True), await harness.engine()
    node = await harness.node(first_byte_timeout_s=0.3, eject_consecutive_failures=0)
    await register(node, hanging, good)
    for _ in range(4):  # ties rotate: some requests pick the hanging engine first
        status, instance, _ = await chat(harness, node)
        assert (status, instance) == (200, "e1")
    assert hanging.requests >= 1
    assert await metric(harness, node.url, "proxy_upstream_timeouts_total", phase="first_byte") >= 1
    await wait_for(lambda: settled(node.coordinator), what="counters back to 0")


async def test_no_first_byte_and_no_other_instance_is_504_json(harness: Harness) -> None:
    hanging = await harness.engine(hang=True)
    node = await harness.node(first_byte_timeout_s=0.3)
    await register(node, hanging)
    async with await post(harness, node, STREAM) as resp:
        assert resp.status == 504
        doc = await resp.json()
    assert doc["error"]["code"] == "upstream_timeout"
    assert "0.3 s" in doc["error"]["message"]
    await wait_for(lambda: settled(node.coordinator), what="counters back to 0")


async def test_a_stream_that_stalls_is_cut_after_the_idle_timeout(harness: Harness) -> None:
    stalling = await harness.engine(chunks=4, gate_after=1)
    node = await harness.node(idle_timeout_s=0.3, eject_consecutive_failures=0)
    await register(node, stalling)
    async with await post(harness, node, STREAM) as resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
    assert await metric(harness, node.url, "proxy_upstream_timeouts_total", phase="idle") == 1
    await wait_for(lambda: settled(node.coordinator), what="counters back to 0")
    stalling.gate.set()


# ---------------------------------------------------------------------- request body


async def stalled_reader(node: NodeServer, body: Any) -> socket.socket:
    """A client that sends a request and never reads its answer (a small receive
    buffer, so the node's writes soon wait on it)."""
    url = urlparse(node.url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (url.hostname, url.port))
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    await loop.sock_sendall(sock, head.encode() + data)
    return sock


async def test_a_client_that_stops_reading_is_dropped_after_the_send_timeout(
    harness: Harness,
) -> None:
    """A write to a client that stopped reading never completes: it would hold the
    engine's stream and its reservation for good (the idle timeout watches only the
    engine). After send_timeout_s the client's connection is dropped, the reservation
    released and the engine's stream ended; the engine is not blamed."""
    engine = await harness.engine(chunks=200_000)  # ~30 MB of stream: more than buffers hold
    node = await harness.node(send_timeout_s=0.5)
    await register(node, engine)
    sock = await stalled_reader(node, STREAM)
    try:
        await wait_for(lambda: engine.requests == 1, what="the request to reach the engine")
        await wait_for(lambda: settled(node.coordinator), what="the reservation to be released")
        await wait_for(lambda: engine.active == 0, what="the engine's stream to end")
        assert engine.completed == 0, "the stream ended early, not by itself"
        stalled = await metric(
            harness, node.url, "proxy_request_outcomes_total", outcome="client_stalled"
        )
        assert stalled == 1
        assert await metric(harness, node.url, "proxy_upstream_failures_total") == 0
    finally:
        sock.close()


@pytest.mark.parametrize(
    "raw",
    [
        b'{"max_tokens": 1e308}',
        b'{"max_tokens": -1}',
        b'{"max_tokens": 0}',
        b'{"max_tokens": "abc"}',
        b'{"max_tokens": NaN}',
        b'{"max_tokens": 12.5}',
        b'{"max_tokens": true}',
        b'{"max_tokens": 1' + b"0" * 400 + b"}",
        b'{"max_completion_tokens": -5}',
    ],
)
async def test_output_caps_the_node_reads_are_validated(harness: Harness, raw: bytes) -> None:
    engine = await harness.engine()
    node = await harness.node()
    await register(node, engine)
    body = raw[:-1] + b', "messages": [{"role": "user", "content": "hi"}]}'
    async with await post(harness, node, body) as resp:
        assert resp.status == 400
        doc = await resp.json()
    assert doc["error"]["code"] == "invalid_max_tokens", doc
    assert "max_" in doc["error"]["message"]
    assert engine.requests == 0
    assert not await live_reservations(node.coordinator)


# A body above THREAD_PARSE_BYTES is parsed in a worker thread: the same answers.
LARGE = "x" * (THREAD_PARSE_BYTES + 1)


@pytest.mark.parametrize("content", ["hi", LARGE], ids=["small", "large"])
async def test_the_rest_of_the_body_passes_unchanged(harness: Harness, content: str) -> None:
    engine = await harness.engine()
    node = await harness.node()
    await register(node, engine)
    raw = (
        b'{"messages": [{"role": "user", "content": "' + content.encode() + b'"}], '
        b'"max_tokens": null, "temperature": NaN, "vendor_knob": {"deep": [1, 2.50, "x"]}, '
        b'"n": 1}'
    )
    async with await post(harness, node, raw) as resp:
        assert resp.status == 200
        predicted = int(resp.headers["X-Predicted-TTFT-Ms"])
    assert engine.bodies == [raw]
    if content == LARGE:  # its prompt was counted: 65,536 tokens to prefill
        assert predicted > 1000


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b'{"messages": [{"content": "' + LARGE.encode() + b'"}], ', "invalid_json"),
        (b'{"max_tokens": 0, "prompt": "' + LARGE.encode() + b'"}', "invalid_max_tokens"),
    ],
    ids=["malformed", "bad_max_tokens"],
)
async def test_a_large_unusable_body_is_400_too(harness: Harness, raw: bytes, code: str) -> None:
    engine = await harness.engine()
    node = await harness.node()
    await register(node, engine)
    async with await post(harness, node, raw) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["code"] == code
    assert engine.requests == 0


# ---------------------------------------------------------------------- request ids


async def test_a_shared_client_request_id_still_holds_two_reservations(harness: Harness) -> None:
    engine = await harness.engine(gate_after=1)
    node = await harness.node()
    await register(node, engine)
    headers = {"X-Request-Id": "same-id"}
    held = [
        await harness.http.post(node.url + "/v1/chat/completions", json=STREAM, headers=headers)
        for _ in range(2)
    ]
    for resp in held:
        await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10)
        assert resp.headers["X-Request-Id"] == "same-id"
    records = await live_reservations(node.coordinator)
    assert len(records) == 2
    assert {resp.headers["X-Reservation-Id"] for resp in held} == set(records)
    assert "same-id" not in records
    assert engine.request_ids == ["same-id", "same-id"]  # forwarded for tracing
    held[0].close()  # the first client leaves: the second still holds its reservation
    await wait_for(
        lambda: _count(live_reservations(node.coordinator), 1), what="one reservation left"
    )
    engine.gate.set()
    async with held[1]:
        await held[1].read()
    await wait_for(lambda: settled(node.coordinator), what="counters back to 0")


async def _count(records: Any, n: int) -> bool:
    return len(await records) == n


async def test_a_restarted_engine_starts_with_a_clean_record(harness: Harness) -> None:
    coordinator = await harness.coordinator()
    await coordinator.register_instance(InstanceSpec(id="e0", url="http://127.0.0.1:9"))
    await coordinator.register_instance(InstanceSpec(id="e1", url="http://127.0.0.1:10"))
    policy = OutlierPolicy(consecutive_failures=1, base_ejection_ms=60_000)
    assert (await coordinator.record_outcome("e0", False, policy, "x")).state == "ejected"
    assert (await coordinator.read_outliers()).ejected_ids() == {"e0"}
    # The engine restarts: a new epoch is a new process, not the one that failed.
    await coordinator.register_instance(InstanceSpec(id="e0", url="http://127.0.0.1:9", epoch=2))
    assert (await coordinator.read_outliers()).states == {}
    assert (await coordinator.record_outcome("e0", True, policy)).state == "ok"


async def test_inspect_shows_the_ejection(harness: Harness) -> None:
    coordinator = await harness.coordinator()
    for i in range(2):
        await coordinator.register_instance(
            InstanceSpec(id=f"e{i}", url=f"http://127.0.0.1:{9 + i}")
        )
    policy = OutlierPolicy(consecutive_failures=1, base_ejection_ms=60_000)
    await coordinator.record_outcome("e1", False, policy, "status_502")
    state = await read_pool(coordinator, coordinator.settings)
    rows = {row["id"]: row for row in state.loads["instances"]}
    assert rows["e1"]["outlier"]["ejected"] and rows["e1"]["rank"] is None
    assert rows["e0"]["rank"] == 0
    console = Console(width=200, record=True, highlight=False)
    console.print(render(state, harness.redis_url, 200))
    text = console.export_text()
    assert "1 ejected" in text
    e1 = next(line for line in text.splitlines() if " e1 " in f" {line} ")
    assert "ejected(" in e1


@pytest.mark.parametrize("status", [500, 502, 503, 504, 429, 408])
async def test_an_engine_5xx_429_or_408_is_retried_on_another_instance(
    harness: Harness, status: int
) -> None:
    """Nothing reached the client yet: the request goes to another instance, and the
    failure still counts against the engine that answered 5xx or 408; a 429 (a
    healthy engine that is full) does not: ejecting it would take capacity away."""
    bad, good = await harness.engine(status=status), await harness.engine()
    node = await harness.node()
    await register(node, bad, good)
    for _ in range(6):  # ties rotate: some go to e0 first
        status_seen, instance, body = await chat(harness, node, STREAM)
        assert (status_seen, instance) == (200, "e1")
        assert body.rstrip().endswith(b"data: [DONE]")
    assert bad.requests >= 1, "e0 was tried first at least once"
    failures = await metric(
        harness, node.url, "proxy_upstream_failures_total", reason=f"status_{status}"
    )
    assert failures == (0 if status == 429 else bad.requests)
    await wait_for(lambda: settled(node.coordinator), what="counters back to 0")


@pytest.mark.parametrize(
    ("status", "code"), [(429, "upstream_overloaded"), (408, "upstream_request_timeout")]
)
async def test_when_every_instance_refuses_the_client_gets_the_refusal(
    harness: Harness, status: int, code: str
) -> None:
    """Both instances answered 429 (or 408): the client sees that status and the last
    engine's Retry-After, so its own backoff applies; an engine's other 4xx is the
    engine's answer and passes through untried elsewhere."""
    refusal = {"status": status, "error_headers": {"Retry-After": "7"}}
    first, second = await harness.engine(**refusal), await harness.engine(**refusal)
    node = await harness.node()
    await register(node, first, second)
    async with await post(harness, node, STREAM) as resp:
        assert resp.status == status
        assert resp.headers["Retry-After"] == "7"
        error = (await resp.json())["error"]
    assert error["code"] == code and f"answered {status}" in error["message"]
    assert (first.requests, second.requests) == (1, 1)
    await wait_for(lambda: settled(node.coordinator), what="counters back to 0")
    first.status = second.status = 404
    async with await post(harness, node, STREAM) as resp:
        assert resp.status == 404
        assert await resp.read() == first.error_body
    assert first.requests + second.requests == 3, "a 404 is not tried elsewhere"
    await wait_for(lambda: settled(node.coordinator), what="counters back to 0")
