"""The client connect_redis builds: hiredis packs its commands, byte for byte as
redis-py's own packer would."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio.connection import Connection, UnixDomainSocketConnection
from redis.exceptions import DataError

from coordinator.connection import _with_hiredis_packing, connect_redis
from coordinator.settings import Settings

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
