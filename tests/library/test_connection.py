"""The client connect_redis builds: hiredis packs its commands, byte for byte as
redis-py's own packer would."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio.connection import Connection, UnixDomainSocketConnection
from redis.exceptions import DataError

from coordinator.connection import _with_hiredis_packing, connect_redis, eviction_warning
from coordinator.settings import Settings
from tests.helpers import private_server

COMMANDS: list[tuple[Any, ...]] = [
    ("EVALSHA", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db", 2, b"lc:{p}:meta", "lc:{p}:x"),
    ("HSET", "k", "f", 0.1, 1e20, -5, 12345678901234567890, 3.0, 1 / 3),
    ("SET", "k", "naïve ✓", b"\x00\xff raw bytes"),
    ("SCRIPT LOAD", "return 1"),  # a two-word command goes out as two words
    (b"CONFIG GET", "maxmemory"),
    ("GET", ""),
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: str(c[0]))
def test_hiredis_packs_the_same_bytes_as_redis_py(command: tuple[Any, ...]) -> None:
    ours = _with_hiredis_packing(Connection)().pack_command(*command)
    theirs = Connection().pack_command(*command)
    assert b"".join(ours) == b"".join(theirs)


def test_a_value_hiredis_refuses_gets_redis_py_s_error() -> None:
    with pytest.raises(DataError):
        _with_hiredis_packing(Connection)().pack_command("SET", "k", True)


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("redis://127.0.0.1:6379/9", Connection),
        ("unix:///tmp/none.sock", UnixDomainSocketConnection),
    ],
)
async def test_connect_redis_keeps_the_connection_class_of_the_url(url: str, base: type) -> None:
    client = connect_redis(url, Settings())
    try:
        cls = client.connection_pool.connection_class
        assert issubclass(cls, base) and cls is not base
        assert cls.pack_command is not base.pack_command
    finally:
        await client.aclose()


@pytest.mark.real
@pytest.mark.parametrize(
    ("maxmemory", "policy", "warned"),
    [
        ("100mb", "allkeys-lru", True),
        ("100mb", "allkeys-random", True),
        ("100mb", "noeviction", False),
        ("100mb", "volatile-lru", False),  # a pool's one key with a TTL: learned timing
        ("0", "allkeys-lru", False),  # no limit: nothing is evicted
    ],
)
async def test_an_evicting_server_is_warned_of(maxmemory: str, policy: str, warned: bool) -> None:
    with private_server() as server:
        client = connect_redis(server.url, Settings())
        try:
            await client.config_set("maxmemory", maxmemory)
            await client.config_set("maxmemory-policy", policy)
            warning = await eviction_warning(client)
            assert await eviction_warning(client) == warning  # asked again, the same
        finally:
            await client.aclose()
    assert (warning is not None) == warned
    if warning is not None:
        assert policy in warning and "noeviction" in warning


@pytest.mark.real
async def test_a_server_that_refuses_info_gets_no_warning() -> None:
    with private_server() as server:
        admin = connect_redis(server.url, Settings())
        await admin.execute_command("ACL", "SETUSER", "plain", "on", ">pw", "~*", "+@all", "-info")
        await admin.config_set("maxmemory", "100mb")
        await admin.config_set("maxmemory-policy", "allkeys-lru")
        limited = connect_redis(f"redis://plain:pw@127.0.0.1:{server.port}/0", Settings())
        try:
            assert await eviction_warning(limited) is None  # NOPERM: nothing to tell
            assert await eviction_warning(admin) is not None
        finally:
            await limited.aclose()
            await admin.aclose()
