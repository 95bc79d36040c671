"""Nodes together: degraded mode across a Redis restart, and two nodes sharing a burst."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from coordinator import InstanceSpec
from local_fleet.embedded import EmbeddedRedis, ServerUnavailableError
from tests.fake_engine import Harness, NodeServer, settled
from tests.helpers import assert_counters_match_reservations, counters, wait_for

pytestmark = pytest.mark.timeout(60)

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}]}
MAX_REQUESTS_PER_WORKER = 2000  # bounds the load loop; the test stops it much earlier


def coordination_is(
    harness: Harness, node: NodeServer, value: str
) -> Callable[[], Awaitable[bool]]:
    """A wait_for predicate: the node's /healthz reports this coordination state."""

    async def check() -> bool:
        async with harness.http.get(node.url + "/healthz") as resp:
            return bool((await resp.json())["coordination"] == value)

    return check


async def test_degraded_mode_serves_through_a_redis_restart(pool: str) -> None:
    try:
        server = EmbeddedRedis().start()
    except ServerUnavailableError as exc:
        pytest.skip(f"no Redis-compatible server: {exc}")
    harness = Harness(server.url, pool)
    try:
        engines = [await harness.engine(chunks=2, delay_s=0.002) for _ in range(2)]
        coordinator = await harness.coordinator(redis_timeout_ms=300, recovery_interval_ms=50)
        # Static instances: registered by the node at start, re-asserted after the restart.
        node = await harness.node(coordinator, instances=tuple(e.url for e in engines))
        statuses: list[int] = []
        stop = asyncio.Event()

        async def worker(k: int) -> None:
            for i in range(MAX_REQUESTS_PER_WORKER):
                if stop.is_set():
                    return
                body: dict[str, Any] = {**CHAT, "stream": (i + k) % 2 == 0}
                async with harness.http.post(node.url + "/v1/chat/completions", json=body) as resp:
                    await resp.read()
                    statuses.append(resp.status)

        def served(n: int) -> Any:
            return lambda: len(statuses) >= n

        workers = [asyncio.create_task(worker(k)) for k in range(4)]
        try:
            await wait_for(served(20), what="load before the outage")
            server.stop()
            await wait_for(coordination_is(harness, node, "degraded"), what="degraded mode")
            await wait_for(served(len(statuses) + 20), what="requests served while degraded")
            server = EmbeddedRedis(port=server.port).start()  # back, and empty
            await wait_for(coordination_is(harness, node, "ok"), what="recovery")
            await wait_for(served(len(statuses) + 20), what="requests served after recovery")
            # Freeze the load with every worker's request held by an engine: the
            # restored state must count exactly the live reservations.
            for engine in engines:
                engine.gate_after = 1
            await wait_for(
                lambda: sum(e.active for e in engines) == 4, what="all workers held by engines"
            )

            async def converged() -> bool:
                # A pooled connection to the dead server may fail once more after the
                # recovery (a second, short degraded spell): wait until it is over too.
                live = sum((await counters(coordinator))["inflight"].values())
                return coordinator.coordination == "ok" and live == 4

            await wait_for(converged, what="Redis to hold exactly the 4 live reservations")
            await assert_counters_match_reservations(coordinator)
        finally:
            stop.set()
            for engine in engines:
                engine.gate_after = None
                engine.gate.set()
            await asyncio.gather(*workers)
        assert statuses and all(status == 200 for status in statuses), set(statuses)
        # >= 1: idle pooled connections to the dead server can fail once more after recovery.
        assert coordinator.stats.degraded_entries >= 1
        await wait_for(lambda: settled(coordinator), what="counters back to 0 after the load")
    finally:
        await harness.close()
        server.stop()


async def test_two_nodes_spread_a_burst_evenly(harness: Harness) -> None:
    engines = [await harness.engine(gate_after=0) for _ in range(4)]
    nodes = [await harness.node(), await harness.node()]
    for i, engine in enumerate(engines):
        # No predicted prefill: with one, a reserve rightly takes an instance whose
        # queued prefills the model says are done over a less loaded one whose are not
        # (lua/reserve.lua's soonest start), so a burst spread over 20 ms or more may
        # leave 3 and 5. Counts alone are the test. (A view behind on two instances
        # also left 3 and 5 once: docs/reliability.md finding 22.)
        spec = InstanceSpec(
            id=f"e{i}", url=engine.url, prefill_ms_per_token=0.0, prefill_overhead_ms=0.0
        )
        await nodes[0].coordinator.register_instance(spec)
    for node in nodes:  # both nodes have read the pool, as any node running for a while has
        assert sum(row.alive for row in (await node.coordinator.snapshot()).rows) == 4
    burst = 16

    async def one(k: int) -> tuple[int, str]:
        node = nodes[k % 2]
        body = {**CHAT, "stream": True}
        async with harness.http.post(node.url + "/v1/chat/completions", json=body) as resp:
            await resp.read()
            return resp.status, resp.headers["X-Instance-Id"]

    tasks = [asyncio.create_task(one(k)) for k in range(burst)]
    try:
        await wait_for(
            lambda: sum(e.active for e in engines) == burst, what="the whole burst in flight"
        )
        held = [e.active for e in engines]
        inflight = (await counters(nodes[0].coordinator))["inflight"]
        assert sorted(inflight.values()) == sorted(held)
        assert max(held) - min(held) <= 1, held
    finally:
        for engine in engines:
            engine.gate.set()
        results = await asyncio.gather(*tasks)
    assert all(status == 200 for status, _ in results)
    await wait_for(lambda: settled(nodes[0].coordinator), what="counters back to 0")


async def test_two_nodes_under_one_id_say_so(harness: Harness) -> None:
    """Two nodes started with the same --node-id (a copied compose service) each report
    it in /healthz and /metrics once their lease loops have renewed the lease they
    share; a node with an id of its own reports nothing."""
    twins = [await harness.coordinator("node-twin") for _ in range(2)]
    nodes = [await harness.node(c) for c in twins]  # each renews as its loop starts
    other = await harness.node(await harness.coordinator("node-other"))

    async def said(node: NodeServer) -> tuple[bool, float]:
        async with harness.http.get(node.url + "/healthz") as resp:
            shared = bool((await resp.json())["node_id_shared"])
        async with harness.http.get(node.url + "/metrics") as resp:
            text = await resp.text()
        name = "proxy_coordination_node_id_conflicts_total{"
        line = next(row for row in text.splitlines() if row.startswith(name))
        return shared, float(line.rpartition(" ")[2])

    async def both_said() -> bool:
        return all([(await said(node))[0] for node in nodes])

    await wait_for(both_said, what="both twins to report the shared id")
    for node in nodes:
        assert (await said(node))[1] >= 1
    assert await said(other) == (False, 0.0)
