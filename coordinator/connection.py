"""Build the redis-py asyncio client for a URL (redis://, rediss://, unix://)."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from coordinator.errors import InvalidArgumentError
from coordinator.settings import Settings

SCHEMES = ("redis://", "rediss://", "unix://")


def connect_redis(url: str, settings: Settings) -> Redis:
    """A client whose every call times out after settings.redis_timeout_ms."""
    if not url.startswith(SCHEMES):
        raise InvalidArgumentError(f"redis URL must start with one of {SCHEMES}, got {url!r}")
    timeout = settings.redis_timeout_ms / 1000
    options: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": max(timeout, 0.5),
        "decode_responses": True,
        "health_check_interval": 0,
    }
    return Redis.from_url(url, **options)


def redact(url: str) -> str:
    """The URL without its password, for logs and status output."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    creds, _, host = rest.rpartition("@")
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user + ':***' if user else '***'}@{host}"
