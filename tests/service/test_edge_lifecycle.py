"""Starting and stopping a node (issue 14 item 7).

On Python 3.11 redis-py can swallow a task's cancellation (asyncio.wait_for returns
the inner result when it finished in the same loop turn as the cancel), so a loop
that only relies on CancelledError keeps running and shutdown waits on it forever.
Every background loop must end anyway; `coordinator serve` must exit non-zero on a
taken port, and on SIGTERM turn not-ready but serve on for its drain delay, then stop
within its drain timeout.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from redis.asyncio import Redis

from coordinator import Coordinator, Settings
from coordinator.errors import CoordinationUnavailableError
from coordinator.outliers import OutlierPolicy
from local_fleet.embedded import free_port
from proxy_node import hints, static
from proxy_node.health import PassiveHealth
from proxy_node.metrics import NodeMetrics
from tests.fake_engine import FakeEngine
from tests.helpers import delete_pool, wait_for

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


class Swallower:
    """Stands in for a Redis call that swallows a cancellation, as redis-py can on 3.11."""

    def __init__(self) -> None:
        self.calls = 0
        self.entered = asyncio.Event()

    async def call(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        self.entered.set()
        if self.calls > 1:
            await asyncio.sleep(30)  # later calls take a cancel normally: a failing test ends
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            pass  # swallowed: the caller's task stays `cancelling()`
        raise ConnectionError("the call failed instead")


async def ends_after_cancel(make: Callable[[], Awaitable[None]], entered: asyncio.Event) -> None:
    task = asyncio.create_task(make())
    await asyncio.wait_for(entered.wait(), 10)
    task.cancel()
    done, _ = await asyncio.wait((task,), timeout=10)
    if not done:
        task.cancel()  # clean up: the loop ignored its first cancel
        await asyncio.wait((task,), timeout=5)
    assert done, "the loop kept running after its cancellation was swallowed"
    assert task.cancelled()


async def test_the_hint_scraper_ends_when_its_cancel_is_swallowed() -> None:
    swallower = Swallower()

    class StubCoordinator:
        snapshot = swallower.call

    async with aiohttp.ClientSession() as session:
        await ends_after_cancel(
            lambda: hints.scrape_loop(StubCoordinator(), session, 0.05),  # type: ignore[arg-type]
            swallower.entered,
        )


async def test_the_static_keep_alive_ends_when_its_cancel_is_swallowed() -> None:
    swallower = Swallower()

    class StubCoordinator:
        snapshot = swallower.call

    engine = await FakeEngine().start()
    try:
        instances = static.static_instances([engine.url])
        async with aiohttp.ClientSession() as session:
            await ends_after_cancel(
                lambda: static.keep_alive(StubCoordinator(), session, instances, 0.05),  # type: ignore[arg-type]
                swallower.entered,
            )
    finally:
        await engine.stop()


async def test_the_passive_health_refresh_ends_when_its_cancel_is_swallowed() -> None:
    swallower = Swallower()

    class StubCoordinator:
        read_outliers = swallower.call

    health = PassiveHealth(
        StubCoordinator(),  # type: ignore[arg-type]
        OutlierPolicy(),
        NodeMetrics("n", "p", "0"),
    )
    # ConnectionError is not a CoordinatorError: let refresh() see the failure shape it
    # gets from a real coordinator.
    health.coordinator.read_outliers = _as_coordinator_error(swallower.call)  # type: ignore[method-assign]
    await ends_after_cancel(health.refresh_loop, swallower.entered)


def _as_coordinator_error(call: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def wrapped(*args: Any) -> Any:
        try:
            return await call(*args)
        except ConnectionError as exc:
            raise CoordinationUnavailableError(str(exc)) from exc

    return wrapped


async def test_the_lease_loop_ends_when_its_cancel_is_swallowed(redis_url: str, pool: str) -> None:
    coordinator = await Coordinator.connect(redis_url, pool=pool, background=False)
    swallower = Swallower()

    async def reap_expired() -> int:
        try:
            return int(await swallower.call())
        except ConnectionError:
            return 0

    coordinator.reap_expired = reap_expired  # type: ignore[method-assign]
    try:
        await ends_after_cancel(coordinator._lease_loop, swallower.entered)
    finally:
        await delete_pool(coordinator.redis, coordinator.settings.key_prefix, pool)
        await coordinator.close()


@pytest.mark.parametrize("after", ["returns", "unavailable"])
async def test_the_timing_loop_ends_when_its_cancel_is_swallowed(
    redis_url: str, pool: str, after: str
) -> None:
    """A merge whose Redis call swallowed the cancel and then succeeded (or found Redis
    away) must not keep the loop going: a node's close() then waited for it forever and
    the node never exited after SIGTERM (seen once in CI's graceful-drain test)."""
    settings = Settings(timing_flush_ms=10)
    coordinator = await Coordinator.connect(
        redis_url, pool=pool, settings=settings, background=False
    )
    swallower = Swallower()

    async def sync_timing() -> None:
        try:
            await swallower.call()
        except ConnectionError:
            if after == "unavailable":
                raise CoordinationUnavailableError("redis went away") from None

    coordinator.sync_timing = sync_timing  # type: ignore[method-assign]
    try:
        await ends_after_cancel(coordinator._timing_loop, swallower.entered)
    finally:
        await delete_pool(coordinator.redis, coordinator.settings.key_prefix, pool)
        await coordinator.close()


# ---------------------------------------------------------------------- the process


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COORD_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


async def _serve(*args: str, env: dict[str, str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "proxy_node",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


@dataclass
class StaticNode:
    """A node process serving one static instance, with a client session and Redis."""

    proc: asyncio.subprocess.Process
    port: int
    control: int
    session: aiohttp.ClientSession
    redis: Redis


@asynccontextmanager
async def _static_node(
    engine: FakeEngine, redis_url: str, pool: str, *flags: str
) -> AsyncIterator[StaticNode]:
    """Start a node on `engine` and wait until it serves it; clean everything up after."""
    port, control = free_port(), free_port()
    proc = await _serve(
        "--port",
        str(port),
        "--control-port",
        str(control),
        *flags,
        "--instance",
        engine.url,
        env=_env(COORD_REDIS_URL=redis_url, COORD_POOL=pool),
    )
    node = StaticNode(proc, port, control, aiohttp.ClientSession(), Redis.from_url(redis_url))
    try:
        await _wait_serving(node.session, control)
        yield node
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await node.session.close()
        await engine.stop()
        await delete_pool(node.redis, "lc", pool)
        await node.redis.aclose()


async def _wait_serving(session: aiohttp.ClientSession, control: int) -> None:
    """Until the node's control plane reports its static instance alive."""

    async def up() -> bool:
        try:
            async with session.get(f"http://127.0.0.1:{control}/healthz") as resp:
                return resp.status == 200 and (await resp.json())["alive_instances"] == 1
        except aiohttp.ClientError:
            return False

    await wait_for(up, 20, "the node to serve its static instance")


async def test_serve_exits_non_zero_when_its_port_is_taken(redis_url: str, pool: str) -> None:
    engine = await FakeEngine(metrics_text="vllm:num_requests_running 1\n").start()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        # With --instance and Redis up: the node's tasks are running when the bind fails.
        proc = await _serve(
            "--port",
            str(port),
            "--control-port",
            str(free_port()),
            "--instance",
            engine.url,
            "--scrape-interval-s",
            "0.05",
            env=_env(COORD_REDIS_URL=redis_url, COORD_POOL=pool),
        )
        try:
            _, err = await asyncio.wait_for(proc.communicate(), 30)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            pytest.fail("coordinator serve hung on a taken port")
        assert proc.returncode == 1, err
        assert b"address already in use" in err.lower(), err
    finally:
        taken.close()
        await engine.stop()
        client = Redis.from_url(redis_url)
        await delete_pool(client, "lc", pool)
        await client.aclose()


async def test_sigterm_stops_within_the_drain_timeout(redis_url: str, pool: str) -> None:
    engine = await FakeEngine(chunks=3, gate_after=1).start()  # holds every stream open
    async with _static_node(engine, redis_url, pool, "--drain-timeout-s", "1") as node:
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
        resp = await node.session.post(
            f"http://127.0.0.1:{node.port}/v1/chat/completions", json=body
        )
        await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10)  # a stream in flight
        node.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(node.proc.wait(), 20)  # drain 1 s + the node's own teardown
        except TimeoutError:
            pytest.fail("the node did not stop within its drain timeout")
        assert node.proc.returncode == 0
        resp.close()
        # The held stream's reservation was released on the way out, and the node left
        # no lease behind for peers to wait out.
        assert await node.redis.hlen(f"lc:{{{pool}}}:reservations") == 0
        assert await node.redis.zcard(f"lc:{{{pool}}}:nodes") == 0


async def test_during_the_drain_delay_the_node_serves_but_is_not_ready(
    redis_url: str, pool: str
) -> None:
    engine = await FakeEngine(chunks=2).start()
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with _static_node(engine, redis_url, pool, "--drain-delay-s", "3") as node:

        async def health(plane: int) -> tuple[int, str]:
            async with node.session.get(f"http://127.0.0.1:{plane}/healthz") as resp:
                return resp.status, (await resp.json())["status"]

        assert await health(node.port) == (200, "ok")
        node.proc.send_signal(signal.SIGTERM)

        async def draining() -> bool:
            return await health(node.port) == (503, "draining")

        await wait_for(draining, 2, "/healthz to answer 503 draining")
        assert await health(node.control) == (503, "draining")
        # Not ready, yet still serving: a balancer that has not noticed loses nothing.
        url = f"http://127.0.0.1:{node.port}/v1/chat/completions"
        async with node.session.post(url, json=body) as resp:
            assert resp.status == 200
            assert (await resp.read()).endswith(b"data: [DONE]\n\n")
        await asyncio.wait_for(node.proc.wait(), 20)
        assert node.proc.returncode == 0
        assert await node.redis.zcard(f"lc:{{{pool}}}:nodes") == 0
