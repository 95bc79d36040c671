"""GET /v1/models: the union of the alive engines' model lists, asked of a few engines
at a time and within a deadline, from answers of bounded size."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from coordinator import InstanceSpec
from proxy_node import app as node_app
from proxy_node import static
from tests.fake_engine import Harness
from tests.helpers import served

ENGINES = 40


async def register(harness: Harness, count: int) -> Any:
    """A node whose pool holds `count` alive instances without a model in their spec."""
    node = await harness.node()
    for i in range(count):
        spec = InstanceSpec(id=f"e{i}", url=f"http://127.0.0.1:{20000 + i}")
        await node.coordinator.register_instance(spec)
    return node


async def models_of(harness: Harness, url: str) -> list[str]:
    async with harness.http.get(url + "/v1/models") as resp:
        assert resp.status == 200
        return [m["id"] for m in (await resp.json())["data"]]


async def test_engines_are_asked_a_few_at_a_time(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = await register(harness, ENGINES)
    inflight, most = 0, 0

    async def engine_models(
        session: aiohttp.ClientSession, url: str, timeout_s: float
    ) -> list[dict[str, Any]]:
        nonlocal inflight, most
        inflight += 1
        most = max(most, inflight)
        for _ in range(3):  # every other ask that can start starts meanwhile
            await asyncio.sleep(0)
        inflight -= 1
        return [{"id": "m" + url.rsplit(":", 1)[1], "object": "model"}]

    monkeypatch.setattr(static, "engine_models", engine_models)
    expected = sorted(f"m{20000 + i}" for i in range(ENGINES))
    assert await models_of(harness, node.url) == expected
    assert most == node_app.MODELS_CONCURRENCY


async def test_engines_that_answer_after_the_deadline_are_left_out(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = await register(harness, 4)
    never = asyncio.Event()
    cancelled = []

    async def engine_models(
        session: aiohttp.ClientSession, url: str, timeout_s: float
    ) -> list[dict[str, Any]]:
        if url.endswith(":20001"):
            try:
                await never.wait()  # black-holed, within its own timeout
            except asyncio.CancelledError:
                cancelled.append(url)
                raise
        return [{"id": "m" + url.rsplit(":", 1)[1], "object": "model"}]

    monkeypatch.setattr(static, "engine_models", engine_models)
    monkeypatch.setattr(node_app, "MODELS_DEADLINE_S", 0.2)
    assert await models_of(harness, node.url) == ["m20000", "m20002", "m20003"]
    assert cancelled == ["http://127.0.0.1:20001"]


@pytest.fixture
async def engine_url() -> AsyncIterator[str]:
    """A server whose /<case>/v1/models answers as the case says."""
    big = b'{"data": [' + b'{"id": "m"},' * (static.MAX_MODELS_BYTES // 12) + b'{"id": "m"}]}'
    answers = {
        "ok": b'{"data": [{"id": "a"}, {"id": 7}, "x", {"id": "b", "owned_by": "o"}]}',
        "big": big,
        "text": b"<html>",
        "nolist": b'{"data": {"id": "a"}}',
    }

    async def models(request: web.Request) -> web.Response:
        return web.Response(body=answers[request.match_info["case"]])

    app = web.Application()
    app.router.add_get("/{case}/v1/models", models)
    async with served(app) as url:
        yield url


async def test_an_engines_list_keeps_entries_with_a_string_id(engine_url: str) -> None:
    async with aiohttp.ClientSession() as session:
        got = await static.engine_models(session, engine_url + "/ok/", 5.0)
    assert got == [{"id": "a"}, {"id": "b", "owned_by": "o"}]


@pytest.mark.parametrize(
    ("case", "why"), [("big", "larger than"), ("text", "not JSON"), ("nolist", "no data list")]
)
async def test_an_unusable_answer_is_refused(engine_url: str, case: str, why: str) -> None:
    async with aiohttp.ClientSession() as session:
        with pytest.raises(ValueError, match=why):
            await static.engine_models(session, f"{engine_url}/{case}", 5.0)
