"""SIGTERM to a proxy node holding live streams: the graceful drain (issue 17).

This is what the Helm chart's preStop hook starts when a pod terminates. Two node
processes serve a streaming load through a round-robin client that health-checks
`/healthz` like a load balancer and drops a node that is not ready. The drained node
must turn not-ready at once while it still serves for its drain delay, finish every
stream it holds within its drain timeout, release every reservation and delete its
lease before it exits (the lease is long here: no reaper can do it in its place),
while the client's new requests go to the other node. No request may fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from dataclasses import dataclass, field

import aiohttp
import pytest

from proxy_node.state import DRAIN_TIMEOUT_S as RELEASE_TIMEOUT_S
from tests.faults.conftest import (
    Fleet,
    Load,
    Measure,
    Node,
    wait_converged,
    wait_drained,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.real, pytest.mark.timeout(120)]

DRAIN_DELAY_S = 2.0  # --drain-delay-s: serving while not ready (many health checks)
DRAIN_TIMEOUT_S = 20.0  # --drain-timeout-s: far above a stream's length
LEASE_MS = 60_000  # longer than the test: only the node's own retire can drop its lease
HEALTH_CHECK_S = 0.1  # the balancer's health-check period
STREAM_TOKENS = 400  # at least 4.8 s per stream on the mock engine (12 ms a token)
FRESH_S = 1.0  # a stream this young at SIGTERM outlives the drain delay


@dataclass
class Balancer:
    """Health-checks every node and keeps only the ready ones in the load's rotation."""

    http: aiohttp.ClientSession
    load: Load
    nodes: list[Node]
    # node id -> (monotonic time, HTTP status or None when refused, `status` of the body)
    checks: dict[str, list[tuple[float, int | None, str]]] = field(default_factory=dict)

    async def run(self) -> None:
        """Check until cancelled."""
        while True:
            for node in self.nodes:
                status, doc_status = await self._check(node)
                self.checks.setdefault(node.node_id, []).append(
                    (time.monotonic(), status, doc_status)
                )
                ready = status == 200
                if not ready:
                    self.load.remove(node)
                elif node not in self.load.rotation:
                    self.load.rotation.append(node)
            await asyncio.sleep(HEALTH_CHECK_S)

    async def _check(self, node: Node) -> tuple[int | None, str]:
        timeout = aiohttp.ClientTimeout(total=1)
        try:
            async with self.http.get(node.url + "/healthz", timeout=timeout) as resp:
                doc = await resp.json()
                return resp.status, str(doc.get("status"))
        except (aiohttp.ClientError, TimeoutError):
            return None, ""

    def first_not_ready(self, node: Node) -> tuple[float, int | None, str] | None:
        """The first check that found the node not ready."""
        return next((c for c in self.checks.get(node.node_id, []) if c[1] != 200), None)


async def test_sigterm_finishes_streams_releases_everything_and_leaves_no_lease(
    fleet: Fleet, measure: Measure
) -> None:
    env = {
        "COORD_LEASE_MS": str(LEASE_MS),
        "COORD_DRAIN_DELAY_S": str(DRAIN_DELAY_S),
        "COORD_DRAIN_TIMEOUT_S": str(DRAIN_TIMEOUT_S),
    }
    a, b = fleet.add_node("node-a", env=env), fleet.add_node("node-b", env=env)
    await fleet.start(a, b)
    # The engines heartbeat through the node that stays.
    await fleet.start(*(fleet.add_engine(f"engine-{j}", via=a) for j in range(2)))
    await fleet.wait_alive(2)
    async with Load(fleet.http, [a, b], concurrency=8, max_tokens=STREAM_TOKENS) as load:
        balancer = Balancer(fleet.http, load, [a, b])
        checking = asyncio.create_task(balancer.run())
        try:

            async def b_holds_streams() -> bool:
                """Streams through node-b, one of them fresh: it must outlive the delay."""
                held = (await fleet.state()).of_node(b.node_id)
                open_b = load.open_on(node=b)
                fresh = [
                    r for r in open_b if r.rid in held and r.sent_at > time.monotonic() - FRESH_S
                ]
                return len(open_b) >= 2 and len(held) >= 2 and bool(fresh)

            await wait_until(lambda: load.completed() >= 8, 30, "load under way")
            await wait_until(b_holds_streams, 30, "live streams through node-b")
            held = (await fleet.state()).of_node(b.node_id)
            streams = list(load.open_on(node=b))
            assert b.node_id in (await fleet.state()).leases
            b.proc.send(signal.SIGTERM)
            signalled_at = time.monotonic()
            closed_at = signalled_at + DRAIN_DELAY_S  # the node stops accepting then

            await wait_until(
                lambda: balancer.first_not_ready(b) is not None, 5, "node-b reported not ready"
            )
            limit_s = DRAIN_DELAY_S + DRAIN_TIMEOUT_S + RELEASE_TIMEOUT_S
            await wait_until(lambda: not b.proc.running, limit_s, "node-b to exit by itself")
            exited_at = time.monotonic()
            # At once, with a lease far from expiry: the node itself released and left.
            state = await fleet.state()
            assert not state.problems(), state.problems()
            assert not state.of_node(b.node_id), "reservations of the drained node remain"
            assert not held & set(state.records)
            assert b.node_id not in state.leases, "the drained node left its lease"
            assert b.proc.process is not None and b.proc.process.returncode == 0, b.proc.tail()

            served_after = load.completed(a, after=exited_at)
            await wait_until(
                lambda: load.completed(a, after=exited_at) >= served_after + 8,
                20,
                "node-a serving the new requests",
            )
            await wait_converged(fleet, load)
        finally:
            checking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checking
    load.assert_none_failed()  # streams finished, no request failed during the drain
    first = balancer.first_not_ready(b)
    assert first is not None
    noticed_at, status, doc_status = first
    # Not ready while still listening: a 503 that says why, not a refused connection.
    assert (status, doc_status) == (503, "draining"), first
    assert noticed_at < signalled_at + DRAIN_DELAY_S
    assert all(stream.ok for stream in streams), [str(r) for r in streams]  # finished whole
    # One was still streaming when the listeners closed: the drain proper carried it.
    assert any(r.ended_at is not None and r.ended_at > closed_at for r in streams)
    # Only requests sent before the balancer dropped node-b went through it.
    late = [r for r in load.results if r.node == b.node_id and r.sent_at > noticed_at]
    assert not late, [str(r) for r in late]
    measure(
        "graceful drain: SIGTERM to exit",
        f"{exited_at - signalled_at:.2f} s ({len(streams)} streams open at SIGTERM, "
        f"drain delay {DRAIN_DELAY_S:g} s)",
    )
    await wait_drained(fleet)
