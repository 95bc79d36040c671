"""Coordinator-level degraded mode (DESIGN.md §5) against a private server we stop and start."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from contextlib import suppress
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import NoPermissionError, OutOfMemoryError, ReadOnlyError, ResponseError

from coordinator import Coordinator, EpochFencedError, Settings
from coordinator.connection import connect_redis
from coordinator.errors import (
    CoordinationUnavailableError,
    is_access_refused,
    is_server_busy,
    is_write_refused,
)
from local_fleet.embedded import EmbeddedRedis, free_port
from tests.helpers import (
    assert_counters_match_reservations,
    counters,
    live_reservations,
    private_server,
    spec,
    wait_for,
)

pytestmark = pytest.mark.real

SETTINGS = Settings(redis_timeout_ms=100, recovery_interval_ms=50)


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    """A private server on a fixed port; `stop()` then `start()` brings it back empty."""
    with private_server() as server:
        yield server


@pytest.fixture
async def node(server: EmbeddedRedis) -> AsyncIterator[Coordinator]:
    """One node on the private server, with three registered instances."""
    c = Coordinator(connect_redis(server.url, SETTINGS), pool="p", node_id="n1", settings=SETTINGS)
    try:
        for i in range(3):
            await c.register_instance(spec(i))
        yield c
    finally:
        await c.close()


async def assert_redis_equals_local(c: Coordinator) -> None:
    """Redis holds exactly the node's live local reservations, on the same instance and phase."""
    records = await live_reservations(c)
    local = c.local_reservations
    assert set(records) == set(local)
    for rid, rec in records.items():
        assert rec["instance"] == local[rid].instance_id, rid
        assert rec["phase"] == local[rid].phase, rid
        assert rec["node"] == c.node_id
        assert local[rid].in_redis
    await assert_counters_match_reservations(c)
    assert set(await c.redis.smembers(c.keys.node_rids(c.node_id))) == set(local)
    assert await c.redis.zscore(c.keys.column("nodes"), c.node_id) is not None


async def test_degraded_then_restart_empty_restores_exact_state(
    server: EmbeddedRedis, node: Coordinator
) -> None:
    c = node
    kept = [(await c.reserve(100, 10)).rid for _ in range(4)]
    assert await c.mark_first_token(kept[0])
    assert c.coordination == "ok"

    server.stop()
    made = [await c.reserve(100, 10) for _ in range(3)]
    assert all(r.degraded for r in made)
    assert c.coordination == "degraded"
    assert c.stats.degraded_entries == 1
    assert {r.instance_id for r in made} <= {"i0", "i1", "i2"}
    assert (await c.snapshot()).coordination == "degraded"
    # Transitions keep working on local state, and stay idempotent.
    assert await c.mark_first_token(kept[1]) is True
    assert await c.mark_first_token(made[0].rid) is True
    assert await c.release(kept[2]) is True
    assert await c.release(made[1].rid) is True
    assert await c.release(kept[2]) is False
    assert await c.release(made[1].rid) is False
    assert await c.release("never-reserved") is False
    again = await c.reserve(100, 10, rid=made[2].rid)
    assert again.degraded and again.instance_id == made[2].instance_id
    registered = await c.register_instance(spec(3))
    assert registered.status == "local"
    late = await c.reserve(100, 10)
    assert late.degraded
    live = {kept[0], kept[1], kept[3], made[0].rid, made[2].rid, late.rid}
    assert set(c.local_reservations) == live

    server.start()  # same port, empty
    await wait_for(lambda: c.coordination == "ok", what="coordination to recover")
    await assert_redis_equals_local(c)
    assert set(c.local_reservations) == live
    phases = {rid: rec["phase"] for rid, rec in (await live_reservations(c)).items()}
    assert phases == {
        kept[0]: "decode",
        kept[1]: "decode",
        kept[3]: "prefill",
        made[0].rid: "decode",
        made[2].rid: "prefill",
        late.rid: "prefill",
    }
    assert sum((await counters(c))["inflight"].values()) == len(live)
    # Registrations were re-asserted too, including the one made while degraded.
    assert {row.id for row in await c.list_instances()} == {"i0", "i1", "i2", "i3"}

    # Back to normal: shared reservations again, and everything drains to zero.
    fresh = await c.reserve(100, 10)
    assert not fresh.degraded
    for rid in [*live, fresh.rid]:
        assert await c.release(rid) is True
    await assert_counters_match_reservations(c)
    assert all(v == 0 for col in (await counters(c)).values() for v in col.values())
    assert await live_reservations(c) == {}


async def test_unreachable_server_keeping_state_gets_pending_changes(
    server: EmbeddedRedis, node: Coordinator
) -> None:
    c = node
    kept = [(await c.reserve(100, 10)).rid for _ in range(4)]
    assert await c.mark_first_token(kept[0])
    admin = Redis.from_url(server.url, decode_responses=True)
    try:
        try:
            # Scripts (EVALSHA counts as a write) hang and time out until UNPAUSE.
            await admin.client_pause(60_000, all=False)
        except ResponseError as exc:
            pytest.skip(f"server cannot CLIENT PAUSE WRITE: {exc}")
        made = [await c.reserve(100, 10) for _ in range(3)]
        assert all(r.degraded for r in made)
        assert c.coordination == "degraded"
        assert await c.mark_first_token(kept[1]) is True
        assert await c.release(kept[2]) is True  # stored in Redis: must be released there later
        assert await c.release(made[1].rid) is True  # never reached Redis: nothing to undo
        assert await c.release(kept[2]) is False
        await admin.client_unpause()

        await wait_for(lambda: c.coordination == "ok", what="coordination to recover")
        await assert_redis_equals_local(c)
        records = await live_reservations(c)
        assert kept[2] not in records and made[1].rid not in records
        assert set(records) == {kept[0], kept[1], kept[3], made[0].rid, made[2].rid}
        assert records[kept[1]]["phase"] == "decode"
        assert sum((await counters(c))["inflight"].values()) == 5
    finally:
        with suppress(ResponseError):
            await admin.client_unpause()
        await admin.aclose()


async def test_fenced_registration_is_not_reasserted(
    server: EmbeddedRedis, node: Coordinator
) -> None:
    c = node
    assert (await c.register_instance(spec(0, epoch=6))).epoch == 6
    held = [await c.reserve(100, 10) for _ in range(3)]
    assert {r.instance_id for r in held} == {"i0", "i1", "i2"}
    with pytest.raises(EpochFencedError):
        await c.register_instance(spec(0, epoch=4))  # a stale engine: refused

    server.stop()
    await c.snapshot()  # notices Redis is gone
    assert c.coordination == "degraded"
    server.start()
    await wait_for(lambda: c.coordination == "ok", what="coordination to recover")
    epochs = await c.redis.hgetall(c.keys.column("epoch"))
    assert epochs == {"i0": "6", "i1": "1", "i2": "1"}
    await assert_redis_equals_local(c)
    assert set(c.local_reservations) == {r.rid for r in held}


@contextlib.asynccontextmanager
async def refusing_writes(server: EmbeddedRedis, how: str) -> AsyncIterator[None]:
    """A window in which the server answers but refuses every write."""
    admin = Redis.from_url(server.url, decode_responses=True)
    try:
        if how == "oom":
            await admin.config_set("maxmemory-policy", "noeviction")
            await admin.config_set("maxmemory", "1")  # below what is used: OOM
        else:
            # A replica of a master that is not there: READONLY, data kept.
            await admin.replicaof("127.0.0.1", str(free_port()))
        yield
    finally:
        if how == "oom":
            await admin.config_set("maxmemory", "0")
        else:
            await admin.replicaof("NO", "ONE")
        await admin.aclose()


@pytest.mark.parametrize("how", ["oom", "readonly"])
async def test_write_refusing_errors_degrade_serve_and_reconcile(
    server: EmbeddedRedis, node: Coordinator, how: str
) -> None:
    """maxmemory + noeviction (or a read-only replica): no 500, degraded, reconciled."""
    c = node
    await c.renew_lease()
    kept = [(await c.reserve(100, 10)).rid for _ in range(3)]
    async with refusing_writes(server, how):
        made = [await c.reserve(100, 10) for _ in range(3)]
        assert all(r.degraded for r in made)
        assert c.coordination == "degraded"
        assert c.stats.write_refusals >= 1
        assert (await c.snapshot()).coordination == "degraded"
        assert await c.mark_first_token(kept[0]) is True
        assert await c.release(kept[1]) is True
        assert await c.release(made[0].rid) is True
        # Lease renewals fail too: the node keeps serving and waits for the window to end.
        with pytest.raises(CoordinationUnavailableError):
            await c.renew_lease()
    await wait_for(lambda: c.coordination == "ok", what="coordination to recover")
    await assert_redis_equals_local(c)
    records = await live_reservations(c)
    assert set(records) == {kept[0], kept[2], made[1].rid, made[2].rid}
    assert records[kept[0]]["phase"] == "decode"


@contextlib.asynccontextmanager
async def busy_script(server: EmbeddedRedis) -> AsyncIterator[None]:
    """A window in which another client's script runs past busy-reply-threshold: the
    server answers every other call BUSY until SCRIPT KILL ends it."""
    admin = Redis.from_url(server.url, decode_responses=True)
    blocker = Redis.from_url(server.url)
    await admin.config_set("busy-reply-threshold", "10")  # ms (lua-time-limit)
    spinning = asyncio.create_task(blocker.eval("while true do end", 0))

    async def busy() -> bool:
        try:
            await admin.ping()
        except ResponseError as exc:
            assert str(exc).startswith("BUSY "), exc
            return True
        return False

    try:
        await wait_for(busy, what="the server to answer BUSY")
        yield
    finally:
        await admin.script_kill()
        with pytest.raises(ResponseError, match="killed"):
            await spinning
        await admin.aclose()
        await blocker.aclose()


async def test_a_busy_server_degrades_loses_no_held_release_and_reconciles(
    server: EmbeddedRedis, node: Coordinator
) -> None:
    """Another client's long script (BUSY replies): requests are served locally, held
    marks and releases are not dropped, and Redis matches the node once it ends."""
    c = node
    await c.renew_lease()
    kept = [(await c.reserve(100, 10)).rid for _ in range(4)]
    async with busy_script(server):
        assert (await c.snapshot()).coordination == "degraded"  # read_state's MULTI/EXEC
        c.first_token_soon(kept[0])
        c.release_soon(kept[1])  # held: its carry call meets BUSY
        await c.flush_carried()
        made = [await c.reserve(100, 10) for _ in range(3)]
        assert all(r.degraded for r in made)
        assert c.coordination == "degraded"
        assert c.stats.write_refusals == 0  # BUSY is no write refusal
        assert await c.release(kept[2]) is True
        assert await c.release(made[0].rid) is True
    await wait_for(lambda: c.coordination == "ok", what="coordination to recover")
    await assert_redis_equals_local(c)
    records = await live_reservations(c)
    assert set(records) == {kept[0], kept[3], made[1].rid, made[2].rid}
    assert records[kept[0]]["phase"] == "decode"


@pytest.mark.parametrize(
    "revoked",
    [
        "-evalsha",  # the call itself: NoPermissionError
        "-time",  # refused inside the script, before reserve or release writes
    ],
)
async def test_an_acl_that_stops_allowing_a_command_degrades_and_reconciles(
    server: EmbeddedRedis, revoked: str
) -> None:
    """An ACL rule changed under a running node (NOPERM on a live connection): it
    serves from its own counters instead of failing requests, and reconciles once the
    rule allows it again."""
    admin = Redis.from_url(server.url, decode_responses=True)
    await admin.execute_command("ACL", "SETUSER", "node", "on", ">pw", "~*", "+@all")
    url = f"redis://node:pw@127.0.0.1:{server.port}/0"
    c = Coordinator(connect_redis(url, SETTINGS), pool="p", node_id="n1", settings=SETTINGS)
    try:
        for i in range(3):
            await c.register_instance(spec(i))
        kept = [(await c.reserve(100, 10)).rid for _ in range(3)]
        await admin.execute_command("ACL", "SETUSER", "node", revoked)
        made = [await c.reserve(100, 10) for _ in range(2)]
        assert all(r.degraded for r in made)
        assert c.coordination == "degraded"
        assert await c.release(kept[0]) is True
        await admin.execute_command("ACL", "SETUSER", "node", "+@all")
        await wait_for(lambda: c.coordination == "ok", what="coordination to recover")
        await assert_redis_equals_local(c)
        assert set(await live_reservations(c)) == {kept[1], kept[2], *(r.rid for r in made)}
    finally:
        await c.close()
        await admin.aclose()


def test_acl_refusals_are_recognised() -> None:
    assert is_access_refused(NoPermissionError("this user has no permissions to run 'x'"))
    inside = ResponseError(
        "The user executing the script can't run this command or subcommand script: "
        "90f3, on @user_script:1."
    )
    assert is_access_refused(inside) and not is_write_refused(inside)
    assert is_access_refused(ResponseError("ERR Error running script: NOPERM User u has no"))
    assert not is_access_refused(ResponseError("ERR unknown command 'FOO'"))


def test_busy_replies_are_recognised_and_are_no_write_refusal() -> None:
    busy = ResponseError("BUSY Redis is busy running a script. You can only call SCRIPT KILL")
    assert is_server_busy(busy) and not is_write_refused(busy)
    in_multi = ResponseError(  # how redis-py reports it from read_state's MULTI/EXEC
        "Command # 1 (EVALSHA c2e7 16 lc:{p}:meta ...) of pipeline caused error: BUSY Redis "
        "is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE."
    )
    assert is_server_busy(in_multi)
    assert not is_server_busy(ResponseError("ERR the word BUSY inside a message"))


@pytest.mark.parametrize(
    "text",
    [
        "OOM command not allowed when used memory > 'maxmemory'.",
        "Error running script (call to f_x): @user_script:12: OOM command not allowed",
        "READONLY You can't write against a read only replica.",
        "MISCONF Redis is configured to save RDB snapshots, but it's unable to persist",
        "NOREPLICAS Not enough good replicas to write.",
    ],
)
def test_write_refusing_replies_are_recognised(text: str) -> None:
    assert is_write_refused(ResponseError(text))
    assert is_write_refused(OutOfMemoryError("command not allowed"))
    assert is_write_refused(ReadOnlyError("You can't write against a read only replica."))
    assert not is_write_refused(ResponseError("ERR unknown command 'FOO'"))


async def alive_in_snapshot(c: Coordinator) -> set[str]:
    return {row.id for row in (await c.snapshot()).rows if row.alive}


async def test_alive_ids_are_the_snapshots_alive_rows_ok_expired_and_degraded(
    server: EmbeddedRedis,
) -> None:
    """/healthz counts alive instances with alive_ids(), which skips building the
    rows: it must agree with the snapshot in every state."""
    settings = Settings(
        redis_timeout_ms=100,
        recovery_interval_ms=50,
        instance_ttl_ms=400,
        heartbeat_interval_ms=100,
    )
    c = Coordinator(connect_redis(server.url, settings), pool="p", node_id="n1", settings=settings)
    try:
        for i in range(3):
            await c.register_instance(spec(i))
        assert await c.alive_ids() == await alive_in_snapshot(c) == {"i0", "i1", "i2"}

        async def only_i0_alive() -> bool:
            await c.heartbeat_instance("i0", {})
            return await alive_in_snapshot(c) == {"i0"}

        await wait_for(only_i0_alive, what="i1 and i2 to expire while i0 heartbeats")
        assert await c.alive_ids() == {"i0"}
        server.stop()
        await c.reserve(100, 10)  # finds Redis gone: degraded
        assert c.coordination == "degraded"
        assert (await c.register_instance(spec(3))).status == "local"
        assert await c.alive_ids() == await alive_in_snapshot(c) == {"i0", "i3"}
    finally:
        await c.close()


async def test_alive_ids_read_the_pool_only_when_a_decision_would(server: EmbeddedRedis) -> None:
    """/healthz asks alive_ids() on every probe: it takes the view a decision would
    take, not a whole read of the pool's state per probe (270 KB at 10,000 instances)."""
    settings = Settings(snapshot_max_age_ms=60_000, live_refresh_ms=60_000)
    c = Coordinator(connect_redis(server.url, settings), pool="p", node_id="n1", settings=settings)
    try:
        for i in range(3):
            await c.register_instance(spec(i))
        await c.refresh(live=True)
        reads: list[object] = []
        read = c._read_state

        async def counted(*args: Any, **kwargs: Any) -> list[Any]:
            reads.append(args)
            return await read(*args, **kwargs)

        c._read_state = counted  # type: ignore[method-assign]
        for _ in range(5):
            assert await c.alive_ids() == {"i0", "i1", "i2"}
        assert reads == []
        await c.snapshot()  # a snapshot is exact: it reads
        assert len(reads) == 1
    finally:
        await c.close()


async def test_degraded_ties_take_turns_so_no_instance_starves(
    server: EmbeddedRedis, node: Coordinator
) -> None:
    """Degraded, a node ranks on its own counts, and the requests it holds change the
    tie from call to call: each instance still gets its share (RoundRobin `turns`;
    a counter modulo the tie's size gave one of 4 engines 5% live)."""
    c = node
    await c.register_instance(spec(3))
    assert await c.release((await c.reserve(100, 10)).rid) is True
    assert c.coordination == "ok"
    server.stop()
    # A request every 150 ms that takes 280-310 ms (tests/library/test_strategies.py
    # has the same schedule): what it holds changes the tie from call to call.
    held: list[tuple[int, str]] = []  # (end ms, rid)
    counts: dict[str, int] = {}
    for i in range(200):
        for end, rid in [h for h in held if h[0] <= 150 * i]:
            assert await c.release(rid) is True
            held.remove((end, rid))
        res = await c.reserve(100, 10)
        assert res.degraded
        counts[res.instance_id] = counts.get(res.instance_id, 0) + 1
        held.append((150 * i + 280 + 10 * (i % 4), res.rid))
    assert counts == {f"i{k}": 50 for k in range(4)}


async def test_degraded_rows_carry_no_frozen_hints(
    server: EmbeddedRedis, node: Coordinator
) -> None:
    """Engine hints stop with Redis (no node can store new ones): the ones read before
    are frozen, and an engine that looked idle then would draw every request until
    they age out. Degraded rows rank without them."""
    c = node
    for i in range(3):
        await c.store_hints(f"i{i}", {"engine_running": 0.0 if i == 0 else 40.0})
    await c.refresh()
    snap = await c.snapshot()
    assert {r.id: r.engine_running for r in snap.rows} == {"i0": 0.0, "i1": 40.0, "i2": 40.0}
    server.stop()
    picks = [(await c.reserve(100, 10)).instance_id for _ in range(6)]
    assert c.coordination == "degraded"
    degraded = await c.snapshot()
    assert all(r.engine_running is None and r.engine_waiting is None for r in degraded.rows)
    assert sorted(picks) == ["i0", "i0", "i1", "i1", "i2", "i2"]  # on its own counts
