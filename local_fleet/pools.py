"""Removing a pool's keys from a Redis the fleet tooling used, and nothing else."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from coordinator.connection import close_redis, connect_redis
from coordinator.keys import PoolKeys
from coordinator.settings import Settings

DELETE_TIMEOUT_MS = 2000  # per Redis call: a scan of a big pool on a busy server


def delete_pool(redis_url: str, pool: str, key_prefix: str | None = None) -> int:
    """Delete every key of `pool` (prefix: COORD_KEY_PREFIX by default); returns how many.

    Works on any URL the coordinator accepts, Redis Cluster and Sentinel included.
    """
    prefix = key_prefix if key_prefix is not None else Settings.from_env().key_prefix
    pattern = PoolKeys(prefix, pool).pattern()

    async def delete() -> int:
        client = connect_redis(redis_url, replace(Settings(), redis_timeout_ms=DELETE_TIMEOUT_MS))
        try:
            found = [key async for key in client.scan_iter(match=pattern, count=500)]
            for key in found:  # one by one: a Redis Cluster refuses a multi-key DEL
                await client.delete(key)
            return len(found)
        finally:
            await close_redis(client)

    return asyncio.run(delete())
