"""The HTTP edge of `coordinator serve` (issue 14 item 5).

Requests aiohttp's parser refuses get a JSON error and one log line (no traceback);
a head that does not arrive in time is dropped (slowloris); connections beyond the
cap are refused with a 503; out-of-descriptor accept() errors are counted and logged
rarely.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from redis.asyncio import Redis

from coordinator import Settings
from local_fleet.embedded import free_port
from proxy_node.config import NodeConfig
from proxy_node.edge import ACCEPT_ERROR_MESSAGE, AcceptErrorLog
from proxy_node.serve import serve
from tests.helpers import delete_pool, wait_for

pytestmark = pytest.mark.timeout(60)

MAX_CONNECTIONS = 6
HEADER_TIMEOUT_S = 1.0


class Node:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.port = config.port
        self.control_port = config.control_port


@pytest.fixture
async def node(redis_url: str, pool: str) -> AsyncIterator[Node]:
    config = NodeConfig(
        redis_url=redis_url,
        pool=pool,
        port=free_port(),
        control_port=free_port(),
        scrape_interval_s=0,
        header_timeout_s=HEADER_TIMEOUT_S,
        max_connections=MAX_CONNECTIONS,
        settings=Settings(redis_timeout_ms=1000),
    )
    stop = asyncio.Event()
    task = asyncio.create_task(serve(config, stop))
    async with aiohttp.ClientSession() as http:

        async def up() -> bool:
            if task.done():
                task.result()
            try:
                async with http.get(f"http://127.0.0.1:{config.port}/healthz") as resp:
                    return resp.status == 200
            except aiohttp.ClientError:
                return False

        await wait_for(up, what="serve() to answer")
    try:
        yield Node(config)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        client = Redis.from_url(redis_url)
        await delete_pool(client, "lc", pool)
        await client.aclose()


async def exchange(port: int, raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Send raw bytes; read every response until the node closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        responses = []
        async with asyncio.timeout(20):
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    break
                status_line, *lines = head.decode().split("\r\n")
                headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines if line)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                responses.append((int(status_line.split()[1]), headers, body))
        return responses
    finally:
        writer.close()


MALFORMED = {
    "64 KiB header": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 65536 + b"\r\n\r\n",
    "200 headers": b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
    + b"".join(b"X-H%d: 1\r\n" % i for i in range(200))
    + b"\r\n",
    "Content-Length abc": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
    b"Content-Length: abc\r\n\r\n{}",
    "Content-Length -1": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
    b"Content-Length: -1\r\n\r\n{}",
    "Content-Length twice": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
    b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    "Content-Length with chunked": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
    b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "Content-Length smaller than the body": b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
    b"Content-Length: 2\r\n\r\n{}this is not a request\r\n\r\n",
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
async def test_malformed_requests_get_json_and_one_log_line(
    node: Node, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    responses = await exchange(node.port, MALFORMED[case])
    assert responses, "no answer"
    status, headers, body = responses[-1]
    assert status == 400, (status, body)
    assert headers["content-type"].startswith("application/json"), headers
    error = json.loads(body)["error"]
    assert error["code"] == "malformed_request" and error["message"], error
    refused = [r for r in caplog.records if "refused a malformed request" in r.getMessage()]
    assert len(refused) == 1, [r.getMessage() for r in refused]
    assert "\n" not in refused[0].getMessage()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{node.port}/metrics") as resp:
            text = await resp.text()
    assert "proxy_malformed_requests_total 1.0" in text


async def test_a_slow_request_head_is_dropped(node: Node) -> None:
    """Slowloris: a head trickled byte by byte is closed after the head timeout."""
    conns = [await asyncio.open_connection("127.0.0.1", node.port) for _ in range(3)]

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        for i in range(600):  # bounded: 60 s of one header line per 100 ms
            if reader.at_eof() or writer.is_closing():
                break
            writer.write(b"X-Slow-%d: 1\r\n" % i)
            try:
                async with asyncio.timeout(0.1):
                    return await reader.read()  # b"": the node closed the connection
            except TimeoutError:
                continue
        return b"never closed"

    try:
        results = await asyncio.wait_for(asyncio.gather(*(trickle(*c) for c in conns)), 30)
    finally:
        for _, writer in conns:
            writer.close()
    assert results == [b"", b"", b""]


async def test_connections_beyond_the_cap_are_refused_with_503(node: Node) -> None:
    held = [await asyncio.open_connection("127.0.0.1", node.port) for _ in range(MAX_CONNECTIONS)]
    try:
        responses = await exchange(node.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        [(status, headers, body)] = responses
        assert status == 503 and headers["retry-after"] == "1"
        assert json.loads(body)["error"]["code"] == "too_many_connections"
    finally:
        for _, writer in held:
            writer.close()

    async def served() -> bool:
        request = b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        answers = await exchange(node.port, request)
        if not answers or answers[0][0] != 200:
            return False  # slots are given back as the node sees the closes
        lines = answers[0][2].decode().splitlines()
        [count] = [line for line in lines if line.startswith("proxy_refused_connections_total")]
        return float(count.split()[1]) >= 1

    # Closed connections give their slots back.
    await wait_for(served, what="a free slot and the refusal counted")


def test_accept_errors_are_counted_and_logged_rarely(caplog: pytest.LogCaptureFixture) -> None:
    counted: list[int] = []
    now = [0.0]
    handler = AcceptErrorLog(lambda: counted.append(1), interval_s=10.0, clock=lambda: now[0])
    loop = asyncio.new_event_loop()
    try:
        context: dict[str, Any] = {
            "message": ACCEPT_ERROR_MESSAGE,
            "exception": OSError(errno.EMFILE, "Too many open files"),
        }
        with caplog.at_level(logging.DEBUG, logger="proxy_node.edge"):
            for _ in range(1000):
                handler(loop, context)
            now[0] = 10.5
            handler(loop, context)
    finally:
        loop.close()
    assert len(counted) == 1001
    lines = [r.getMessage() for r in caplog.records if ACCEPT_ERROR_MESSAGE in r.getMessage()]
    assert len(lines) == 2, lines
    assert "999 more" in lines[1]
