"""The core invariants on a real 3-primary Redis Cluster, with pools on different shards.

Pool names are chosen by hash slot (local_fleet/topologies.place_pools) so that the pools of
one test live on at least two different primaries; every test works only in its own
pools and deletes their keys afterwards.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.crc import key_slot

from coordinator import Coordinator, EpochFencedError, InstanceSpec, Settings
from coordinator.keys import PoolKeys
from coordinator.scripts import SCRIPT_NAMES
from local_fleet.embedded import ServerUnavailableError
from tests.fake_engine import settled
from tests.helpers import assert_counters_match_reservations, counters, delete_pool, spec, wait_for
from tests.topologies import LocalRedisCluster, PoolPlacement, TopologyHarness, place_pools

pytestmark = [pytest.mark.slow, pytest.mark.real, pytest.mark.timeout(60)]

SETTINGS = Settings(redis_timeout_ms=1000, recovery_interval_ms=50, instance_ttl_ms=60_000)
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}]}

MakeNode = Callable[[str, str], Awaitable[Coordinator]]


def _start_cluster() -> LocalRedisCluster:
    try:
        return LocalRedisCluster(3).start()
    except ServerUnavailableError as exc:
        pytest.skip(f"cannot run a local Redis Cluster: {exc}")


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRedisCluster]:
    """One 3-primary cluster shared by the module's tests (each in its own pools)."""
    topology = _start_cluster()
    try:
        yield topology
    finally:
        topology.stop()


@pytest.fixture
def placement(cluster: LocalRedisCluster) -> PoolPlacement:
    """Three fresh pool names, one per primary."""
    return place_pools(cluster, 3, f"c{uuid.uuid4().hex[:6]}-")


@pytest.fixture
async def make_node(cluster: LocalRedisCluster) -> AsyncIterator[MakeNode]:
    """Factory of Coordinators over the cluster URL; closes them and deletes their pools."""
    made: list[Coordinator] = []

    async def make(pool: str, node_id: str) -> Coordinator:
        coordinator = await Coordinator.connect(
            cluster.url, pool=pool, node_id=node_id, settings=SETTINGS, background=False
        )
        made.append(coordinator)
        return coordinator

    yield make
    for coordinator in made:
        await coordinator.close()
    for pool in {c.pool for c in made}:
        owner = cluster.owner_of(PoolKeys("lc", pool).column("meta"))
        if owner.alive:
            client = Redis.from_url(owner.url, decode_responses=True)
            try:
                await delete_pool(client, "lc", pool)
            finally:
                await client.aclose()


@dataclass
class OwnCluster:
    """A cluster of one test's own (it kills, promotes or reshards), one pool on it,
    and the test's node on that pool once connected."""

    topology: LocalRedisCluster
    pool: str
    node: Coordinator | None = None

    async def connect(self) -> Coordinator:
        self.node = await Coordinator.connect(
            self.topology.url, pool=self.pool, node_id="n1", settings=SETTINGS, background=False
        )
        return self.node


@pytest.fixture
async def own_cluster() -> AsyncIterator[OwnCluster]:
    topology = _start_cluster()
    own = OwnCluster(topology, place_pools(topology, 1, "o").pools[0])
    try:
        yield own
    finally:
        if own.node is not None:
            await own.node.close()
        topology.stop()


async def _keys_by_port(cluster: LocalRedisCluster, pattern: str) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for server in cluster.primaries:
        client = Redis.from_url(server.url, decode_responses=True)
        try:
            out[server.port] = {k async for k in client.scan_iter(match=pattern, count=500)}
        finally:
            await client.aclose()
    return out


async def test_each_pool_lives_whole_on_its_own_primary(
    cluster: LocalRedisCluster, placement: PoolPlacement, make_node: MakeNode
) -> None:
    assert len(set(placement.owners.values())) == 3
    for pool in placement.pools:
        node = await make_node(pool, "n1")
        await node.register_instance(spec(0))
        res = await node.reserve(100, 10)
        await node.mark_first_token(res.rid)
        stems = await _keys_by_port(cluster, PoolKeys("lc", pool).pattern())
        owner = placement.owners[pool]
        # Every key of the pool (columns and the node's rid set) sits on the owner.
        assert len(stems[owner]) >= 10, stems
        assert all(not keys for port, keys in stems.items() if port != owner), stems
        await assert_counters_match_reservations(node)


async def test_lifecycle_invariants_on_pools_across_shards(
    placement: PoolPlacement, make_node: MakeNode
) -> None:
    per_pool: dict[str, tuple[Coordinator, Coordinator]] = {}
    for pool in placement.pools:
        a, b = await make_node(pool, "a"), await make_node(pool, "b")
        for i in range(4):
            await a.register_instance(spec(i))
        await b.refresh()
        per_pool[pool] = (a, b)
    # Both nodes of every pool reserve at once: 3 pools x 2 nodes x 6.
    jobs = [(n, n.reserve(100, 10)) for pair in per_pool.values() for n in pair for _ in range(6)]
    results = await asyncio.gather(*(job for _, job in jobs))
    held = [(node, res) for (node, _), res in zip(jobs, results, strict=True)]
    for node, res in held[::2]:
        assert await node.mark_first_token(res.rid) is True
    for a, _ in per_pool.values():
        stored = await counters(a)
        assert sum(stored["inflight"].values()) == 12
        assert sum(stored["active_decode"].values()) == 6
        await assert_counters_match_reservations(a)
    for node, res in held:
        assert await node.release(res.rid) is True
    for a, b in per_pool.values():
        before = await counters(a)
        assert all(v == 0 for column in before.values() for v in column.values()), before
        first = next(res for node, res in held if node is a)
        assert await b.release(first.rid) is False
        assert await a.release(first.rid) is False
        assert await a.release("never-reserved") is False
        assert await counters(a) == before
        await assert_counters_match_reservations(a)


async def test_herding_burst_spreads_evenly_on_two_shards(
    placement: PoolPlacement, make_node: MakeNode
) -> None:
    pools = placement.pools[:2]  # on two different primaries
    nodes: dict[str, list[Coordinator]] = {}
    for pool in pools:
        nodes[pool] = [await make_node(pool, f"n{k}") for k in range(4)]
        for i in range(16):
            await nodes[pool][0].register_instance(spec(i))
        for node in nodes[pool]:
            await node.refresh()
    # Every node has the same idle view, then 4 x 8 reserves per pool race.
    bursts = [node.reserve(100, 10) for pool in pools for node in nodes[pool] for _ in range(8)]
    results = await asyncio.gather(*bursts)
    assert len({r.rid for r in results}) == 64
    for pool in pools:
        per_instance = (await counters(nodes[pool][0]))["inflight"]
        assert sorted(per_instance.values()) == [2] * 16, (pool, per_instance)
        await assert_counters_match_reservations(nodes[pool][0])


async def test_noscript_after_script_flush_on_every_primary(
    cluster: LocalRedisCluster, placement: PoolPlacement, make_node: MakeNode
) -> None:
    nodes = [await make_node(pool, "n1") for pool in placement.pools]
    held = []
    for node in nodes:
        await node.register_instance(spec(0))
        held.append(await node.reserve(10, 10))
    shas = [nodes[0].scripts[name].sha for name in SCRIPT_NAMES]
    for server in cluster.primaries:
        client = Redis.from_url(server.url, decode_responses=True)
        try:
            await client.script_flush()
            assert not any(await client.script_exists(*shas))
        finally:
            await client.aclose()
    for node, res in zip(nodes, held, strict=True):
        assert await node.mark_first_token(res.rid) is True
        assert await node.release(res.rid) is True
        again = await node.reserve(10, 10)
        assert again.instance_id == "i0" and not again.degraded
        assert node.coordination == "ok"
        await assert_counters_match_reservations(node)
        assert (await counters(node))["inflight"] == {"i0": 1}
    # The fallback loaded the scripts again on the primaries (SCRIPT LOAD goes to all).
    owner = cluster.owner_of(nodes[0].keys.column("meta"))
    client = Redis.from_url(owner.url, decode_responses=True)
    try:
        assert all(await client.script_exists(nodes[0].scripts["reserve"].sha))
    finally:
        await client.aclose()


async def test_epoch_fencing_across_nodes(placement: PoolPlacement, make_node: MakeNode) -> None:
    pool = placement.pools[1]
    a, b = await make_node(pool, "a"), await make_node(pool, "b")
    assert (await a.register_instance(spec(0, epoch=5))).epoch == 5
    await b.refresh()
    old = await b.reserve(10, 10)
    await b.mark_first_token(old.rid)
    restarted = await a.register_instance(spec(0, epoch=6))
    assert (restarted.status, restarted.voided_reservations) == ("restarted", 1)
    assert await b.release(old.rid) is False
    assert (await counters(a))["inflight"] == {"i0": 0}
    with pytest.raises(EpochFencedError):
        await b.register_instance(spec(0, epoch=4))
    fresh = await b.reserve(10, 10)
    assert fresh.epoch == 6
    await assert_counters_match_reservations(a)


async def test_losing_one_primary_degrades_only_its_pools() -> None:
    topology = _start_cluster()
    nodes: list[Coordinator] = []
    try:
        placement = place_pools(topology, 2, "k")
        for pool in placement.pools:
            node = await Coordinator.connect(
                topology.url, pool=pool, node_id="n1", settings=SETTINGS, background=False
            )
            nodes.append(node)
            for i in range(2):
                await node.register_instance(spec(i))
            await node.reserve(10, 10)
        hit, spared = nodes
        victim = topology.owner_of(hit.keys.column("meta"))
        victim.kill()
        during = await hit.reserve(10, 10)  # served from local state
        assert during.degraded and hit.coordination == "degraded"
        other = await spared.reserve(10, 10)
        assert not other.degraded and spared.coordination == "ok"
        await assert_counters_match_reservations(spared)
        topology.restart(victim)  # back on its port and slots, but empty
        await wait_for(lambda: hit.coordination == "ok", what="the pool's node to recover")
        # Re-asserted onto the empty primary: registrations and both live reservations.
        assert sorted((await counters(hit))["inflight"].values()) == [1, 1]
        assert set(hit.local_reservations) == set(
            (await hit.redis.hgetall(hit.keys.column("reservations"))).keys()
        )
        await assert_counters_match_reservations(hit)
    finally:
        for node in nodes:
            await node.close()
        topology.stop()


async def test_a_release_lost_in_a_replica_take_over_is_not_left_behind(
    own_cluster: OwnCluster,
) -> None:
    """A primary crashes with a release its replica never got (asynchronous
    replication), and the replica takes over. The node's next call must fail and
    degrade, not be retried onto the new primary by the cluster client as if nothing
    happened: only the re-assert that follows releases what the new primary still
    holds for the node and the node no longer does."""
    topology = own_cluster.topology
    primary = topology.owner_of(PoolKeys("lc", own_cluster.pool).column("meta"))
    replica = topology.add_replica(primary)
    node = await own_cluster.connect()
    await node.register_instance(spec(0))
    kept = await node.reserve(10, 10)
    gone = await node.reserve(10, 10)
    with primary.client() as client:
        assert client.wait(1, 2000) == 1  # the replica has every write so far
    replica.pause()  # it cannot reconnect and catch up: writes now reach the primary only
    with primary.client() as client:
        client.execute_command("CLIENT", "KILL", "TYPE", "replica")
    assert await node.release(gone.rid) is True  # acknowledged by the old primary only
    primary.kill()
    replica.resume()
    topology.take_over(replica)
    assert gone.rid in await _records_on(replica.url, node)  # the lost release
    await node.snapshot()  # the first call after the crash
    assert node.coordination == "degraded"
    await wait_for(lambda: node.coordination == "ok", what="the node to recover")
    stored = await _records_on(replica.url, node)
    assert kept.rid in stored
    assert gone.rid not in stored, "a release the new primary never saw was left behind"
    await assert_counters_match_reservations(node)


async def test_a_manual_failover_is_followed_without_degrading(own_cluster: OwnCluster) -> None:
    """A replica promoted with CLUSTER FAILOVER (an operator's planned switch: it
    catches up first, so nothing is lost) answers the node's calls after the old
    primary answers them MOVED. The node follows, in scripts and in read_state's
    MULTI/EXEC alike, without failing a call or degrading."""
    topology = own_cluster.topology
    primary = topology.owner_of(PoolKeys("lc", own_cluster.pool).column("meta"))
    replica = topology.add_replica(primary)
    node = await own_cluster.connect()
    for i in range(3):
        await node.register_instance(spec(i))
    held = [(await node.reserve(10, 10)).rid for _ in range(4)]
    topology.fail_over(replica)
    await node.refresh(live=True)  # read_state: its MULTI/EXEC meets MOVED
    for _ in range(4):  # reserve: its script meets MOVED
        res = await node.reserve(10, 10)
        held.append(res.rid)
        node.release_soon(held.pop(0))
    await node.flush_carried()
    assert not res.degraded and node.coordination == "ok"
    assert node.stats.degraded_entries == 0
    assert await _records_on(replica.url, node) == set(held)
    await assert_counters_match_reservations(node)


async def test_a_pool_whose_slot_migrates_is_served_throughout(own_cluster: OwnCluster) -> None:
    """Resharding moves the pool's slot to another primary while the node serves. While
    the pool's keys are split between the two (here: `meta` moved first), every
    script call is redirected back and forth until redis-py gives up ("TTL
    exhausted"): the node must degrade and serve from its own counters, not fail the
    request; once the slot has moved, it re-asserts on the new owner."""
    topology = own_cluster.topology
    node = await own_cluster.connect()
    for i in range(3):
        await node.register_instance(spec(i))
    held = [(await node.reserve(10, 10)).rid for _ in range(6)]
    meta = node.keys.column("meta")
    slot = key_slot(meta.encode())
    target = next(p for p in topology.primaries if p is not topology.owner_of(meta))
    source = topology.begin_migration(slot, target)
    topology.move_keys(source, target, [meta])
    for _ in range(4):  # each one served, none failed
        res = await node.reserve(10, 10)
        held.append(res.rid)
        node.release_soon(held.pop(0))
    assert res.degraded and node.coordination == "degraded"
    topology.end_migration(slot, source, target)
    await wait_for(lambda: node.coordination == "ok", what="the node to recover")
    for _ in range(4):
        res = await node.reserve(10, 10)
        held.append(res.rid)
        node.release_soon(held.pop(0))
    await node.flush_carried()
    assert not res.degraded
    assert await _records_on(target.url, node) == set(held) == set(node.local_reservations)
    await assert_counters_match_reservations(node)


async def test_scripts_reload_on_their_shard_while_another_primary_is_down(
    own_cluster: OwnCluster,
) -> None:
    """The pool's primary lost its scripts (a restart, SCRIPT FLUSH) while another
    primary is down. The node reloads them on its own shard only: redis-py's
    script_load asks every primary, and the dead one failed the reload, which left
    the healthy shard's pools degraded until that primary came back."""
    topology = own_cluster.topology
    node = await own_cluster.connect()
    await node.register_instance(spec(0))
    await node.reserve(10, 10)
    mine = topology.owner_of(node.keys.column("meta"))
    next(p for p in topology.primaries if p is not mine).kill()
    with mine.client() as client:
        client.script_flush()
    res = await node.reserve(10, 10)
    assert not res.degraded and node.coordination == "ok"
    await assert_counters_match_reservations(node)


async def _records_on(url: str, node: Coordinator) -> set[str]:
    """The reservation ids one server holds for the node's pool."""
    client = Redis.from_url(url, decode_responses=True)
    try:
        return set(await client.hkeys(node.keys.column("reservations")))
    finally:
        await client.aclose()


async def test_two_proxy_nodes_over_the_cluster(
    cluster: LocalRedisCluster, placement: PoolPlacement
) -> None:
    pool = placement.pools[2]
    owner = cluster.owner_of(PoolKeys("lc", pool).column("meta"))
    harness = TopologyHarness(cluster.url, pool, lambda: owner.url)
    try:
        engines = [await harness.engine(chunks=3, delay_s=0.001) for _ in range(2)]
        nodes = []
        for k in range(2):
            coordinator = await harness.coordinator(
                node_id=f"n{k}", redis_timeout_ms=1000, instance_ttl_ms=60_000
            )
            nodes.append(await harness.node(coordinator))
        for i, engine in enumerate(engines):
            await nodes[0].coordinator.register_instance(InstanceSpec(id=f"e{i}", url=engine.url))

        async def one(k: int) -> tuple[int, str, str]:
            body: dict[str, Any] = {**CHAT, "stream": k % 2 == 0}
            node = nodes[k % 2]
            async with harness.http.post(node.url + "/v1/chat/completions", json=body) as resp:
                text = await resp.text()
                return resp.status, resp.headers.get("X-Instance-Id", ""), text

        results = await asyncio.gather(*(one(k) for k in range(24)))
        assert [status for status, _, _ in results] == [200] * 24
        assert {instance for _, instance, _ in results} == {"e0", "e1"}
        assert all("t2" in text for _, _, text in results)
        assert sum(e.completed for e in engines) == 24
        await wait_for(lambda: settled(nodes[0].coordinator), what="counters back to 0")
        assert all(node.coordinator.coordination == "ok" for node in nodes)
    finally:
        await harness.close()
