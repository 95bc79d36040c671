"""Shared fixtures: a real Redis-compatible server by default, fakeredis on request.

The server is private (started on a free port) unless COORD_TEST_REDIS_URL names one,
which CI uses to run the real-server tests against the machine's Redis 7 as well.
Every test works in its own pool and deletes only that pool's keys afterwards.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
from redis.asyncio import Redis

from coordinator import Coordinator, Settings
from local_fleet.embedded import EmbeddedRedis, ServerUnavailableError
from tests.fake_engine import Harness
from tests.helpers import delete_pool

BACKENDS = ("real", "fake")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a real Redis-compatible server for this test session."""
    external = os.environ.get("COORD_TEST_REDIS_URL")
    if external:
        yield external
        return
    try:
        server = EmbeddedRedis().start()
    except ServerUnavailableError as exc:
        pytest.skip(f"no Redis-compatible server available: {exc}")
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def pool() -> str:
    """A pool name no other test uses."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def real_client(redis_url: str, pool: str) -> AsyncIterator[Redis]:
    """A plain client of the real server; the test pool is deleted afterwards."""
    client = Redis.from_url(redis_url, decode_responses=True)
    try:
        yield client
    finally:
        await delete_pool(client, "lc", pool)
        await client.aclose()


MakeCoordinator = Callable[..., Awaitable[Coordinator]]


@pytest.fixture
async def harness(redis_url: str, pool: str) -> AsyncIterator[Harness]:
    """Engines, coordinators and nodes for one test (tests/fake_engine.py); all closed after."""
    h = Harness(redis_url, pool)
    try:
        yield h
    finally:
        await h.close()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Run a test once against the real server and once against fakeredis (with Lua)."""
    marker = request.param
    request.applymarker(getattr(pytest.mark, marker))
    return str(marker)


def _client_factory(backend: str, redis_url: str, settings: Settings) -> Callable[[], Any]:
    if backend == "fake":
        import fakeredis

        server = fakeredis.FakeServer()
        return lambda: fakeredis.FakeAsyncRedis(server=server, decode_responses=True)
    from coordinator.connection import connect_redis

    return lambda: connect_redis(redis_url, settings)


@pytest.fixture
async def make_coordinator(
    backend: str, redis_url: str, pool: str
) -> AsyncIterator[MakeCoordinator]:
    """Factory of Coordinators (one per node) on the test pool; closes what it makes."""
    made: list[Coordinator] = []
    factories: dict[int, Callable[[], Any]] = {}

    async def make(
        node_id: str | None = None, settings: Settings | None = None, **overrides: Any
    ) -> Coordinator:
        settings = settings or Settings(redis_timeout_ms=1000, **overrides)
        factory = factories.setdefault(0, _client_factory(backend, redis_url, settings))
        coordinator = Coordinator(
            factory(), pool=pool, node_id=node_id, settings=settings, seed=len(made)
        )
        made.append(coordinator)
        return coordinator

    yield make
    if made:
        await delete_pool(made[0].redis, made[0].settings.key_prefix, pool)
    for coordinator in made:
        await coordinator.close()
