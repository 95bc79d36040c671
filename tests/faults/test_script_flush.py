"""SCRIPT FLUSH again and again under load (DESIGN.md §5: NOSCRIPT is retried transparently)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.faults.conftest import (
    Fleet,
    Load,
    Measure,
    wait_drained,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.real, pytest.mark.timeout(60)]

FLUSH_EVERY_S = 0.01  # often enough to hit the gap between a reload and its EVALSHA
FLUSH_FOR_S = 3.0


async def test_script_flush_under_load_costs_no_request(
    private_fleet: Fleet, measure: Measure
) -> None:
    fleet = private_fleet  # a flush empties the script cache of the whole server
    a, b, _, _ = await fleet.start_two_by_two()
    noscript_before = (await fleet.client.info("errorstats")).get("errorstat_NOSCRIPT", {})
    async with Load(fleet.http, [a, b], concurrency=8, max_tokens=[200, 20]) as load:
        await wait_until(lambda: load.completed() >= 10, 20, "load under way")
        started = time.monotonic()
        flushes = 0
        while time.monotonic() - started < FLUSH_FOR_S:
            await fleet.client.script_flush()
            flushes += 1
            await asyncio.sleep(FLUSH_EVERY_S)
        during = len(load.ended(after=started))
    errors = await fleet.client.info("errorstats")
    noscript = int(errors.get("errorstat_NOSCRIPT", {}).get("count", 0)) - int(
        noscript_before.get("count", 0)
    )
    measure("SCRIPT FLUSH under load", f"{flushes} flushes, {noscript} NOSCRIPT replies retried")
    # The flushes hit scripts in use: nodes got NOSCRIPT, and reloaded without a trace.
    assert noscript >= 1
    assert during >= 10, "too few requests ran among the flushes to prove anything"
    load.assert_none_failed()
    for node in (a, b):
        assert await fleet.coordination(node) == "ok"
        assert await fleet.metric(node, "proxy_coordination_degraded_entries_total") == 0
    await wait_drained(fleet)
