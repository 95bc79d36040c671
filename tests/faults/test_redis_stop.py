"""Redis frozen by SIGSTOP for 5 s, then SIGCONT (DESIGN.md §5: Redis is unreachable)."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest

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

FREEZE_S = 5.0  # the fault itself: a fixed window, not a readiness wait


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
