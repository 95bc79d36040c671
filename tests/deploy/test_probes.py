"""The chart's readiness probes run against a real proxy node (loopback): the exec
probe that also fails while degraded, and the default one that does not; both fail
while the node drains."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aiohttp
import pytest

from coordinator import Coordinator, Settings
from local_fleet.embedded import free_port
from proxy_node.state import STATE
from tests.deploy.chart import node_container, render
from tests.fake_engine import Harness, NodeServer

PROBE_TIMEOUT_S = 10.0  # the probe's own HTTP timeout is 2 s; Python starts in well under


def readiness_command(node: NodeServer, fail_when_degraded: bool) -> list[str] | None:
    """The readiness exec command the chart renders for this node's port (None: httpGet)."""
    port = urlsplit(node.url).port
    values = {
        "redis": {"host": "r"},
        "node": {"servicePort": port},
        "probes": {"readiness": {"failWhenDegraded": fail_when_degraded}},
    }
    probe = node_container(render(values))["readinessProbe"]
    if "exec" not in probe:
        return None
    command: list[str] = probe["exec"]["command"]
    assert command[0] == "python"  # the image's interpreter; here the test's own
    return [sys.executable, *command[1:]]


async def run_probe(command: list[str]) -> int:
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    return await asyncio.wait_for(process.wait(), PROBE_TIMEOUT_S)


async def healthz_status(node: NodeServer) -> int:
    async with aiohttp.ClientSession() as http, http.get(node.url + "/healthz") as resp:
        return resp.status


@pytest.fixture
async def degraded(harness: Harness) -> AsyncIterator[NodeServer]:
    """A node whose Redis is unreachable: it serves, degraded."""
    coordinator = await Coordinator.connect(
        f"redis://127.0.0.1:{free_port()}/0",
        pool=harness.pool,
        settings=Settings(redis_timeout_ms=200),
        background=False,
    )
    try:
        node = await harness.node(coordinator)
        assert coordinator.coordination == "degraded"
        yield node
        for runner in reversed(node.runners):
            await runner.cleanup()
        harness.nodes.remove(node)
    finally:
        await coordinator.close()


async def test_exec_readiness_passes_on_a_coordinated_node(harness: Harness) -> None:
    node = await harness.node()
    command = readiness_command(node, fail_when_degraded=True)
    assert command is not None
    assert await run_probe(command) == 0


async def test_exec_readiness_fails_on_a_degraded_node(degraded: NodeServer) -> None:
    command = readiness_command(degraded, fail_when_degraded=True)
    assert command is not None
    assert await run_probe(command) == 1
    # By default readiness is an httpGet, and a degraded node still answers 200:
    # it keeps serving from its own counters.
    assert readiness_command(degraded, fail_when_degraded=False) is None
    assert await healthz_status(degraded) == 200


async def test_exec_readiness_fails_when_nothing_listens(harness: Harness) -> None:
    node = await harness.node()
    command = readiness_command(node, fail_when_degraded=True)
    assert command is not None
    for runner in node.runners:
        await runner.cleanup()
    harness.nodes.remove(node)
    assert await run_probe(command) == 1


async def test_both_readiness_probes_fail_on_a_draining_node(harness: Harness) -> None:
    node = await harness.node()
    command = readiness_command(node, fail_when_degraded=True)
    assert command is not None
    assert await run_probe(command) == 0 and await healthz_status(node) == 200
    node.app[STATE].draining = True  # what SIGTERM does first (proxy_node/serve.py)
    assert await run_probe(command) == 1
    assert readiness_command(node, fail_when_degraded=False) is None
    assert await healthz_status(node) == 503  # the default httpGet probe fails
