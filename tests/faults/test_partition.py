"""A node cut off from Redis while it keeps serving clients (DESIGN.md §5).

node-a reaches Redis through tests/faults/fault_proxy.py, node-b directly. The cut
lasts longer than a lease, so node-b reaps node-a's reservations meanwhile; after the
partition heals node-a must re-assert the ones still live.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

import pytest

from tests.faults.conftest import (
    LEASE_MS,
    Fleet,
    Load,
    wait_converged,
    wait_drained,
    wait_until,
)
from tests.faults.fault_proxy import FaultProxy

pytestmark = [pytest.mark.slow, pytest.mark.real, pytest.mark.timeout(60)]

CUT_S = 2 * LEASE_MS / 1000 + 1  # the fault window: a lease expires, the reaper runs


@pytest.mark.parametrize("mode", ["drop", "blackhole"])
async def test_partitioned_node_keeps_serving_and_converges_after_healing(
    fleet: Fleet, mode: str
) -> None:
    target = urlsplit(fleet.redis_url)
    assert target.hostname is not None and target.port is not None
    proxy = await FaultProxy(target.hostname, target.port).start()
    try:
        auth = target.netloc.rpartition("@")[0]  # keep any user:password
        via_proxy = f"redis://{auth + '@' if auth else ''}127.0.0.1:{proxy.port}{target.path}"
        a = fleet.add_node("node-a", redis_url=via_proxy)
        b = fleet.add_node("node-b")
        await fleet.start(a, b)
        # Engines keep their registration alive through the node that stays connected.
        await fleet.start(*(fleet.add_engine(f"engine-{j}", via=b) for j in range(2)))
        await fleet.wait_alive(2)
        # Long streams (~6.5 s) outlive the cut and the recovery; short ones are served
        # all through the cut.
        long_tokens = 500
        tokens = [long_tokens, 30]
        async with Load(fleet.http, [a, b], concurrency=8, max_tokens=tokens) as load:

            async def a_holds_young_long_stream() -> bool:
                young = [
                    r.rid
                    for r in load.open_on(node=a)
                    if r.max_tokens == long_tokens and time.monotonic() - r.sent_at < 1.0
                ]
                return bool(young) and bool(set(young) & (await fleet.state()).of_node(a.node_id))

            await wait_until(a_holds_young_long_stream, 30, "a young long stream via node-a")
            held = (await fleet.state()).of_node(a.node_id)
            await proxy.set_mode(mode)
            cut_at = time.monotonic()
            reaped_while_cut = False
            b_states: set[str] = set()
            try:
                await fleet.wait_coordination(a, "degraded")
                while time.monotonic() - cut_at < CUT_S:
                    b_states.add(await fleet.coordination(b))
                    state = await fleet.state()
                    if not (state.of_node(a.node_id) & held) and a.node_id not in state.leases:
                        reaped_while_cut = True
                    await asyncio.sleep(0.1)
            finally:
                await proxy.set_mode("pass")
            healed_at = time.monotonic()
            assert b_states == {"ok"}, b_states
            assert reaped_while_cut, "node-a's lease never expired during the cut"
            assert await fleet.metric(b, "proxy_reservations_reaped_total") >= 1
            # node-a served on its own while cut off.
            assert load.completed(a, after=cut_at) - load.completed(a, after=healed_at) >= 5
            await fleet.wait_coordination(a, "ok")
            converged = await wait_converged(fleet, load)
            # Non-vacuous: a stream reserved before the cut, whose reservation node-b
            # reaped during it, was still open then: node-a re-asserted it.
            assert converged & held, "no stream from before the cut was still open"
            served = load.completed(a)
            await wait_until(lambda: load.completed(a) >= served + 5, 20, "node-a after healing")
        bad = [str(r) for r in load.results if not r.ok]
        assert not bad, bad
        await wait_drained(fleet)
    finally:
        await proxy.close()
