"""A node that reaches another Redis server process re-asserts, even when its client
followed the change without an error (coordinator/server_identity.py).

The silent case is made deterministic by dropping the node's pooled connections
before its next call, as redis-py does by itself with a connection the server closed
while the node was idle: the next call then opens a new connection and succeeds.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator import Coordinator, Settings
from coordinator.server_identity import ServerIdentity, identity_of
from local_fleet.embedded import EPHEMERAL_ARGS, ServerUnavailableError, find_server_binary
from local_fleet.topologies import ServerProcess, spawn
from tests.helpers import assert_counters_match_reservations, live_reservations, spec, wait_for

pytestmark = pytest.mark.real

SETTINGS = Settings(redis_timeout_ms=1000, recovery_interval_ms=50)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """Where the server keeps its snapshot (dump.rdb) across a restart."""
    return tmp_path


@pytest.fixture
def server(workdir: Path) -> Iterator[ServerProcess]:
    """A private server whose data dir outlives it: a restart loads its last SAVE."""
    try:
        process = spawn(find_server_binary(), workdir, list(EPHEMERAL_ARGS))
    except ServerUnavailableError as exc:
        pytest.skip(f"no Redis-compatible server to start: {exc}")
    try:
        yield process
    finally:
        process.stop()


async def idle_reconnect(node: Coordinator) -> None:
    """Drop the node's pooled connections: its next call connects afresh, silently."""
    await node.redis.connection_pool.disconnect()


async def test_a_restart_from_a_snapshot_while_idle_is_reasserted(
    server: ServerProcess, workdir: Path
) -> None:
    """Redis restarts from a snapshot older than the node's last release (RDB, or an
    AOF that lost its last second) while the node is idle. The release is lost with
    it: without the identity check the node carried on and the reservation stayed
    counted for good."""
    node = await Coordinator.connect(
        server.url, pool="p", node_id="n1", settings=SETTINGS, background=False
    )
    try:
        await node.register_instance(spec(0))
        kept = await node.reserve(10, 10)
        gone = await node.reserve(10, 10)
        with server.client() as client:
            client.save()  # the snapshot still holds `gone`
        assert await node.release(gone.rid)
        server.kill()
        server.stop()
        server = spawn(find_server_binary(), workdir, list(EPHEMERAL_ARGS), port=server.port)
        await idle_reconnect(node)
        assert gone.rid in await live_reservations(node)  # back from the snapshot
        later = await node.reserve(10, 10)  # its first call reaches the restarted server
        assert node.coordination == "degraded" and node.stats.server_changes == 1
        await wait_for(lambda: node.coordination == "ok", what="the re-assert")
        assert set(await live_reservations(node)) == {kept.rid, later.rid}
        await assert_counters_match_reservations(node)
    finally:
        await node.close()
        server.stop()


async def test_a_new_connection_to_the_same_server_changes_nothing(
    server: ServerProcess,
) -> None:
    """A connection the server closed while idle (its `timeout`), opened again."""
    node = await Coordinator.connect(
        server.url, pool="p", node_id="n1", settings=SETTINGS, background=False
    )
    try:
        await node.register_instance(spec(0))
        await node.reserve(10, 10)
        identity = identity_of(node.redis)
        assert identity is not None and identity.run_id is not None
        for _ in range(3):
            await idle_reconnect(node)
            await node.reserve(10, 10)
        assert node.coordination == "ok" and node.stats.server_changes == 0
        assert identity.changes == 0
    finally:
        await node.close()


async def test_a_server_that_refuses_info_is_served_without_the_check(
    server: ServerProcess,
) -> None:
    """An ACL without `+info` (docs/security.md lists it as optional): the node works
    as before and does not tell servers apart."""
    with server.client() as client:
        client.execute_command("ACL", "SETUSER", "noinfo", "on", ">pw", "~*", "+@all", "-info")
    url = f"redis://noinfo:pw@127.0.0.1:{server.port}/0"
    node = await Coordinator.connect(
        url, pool="p", node_id="n1", settings=SETTINGS, background=False
    )
    try:
        await node.register_instance(spec(0))
        res = await node.reserve(10, 10)
        assert not res.degraded and node.coordination == "ok"
        identity = identity_of(node.redis)
        assert identity is not None and identity.run_id is None
    finally:
        await node.close()


def test_identity_counts_a_change_of_run_id_not_the_first_sighting() -> None:
    identity = ServerIdentity()
    identity.saw("a" * 40)
    identity.saw("a" * 40)
    assert identity.changes == 0
    identity.saw("b" * 40)
    identity.saw("b" * 40)
    identity.saw("a" * 40)
    assert (identity.changes, identity.run_id) == (2, "a" * 40)
