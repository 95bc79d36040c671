"""Build the redis-py asyncio client for a URL.

Accepted forms:
- `redis://[user:password@]host:port/db`, `rediss://...` (TLS), `unix:///path.sock`
- `redis+cluster://[user:password@]host:port[,host:port...]` — Redis Cluster; every
  pool lives in one hash slot through its `{pool}` tag
- `redis+sentinel://[user:password@]host:port[,host:port...]/master-name[/db]` — the
  master that the sentinels name, followed across failovers
"""

from __future__ import annotations

from functools import cache
from typing import Any
from urllib.parse import unquote

import hiredis
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from coordinator.errors import InvalidArgumentError
from coordinator.server_identity import ServerIdentity
from coordinator.settings import Settings

SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "redis+sentinel://")


def connect_redis(url: str, settings: Settings) -> Any:
    """A client whose every call times out after settings.redis_timeout_ms."""
    if not isinstance(url, str) or not url.startswith(SCHEMES):
        raise InvalidArgumentError(f"redis URL must start with one of {SCHEMES}, got {url!r}")
    timeout = settings.redis_timeout_ms / 1000
    options: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": max(timeout, 0.5),
        "decode_responses": True,
        # No transparent retry: a call that fails must reach the node, which degrades
        # and re-asserts. The cluster client's default (10 retries, backing off) held
        # a request for seconds when a primary died, and carried it on to a promoted
        # replica as if nothing had happened, so the writes the replica never got
        # (a release, say) were never repaired (docs/reliability.md). MOVED and ASK
        # are still followed: in a call, by the cluster client's own redirect loop;
        # in read_state's MULTI/EXEC, by Coordinator._read_state sending it again.
        "retry": Retry(NoBackoff(), 0),
    }
    if url.startswith("redis+cluster://"):
        user, password, hosts, _ = _split_multi(url)
        return RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in hosts],
            username=user,
            password=password,
            **options,
        )
    if url.startswith("redis+sentinel://"):
        user, password, hosts, path = _split_multi(url)
        parts = [p for p in path.split("/") if p]
        if not parts:
            raise InvalidArgumentError("a sentinel URL needs the master name: .../mymaster[/db]")
        db = int(parts[1]) if len(parts) > 1 else 0
        sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
            hosts,
            sentinel_kwargs={"socket_timeout": max(timeout, 0.5)},
            username=user,
            password=password,
            db=db,
            **options,
        )
        identity = ServerIdentity()
        master = sentinel.master_for(parts[0], redis_connect_func=identity.on_connect)
        master._coordinator_sentinel = sentinel  # closed with it: see close_redis()
        master._coordinator_identity = identity
        return _packed_by_hiredis(master)
    identity = ServerIdentity()
    client: Any = Redis.from_url(
        url, health_check_interval=0, redis_connect_func=identity.on_connect, **options
    )
    client._coordinator_identity = identity
    return _packed_by_hiredis(client)


class _HiredisPacking:
    """Commands packed by hiredis' C packer. redis-py's asyncio connections pack in
    Python: about 100 µs for a reserve's 75 arguments on a 2-core VM, against 14 µs
    here (the sync client already uses hiredis for this). Same bytes: both format
    numbers with repr()."""

    def pack_command(self, *args: Any) -> list[bytes]:
        head = args[0].encode() if isinstance(args[0], str) else args[0]
        if isinstance(head, bytes) and b" " in head:  # 'SCRIPT LOAD': separate words
            args = (*head.split(), *args[1:])
        try:
            return [hiredis.pack_command(args)]
        except TypeError:  # a type hiredis refuses (bool, None): redis-py's own error
            return super().pack_command(*args)  # type: ignore[misc, no-any-return]


async def eviction_warning(client: Any) -> str | None:
    """What to warn an operator of when the server may evict any key: maxmemory set
    with an `allkeys-*` policy. A pool that loses single keys that way serves with
    wrong counters until the fleet's audit finds it and has every node re-assert
    (docs/reliability.md), and a lost registry makes instances vanish meanwhile. None when
    it cannot (`noeviction`; `volatile-*` evicts only keys with a TTL, which in a pool
    are its learned timing, relearned when lost, and the nodes' lease marks, which only
    tell two processes under one id apart) or when INFO is refused."""
    try:
        info = await client.info("memory")
    except (RedisError, OSError):
        return None
    # A cluster client answers per node: {node: {field: value}}.
    nested = bool(info) and all(isinstance(v, dict) for v in info.values())
    for memory in info.values() if nested else [info]:
        policy = str(memory.get("maxmemory_policy", ""))
        if int(memory.get("maxmemory", 0) or 0) > 0 and policy.startswith("allkeys-"):
            return (
                f"Redis may evict any key at maxmemory (maxmemory-policy {policy}): a pool "
                "that loses single keys serves with wrong counters, or without instances, "
                "until its audit rebuilds it; run its Redis with maxmemory-policy "
                "noeviction (or volatile-*)"
            )
    return None


@cache
def _with_hiredis_packing(connection_class: type) -> type:
    return type(connection_class.__name__, (_HiredisPacking, connection_class), {})


def _packed_by_hiredis(client: Any) -> Any:
    """`client`, its new connections packing commands with hiredis (the cluster client
    builds its per-node connections itself and keeps redis-py's packer)."""
    pool = client.connection_pool
    pool.connection_class = _with_hiredis_packing(pool.connection_class)
    return client


async def close_redis(client: Any) -> None:
    """Close a client from connect_redis, with every connection it opened."""
    await client.aclose()
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        await pool.disconnect()
    sentinel = getattr(client, "_coordinator_sentinel", None)
    for peer in getattr(sentinel, "sentinels", ()):
        await peer.aclose()


def _split_multi(url: str) -> tuple[str | None, str | None, list[tuple[str, int]], str]:
    """(user, password, [(host, port)], path) of a multi-host URL."""
    rest = url.split("://", 1)[1]
    netloc, _, path = rest.partition("/")
    user = password = None
    if "@" in netloc:
        creds, netloc = netloc.rsplit("@", 1)
        name, _, secret = creds.partition(":")
        user, password = (unquote(name) or None), (unquote(secret) or None)
    hosts = []
    for item in filter(None, netloc.split(",")):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidArgumentError(f"bad host:port {item!r} in {redact(url)}")
        hosts.append((host, int(port)))
    if not hosts:
        raise InvalidArgumentError(f"no host in {redact(url)}")
    return user, password, hosts, path


def redact(url: str) -> str:
    """The URL without its password, for logs and status output."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    creds, _, host = rest.rpartition("@")
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user + ':***' if user else '***'}@{host}"
