"""Test harness over the local Redis Cluster and Sentinel topologies (local_fleet.topologies)."""

from __future__ import annotations

from collections.abc import Callable

import redis
from redis.asyncio import Redis as AsyncRedis

from local_fleet.topologies import (
    LocalRedisCluster,
    LocalSentinel,
    PoolPlacement,
    TopologyUnavailableError,
    place_pools,
)
from tests.fake_engine import Harness
from tests.helpers import delete_pool

__all__ = [
    "LocalRedisCluster",
    "LocalSentinel",
    "PoolPlacement",
    "TopologyHarness",
    "TopologyUnavailableError",
    "place_pools",
]


class TopologyHarness(Harness):
    """A Harness over a cluster or sentinel URL.

    Harness.close deletes the pool through `Redis.from_url(redis_url)`, which knows no
    redis+cluster:// or redis+sentinel:// URL; this one deletes it on the server that
    `keys_url()` names at close time (the pool's primary, or the current master).
    """

    def __init__(self, redis_url: str, pool: str, keys_url: Callable[[], str]) -> None:
        super().__init__(redis_url, pool)
        self.keys_url = keys_url

    async def close(self) -> None:
        """Stop nodes, engines and coordinators; delete the pool's keys if reachable."""
        for node in self.nodes:
            for runner in reversed(node.runners):
                await runner.cleanup()
        for engine in self.engines:
            await engine.stop()
        if self._http is not None:
            await self._http.close()
        for coordinator in self.coordinators:
            await coordinator.close()
        client = AsyncRedis.from_url(self.keys_url(), decode_responses=True, socket_timeout=1)
        try:
            await delete_pool(client, "lc", self.pool)
        except redis.RedisError:  # the server may be gone already
            pass
        finally:
            await client.aclose()
