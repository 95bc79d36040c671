"""Redis itself fails under load (DESIGN.md §5), on a server private to each test:

- killed by SIGKILL, then restarted empty on the same port (Redis restarts empty);
- frozen by SIGSTOP for 5 s, then SIGCONT (Redis is unreachable).
"""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest

from local_fleet.embedded import free_port
from proxy_node.config import instance_id_for
from tests.faults.conftest import (
    Fleet,
    Load,
    Measure,
    RedisServer,
    wait_converged,
    wait_drained,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.real, pytest.mark.timeout(60)]

FREEZE_S = 5.0  # the SIGSTOP fault itself: a fixed window, not a readiness wait


@pytest.mark.parametrize(
    "registration",
    [
        # Both nodes list both engines (--instance): each re-registers all of them.
        "static",
        # Each engine registers itself through one node: only that node re-registers it.
        "self",
    ],
)
async def test_redis_killed_and_restarted_empty_loses_no_request(
    private_fleet: Fleet, private_redis: RedisServer, measure: Measure, registration: str
) -> None:
    fleet = private_fleet
    # Nodes probe Redis at different rates, as nodes that lost it at different moments
    # would: node-a re-asserts its state well before node-b does.
    fast, slow = {"COORD_RECOVERY_INTERVAL_MS": "100"}, {"COORD_RECOVERY_INTERVAL_MS": "1500"}
    if registration == "static":
        ports = [free_port(), free_port()]
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        a = fleet.add_node("node-a", env=fast, instances=urls)
        b = fleet.add_node("node-b", env=slow, instances=urls)
        e0, e1 = (fleet.add_engine("", None, port=port) for port in ports)
        ids = [instance_id_for(url) for url in urls]
        await fleet.start(a, b, e0, e1)
        await fleet.wait_alive(2)
    else:
        # Both nodes stream to both engines, so after the restart each node must
        # restore reservations on an instance that only the *other* one re-registers.
        a, b, _, _ = await fleet.start_two_by_two(fast, slow)
        ids = ["engine-0", "engine-1"]
    # Long streams (~6 s: open across the whole outage) on 8 workers, short ones (new
    # requests all through it) on 4.
    long_tokens = 450
    tokens = [long_tokens, long_tokens, 30]
    async with Load(fleet.http, [a, b], concurrency=12, max_tokens=tokens) as load:
        cross = {("node-a", ids[1]), ("node-b", ids[0])}

        def young_long() -> set[tuple[str, str]]:
            young = time.monotonic() - 2.5
            return {
                (r.node, r.instance)
                for r in load.open.values()
                if r.sent_at > young and r.max_tokens == long_tokens
            }

        await wait_until(lambda: cross <= young_long(), 30, "young long streams, crossed")
        private_redis.kill()
        killed_at = time.monotonic()
        await asyncio.gather(*(fleet.wait_coordination(n, "degraded") for n in (a, b)))
        await wait_until(
            lambda: load.completed(after=killed_at) >= 4, 20, "requests served while degraded"
        )
        await private_redis.restart_empty()
        restarted_at = time.monotonic()
        await asyncio.gather(*(fleet.wait_coordination(n, "ok") for n in (a, b)))
        # Within seconds: the streams reserved before the restart are still open then.
        converged = await wait_converged(fleet, load, timeout_s=3.0)
        took = time.monotonic() - restarted_at
        measure("Redis restart: counters == open streams after restart", f"{took * 1000:.0f} ms")
        survivors = {
            (load.by_rid[rid].node, load.by_rid[rid].instance)
            for rid in converged
            if load.by_rid[rid].sent_at < restarted_at
        }
        # Non-vacuous: the check ran while streams reserved before the restart were still
        # open, on both nodes, and on the engine each registers last (or not at all).
        assert cross <= survivors, survivors
        await load.wait_more_completed()
    load.assert_none_failed()
    await wait_drained(fleet)


async def test_redis_sigstop_requests_do_not_stall_and_nodes_recover(
    private_fleet: Fleet, private_redis: RedisServer, measure: Measure
) -> None:
    fleet = private_fleet
    a, b, _, _ = await fleet.start_two_by_two()  # default 100 ms Redis timeout
    # Short streams (~0.5 s): many requests start, and finish, inside the freeze.
    async with Load(fleet.http, [a, b], concurrency=8, max_tokens=[300, 30, 30, 30]) as load:

        def baseline() -> bool:  # both kinds of request have completed a few times
            return all(
                sum(r.ok and r.max_tokens == n for r in load.results) >= 3 for n in (30, 300)
            )

        await wait_until(baseline, 30, "load under way")
        before = list(load.ended())
        seen: dict[str, set[str]] = {a.node_id: set(), b.node_id: set()}
        private_redis.pause()
        stopped_at = time.monotonic()
        try:
            # Client requests meet the silent Redis first; then /healthz, which answers
            # even now (a node that finds Redis silent goes degraded), is polled.
            await asyncio.sleep(0.5)
            while time.monotonic() - stopped_at < FREEZE_S:
                for node in (a, b):
                    seen[node.node_id].add(await fleet.coordination(node))
                await asyncio.sleep(0.1)
        finally:
            private_redis.resume()
        resumed_at = time.monotonic()
        assert all("degraded" in states for states in seen.values()), seen
        await asyncio.gather(*(fleet.wait_coordination(n, "ok") for n in (a, b)))
        await wait_converged(fleet, load)
        await load.wait_more_completed()
    load.assert_none_failed()
    # Every request alive at some point of the freeze, against the same kind before it.
    during = [
        r
        for r in load.results
        if r.sent_at < resumed_at and r.ended_at is not None and r.ended_at >= stopped_at
    ]
    assert len(during) >= 10, "too few requests met the freeze to prove anything"
    short = [r for r in during if r.max_tokens == 30]
    base = statistics.median(r.duration_s for r in before if r.max_tokens == 30)
    ttft_before = statistics.median(r.ttft_s for r in before if r.ttft_s is not None)
    measure(
        "Redis SIGSTOP 5 s: latency added to short requests alive during the freeze",
        f"worst {(max(r.duration_s for r in short) - base) * 1000:.0f} ms end-to-end over "
        f"{len(short)} requests, vs the median before ({base * 1000:.0f} ms); worst TTFT "
        f"{max(r.ttft_s or 0 for r in during) * 1000:.0f} ms vs median "
        f"{ttft_before * 1000:.0f} ms before",
    )
    await wait_drained(fleet)
