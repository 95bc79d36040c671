"""The vLLM registration sidecar of docs/deploy.md, run as written (sh + curl)
against a real proxy node and a stand-in engine on loopback: it registers once the
engine is healthy, heartbeats, and registers again with a higher epoch after the
engine restarts."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from coordinator.models import InstanceLoad
from tests.fake_engine import Harness, NodeServer
from tests.helpers import wait_for

DOC = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"
TOKEN = "sidecar-test-token"
INSTANCE = "vllm-0"

pytestmark = [
    pytest.mark.slow,  # the script heartbeats every 3 s, as documented
    pytest.mark.skipif(shutil.which("curl") is None, reason="the sidecar script needs curl"),
]


def sidecar() -> dict[str, Any]:
    """The sidecar container from the vLLM pod example in docs/deploy.md."""
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    (pod,) = [yaml.safe_load(b) for b in blocks if "coordinator-registration" in b]
    (container,) = pod["spec"]["initContainers"]
    assert container["restartPolicy"] == "Always"  # a native sidecar
    assert isinstance(container, dict)
    return container


class Engine:
    """A stand-in for vLLM's GET /health that can go down and come back."""

    def __init__(self) -> None:
        self.healthy = True
        self.refused = 0  # health checks answered 503
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def health(self, request: web.Request) -> web.Response:
        if not self.healthy:
            self.refused += 1
        return web.Response(status=200 if self.healthy else 503)

    async def down_until_checked(self) -> None:
        """Turn unhealthy until the sidecar has seen it at least once."""
        self.healthy, seen = False, self.refused
        await wait_for(lambda: self.refused > seen, timeout_s=10, what="a failed health check")
        self.healthy = True

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.port = self.runner.addresses[0][1]


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    e = Engine()
    await e.start()
    yield e
    assert e.runner is not None
    await e.runner.cleanup()


async def start_sidecar(node: NodeServer, engine: Engine) -> asyncio.subprocess.Process:
    container = sidecar()
    assert container["command"] == ["/bin/sh", "-c"]
    documented = {e["name"] for e in container["env"]}
    env = {
        "PATH": os.environ["PATH"],
        "POD_NAME": INSTANCE,
        "POD_IP": "127.0.0.1",
        "CONTROL": node.control_url,
        "TOKEN": TOKEN,
        "ENGINE_PORT": str(engine.port),
    }
    assert set(env) - {"PATH"} == documented
    return await asyncio.create_subprocess_exec(
        "sh", "-c", container["args"][0], env=env, stdout=asyncio.subprocess.DEVNULL
    )


async def instance(node: NodeServer) -> InstanceLoad | None:
    rows = await node.coordinator.list_instances(include_dead=True)
    return next((row for row in rows if row.id == INSTANCE), None)


async def test_the_sidecar_registers_heartbeats_and_re_registers_after_a_restart(
    harness: Harness, engine: Engine
) -> None:
    node = await harness.node(token=TOKEN)
    engine.healthy = False
    process = await start_sidecar(node, engine)
    try:
        await wait_for(lambda: engine.refused > 0, timeout_s=10, what="a health check")
        assert await instance(node) is None  # nothing before the engine is healthy
        engine.healthy = True

        async def registered() -> bool:
            row = await instance(node)
            return row is not None and row.alive

        await wait_for(registered, timeout_s=10, what="the sidecar's registration")
        registered_at = time.monotonic()
        first = await instance(node)
        assert first is not None
        assert first.url == f"http://127.0.0.1:{engine.port}" and first.spec.max_slots == 256

        async def heartbeat() -> bool:
            """Seen at least 0.5 s after the registration: a heartbeat arrived."""
            row = await instance(node)
            since_ms = (time.monotonic() - registered_at) * 1000
            return row is not None and row.last_seen_age_ms < since_ms - 500

        await wait_for(heartbeat, timeout_s=10, what="a heartbeat")
        same = await instance(node)
        assert same is not None and same.epoch == first.epoch

        await engine.down_until_checked()  # vLLM restarts

        async def new_epoch() -> bool:
            row = await instance(node)
            return row is not None and row.epoch > first.epoch

        await wait_for(new_epoch, timeout_s=10, what="a registration with a higher epoch")
    finally:
        process.terminate()
        await process.wait()


def pre_stop() -> str:
    """The vLLM container's preStop hook from the same pod example (python3 -c)."""
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    (pod,) = [yaml.safe_load(b) for b in blocks if "coordinator-registration" in b]
    (vllm,) = pod["spec"]["containers"]
    command = vllm["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["python3", "-c"]
    return str(command[2])


async def test_the_pre_stop_hook_drains_the_engine_while_the_sidecar_heartbeats(
    harness: Harness, engine: Engine
) -> None:
    """The hook cordons the engine and returns once its requests in flight are done;
    meanwhile the sidecar's heartbeats keep it registered, counted and out of
    rotation (leaving with DELETE instead, the next heartbeat's 404 registered it
    again, back in rotation while it drained)."""
    node = await harness.node(token=TOKEN)
    sidecar_process = await start_sidecar(node, engine)
    hook: asyncio.subprocess.Process | None = None
    try:

        async def registered() -> bool:
            row = await instance(node)
            return row is not None and row.alive

        await wait_for(registered, timeout_s=10, what="the sidecar's registration")
        held = await node.coordinator.reserve(100, 10)
        assert held.instance_id == INSTANCE
        env = {"PATH": os.environ["PATH"], "POD_NAME": INSTANCE, "CONTROL": node.control_url}
        hook = await asyncio.create_subprocess_exec(
            sys.executable, "-c", pre_stop(), env={**env, "TOKEN": TOKEN}
        )
        cordoned_at = time.monotonic()

        async def cordoned() -> bool:
            return INSTANCE in (await node.coordinator.read_outliers()).cordoned_ids()

        await wait_for(cordoned, timeout_s=10, what="the hook's cordon")

        async def heartbeat_after_cordon() -> bool:
            row = await instance(node)
            since_ms = (time.monotonic() - cordoned_at) * 1000
            return row is not None and row.last_seen_age_ms < since_ms - 500

        await wait_for(heartbeat_after_cordon, timeout_s=10, what="a heartbeat after the cordon")
        assert await cordoned() and hook.returncode is None  # still draining
        first = await instance(node)
        assert first is not None and first.epoch == held.epoch  # never registered again
        await node.coordinator.release(held.rid)
        assert await asyncio.wait_for(hook.wait(), 15) == 0
    finally:
        for process in (sidecar_process, hook):
            if process is not None and process.returncode is None:
                process.terminate()
                await process.wait()
