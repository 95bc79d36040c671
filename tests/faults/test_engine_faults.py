"""Engine faults under load: a crash mid-stream, a restart, a frozen engine replaced.

DESIGN.md §5: an engine that restarts re-registers with a new epoch, and the
reservations of the old epoch are dropped; a reservation is released on every path,
an engine failure mid-stream included.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.faults.conftest import (
    Fleet,
    Load,
    wait_converged,
    wait_drained,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.real, pytest.mark.timeout(60)]


def crash_every_fourth(n: int) -> str | None:
    """X-Mock-Fault of request n: every fourth one crashes half-way through its stream."""
    return "crash" if n % 4 == 3 else None


async def test_engine_crash_mid_stream_cuts_only_that_stream_and_releases(fleet: Fleet) -> None:
    a, b, _, _ = await fleet.start_two_by_two()
    async with Load(
        fleet.http, [a, b], concurrency=8, max_tokens=[40, 100], fault=crash_every_fourth
    ) as load:
        await wait_until(
            lambda: sum(r.fault == "crash" for r in load.ended()) >= 8, 30, "crashed streams"
        )
        await wait_converged(fleet, load)
    crashed = [r for r in load.results if r.fault == "crash"]
    others = [r for r in load.results if r.fault is None]
    # A crash comes after the first token: the client got 200 and a truncated stream.
    assert all(r.status == 200 and not r.done and r.error for r in crashed), [
        str(r) for r in crashed if r.done or not r.error
    ]
    assert others and all(r.ok for r in others), [str(r) for r in others if not r.ok]
    # Each node counted exactly its crashed requests as upstream failures.
    for node in (a, b):
        failed = await fleet.metric(node, "proxy_request_outcomes_total", outcome="upstream_failed")
        assert failed == sum(r.node == node.node_id for r in crashed)
    await wait_drained(fleet)


async def test_engine_restart_voids_old_epoch_and_serving_continues(fleet: Fleet) -> None:
    a, b, e0, _ = await fleet.start_two_by_two()
    async with Load(fleet.http, [a, b], concurrency=8, max_tokens=[40, 150]) as load:
        await wait_until(lambda: len(load.open_on(instance="engine-0")) >= 2, 20, "streams on e0")
        old_epoch = (await fleet.state()).epochs["engine-0"]
        e0.proc.kill()
        killed_at = time.monotonic()
        await fleet.start(e0)  # same port, same id: a new process, a new epoch

        async def new_epoch() -> bool:
            state = await fleet.state()
            if state.epochs["engine-0"] == old_epoch:
                return False
            # The registration that raised the epoch dropped the old epoch's reservations
            # in the same atomic step (problems() flags any record of a void epoch).
            assert not state.problems(), state.problems()
            return True

        await wait_until(new_epoch, 20, "engine-0 registered with a new epoch")
        assert (await fleet.state()).epochs["engine-0"] > old_epoch
        restarted_at = time.monotonic()
        await wait_until(
            lambda: (
                sum(r.ok and r.instance == "engine-0" for r in load.ended(after=restarted_at)) >= 3
            ),
            20,
            "the restarted engine serving",
        )
        await wait_converged(fleet, load)
    # A request routed to the dead process is retried on the other engine.
    failed = [r for r in load.results if not r.ok]
    # Only streams the dead process was carrying may fail.
    assert all(
        r.instance == "engine-0"
        and r.sent_at < restarted_at
        and r.ended_at is not None
        and r.ended_at >= killed_at
        for r in failed
    ), [str(r) for r in failed]
    assert failed, "the kill cut no stream: the test proves nothing"
    await wait_drained(fleet)


async def test_requests_meeting_a_dead_engine_are_retried_on_another(fleet: Fleet) -> None:
    """An engine dies and stays dead: until its registration expires it looks idle, so
    requests keep being routed to it, fail to connect, and must be retried elsewhere."""
    # The dead engine stays registered (and looks idle) for the whole test, and passive
    # health is off: its cut streams would eject it at once, and no request would then
    # meet it (docs/reliability.md); this test is about the retry.
    env = {"COORD_INSTANCE_TTL_MS": "60000", "COORD_EJECT_CONSECUTIVE_FAILURES": "0"}
    a, b, e0, _ = await fleet.start_two_by_two(env)
    async with Load(fleet.http, [a, b], concurrency=16, max_tokens=30) as load:
        await wait_until(lambda: load.completed() >= 10, 20, "load under way")
        e0.proc.kill()
        killed_at = time.monotonic()
        await wait_until(
            lambda: len(load.ended(after=killed_at)) >= 200, 30, "requests after the kill"
        )
    retries = sum([await fleet.metric(n, "proxy_upstream_connect_retries_total") for n in (a, b)])
    assert retries >= 5, "too few requests met the dead engine to prove anything"
    bad = [str(r) for r in load.ended(after=killed_at) if not r.ok]
    assert not bad, f"{len(bad)} of {len(load.ended(after=killed_at))} failed: {bad[:3]}"
    await wait_drained(fleet)


async def test_frozen_engine_replaced_voids_its_reservations_at_once(fleet: Fleet) -> None:
    """The engine's host freezes (no FIN, streams hang) and a new process takes its id.

    The new registration voids the frozen streams' reservations while those streams
    are still open; their releases, when the frozen process finally dies, change nothing.
    """
    a, b, e0, _ = await fleet.start_two_by_two()
    async with Load(fleet.http, [a, b], concurrency=8, max_tokens=[40, 150]) as load:
        await wait_until(lambda: len(load.open_on(instance="engine-0")) >= 2, 20, "streams on e0")
        e0.proc.send(signal.SIGSTOP)
        frozen_at = time.monotonic()
        before = await fleet.state()
        held = before.of_instance("engine-0")
        assert held
        replacement = fleet.add_engine("engine-0", via=a)  # same id, another port
        await fleet.start(replacement)

        async def voided() -> bool:
            state = await fleet.state()
            if state.epochs["engine-0"] == before.epochs["engine-0"]:
                return False
            assert not state.problems(), state.problems()
            assert not (state.of_instance("engine-0") & held)
            return True

        await wait_until(voided, 20, "the replacement registered")
        replaced_at = time.monotonic()
        # Void, yet still open at the clients: the counters dropped at once, not when
        # those streams end.
        stuck = {r.rid for r in load.open_on(instance="engine-0") if r.sent_at < frozen_at}
        assert stuck & held
        await wait_until(
            lambda: (
                sum(r.ok and r.instance == "engine-0" for r in load.ended(after=replaced_at)) >= 3
            ),
            20,
            "the replacement serving",
        )
        e0.proc.kill()  # the frozen streams are cut now; their releases must be no-ops
        await wait_until(lambda: not (set(load.open) & held), 10, "the frozen streams cut")
        await wait_converged(fleet, load)
    failed = [r for r in load.results if not r.ok]
    assert all(r.instance == "engine-0" and r.sent_at < replaced_at for r in failed), [
        str(r) for r in failed
    ]
    await wait_drained(fleet)
