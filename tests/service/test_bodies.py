"""Bounded reads of engine bodies that arrive in several packets (proxy_node/bodies.py),
and the engine `/metrics` scrape that needs them."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp.base_protocol import BaseProtocol

from proxy_node import hints
from proxy_node.bodies import read_up_to
from tests.fake_engine import Harness


def stream() -> aiohttp.StreamReader:
    """A response body the test feeds by hand, as packets arrive."""
    loop = asyncio.get_running_loop()
    protocol = BaseProtocol(loop)
    protocol.connection_made(asyncio.Transport())  # open: a read waits for more data
    return aiohttp.StreamReader(protocol, 2**16, loop=loop)


async def test_a_body_that_arrives_in_parts_is_read_whole() -> None:
    body = stream()
    body.feed_data(b"first part, ")
    reading = asyncio.create_task(read_up_to(body, 100))
    await asyncio.sleep(0)  # the reader has taken what arrived and waits for more
    assert not reading.done()
    body.feed_data(b"second part")
    body.feed_eof()
    assert await reading == b"first part, second part"


async def test_a_body_longer_than_the_limit_is_cut_at_the_limit() -> None:
    body = stream()
    body.feed_data(b"0123456789")
    reading = asyncio.create_task(read_up_to(body, 15))
    await asyncio.sleep(0)
    body.feed_data(b"abcdefghij")  # no EOF: the reader stops at its limit
    assert await reading == b"0123456789abcde"


async def test_a_large_engine_metrics_body_gives_its_hints(harness: Harness) -> None:
    """An engine's /metrics of 0.5 MB, the hint last: read with one `read(n)`, the body
    came back cut mid-line and its parse failed."""
    filler = "".join(
        f'# TYPE vllm:filler_{i} gauge\nvllm:filler_{i}{{model_name="m"}} {i}\n'
        for i in range(8000)
    )
    text = filler + "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 7\n"
    engine = await harness.engine(metrics_text=text)

    class Row:
        url = engine.url

    got = await hints.scrape_instance(harness.http, Row, 5.0, "n0")  # type: ignore[arg-type]
    assert got == {"engine_running": 7.0}


async def test_an_engine_metrics_body_over_the_limit_is_refused(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = await harness.engine(metrics_text="vllm:num_requests_running 1\n" * 1000)
    monkeypatch.setattr(hints, "MAX_METRICS_BYTES", 10_000)

    class Row:
        url = engine.url

    with pytest.raises(ValueError, match="larger than 10000 bytes"):
        await hints.scrape_instance(harness.http, Row, 5.0, "n0")  # type: ignore[arg-type]
