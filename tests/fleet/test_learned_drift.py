"""Live: a node learns a mock engine's speed from traffic and follows a speed change.

One real mock engine registered with no timing, one proxy node; requests are sent one
at a time, so each finds the prefill free and teaches the node its prefill time. Then
the engine's speed is halved through its control endpoint while traffic goes on.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest

from coordinator import Coordinator
from coordinator.tokens import CHARS_PER_TOKEN
from local_fleet.engine_model import EngineTiming
from local_fleet.mock_engine import MockEngineConfig, RunningMockEngine, start_mock_engine
from tests.fake_engine import Harness, NodeServer
from tests.helpers import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SPEED = 0.5  # ms/token large enough to dwarf the loopback's own few ms
TRUE_PER_TOKEN = EngineTiming().prefill_ms_per_token / SPEED


@pytest.fixture
async def node_and_engine(harness: Harness) -> AsyncIterator[tuple[NodeServer, RunningMockEngine]]:
    """A node, and a mock engine that registers itself there (heartbeats) with no timing."""
    coordinator = await harness.coordinator(timing_flush_ms=1_000)
    node = await harness.node(coordinator)
    config = MockEngineConfig(
        port=0,
        speed=SPEED,
        seed=1,
        register=node.control_url,
        instance_id="e0",
        register_timing="none",
    )
    running = await start_mock_engine(config)
    try:
        yield node, running
    finally:
        await running.stop()


async def test_a_node_learns_an_engine_and_follows_its_drift(
    harness: Harness, node_and_engine: tuple[NodeServer, RunningMockEngine]
) -> None:
    node, engine = node_and_engine
    coordinator = node.coordinator
    await wait_for(lambda: _registered(coordinator), 10, "the engine to register itself")
    rng = random.Random(3)
    stop = asyncio.Event()
    headers: list[str] = []

    async def traffic() -> None:
        while not stop.is_set():
            tokens = rng.randint(100, 3000)
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": "x" * (tokens * CHARS_PER_TOKEN)}],
                "max_tokens": 3,
                "stream": True,
            }
            async with harness.http.post(node.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                headers.append(resp.headers["X-Predicted-TTFT-Ms"])
                await resp.read()

    def learned_within(true: float) -> bool:
        row = coordinator._cache.rows.get("e0")
        if row is None or row.timing is None or row.timing.prefill != "learned":
            return False
        return abs((row.spec.prefill_ms_per_token or 0.0) - true) <= 0.2 * true

    sender = asyncio.create_task(traffic())
    try:
        await wait_for(lambda: learned_within(TRUE_PER_TOKEN), 60, "the speed to be learned")
        assert all(h.isdigit() for h in headers), "every answer carried a prediction"
        async with harness.http.post(
            engine.url + "/control/speed", json={"speed": SPEED / 2}
        ) as resp:
            assert resp.status == 200
            assert (await resp.json())["speed"] == SPEED / 2
        await wait_for(lambda: learned_within(2 * TRUE_PER_TOKEN), 60, "the drift to be followed")
    finally:
        stop.set()
        await sender


async def _registered(coordinator: Coordinator) -> bool:
    return any(row.id == "e0" and row.alive for row in await coordinator.list_instances())
