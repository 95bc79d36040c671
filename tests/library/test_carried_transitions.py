"""first_token_soon / release_soon: held for the node's next reserve (one call per request).

What the proxy calls. A held transition must reach Redis exactly as the waiting
calls would: on the next reserve, or by itself after `carry_ms`, again after a lost
reply, at close, and through the re-assert when the node is degraded.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from coordinator import Coordinator
from coordinator.coordinator import CANDIDATE_ARGS, CARRY_STEP, RESERVE_HEAD_ARGS
from coordinator.errors import InvalidArgumentError
from tests.conftest import MakeCoordinator
from tests.helpers import (
    assert_counters_match_reservations,
    counters,
    live_reservations,
    spec,
    wait_for,
)
from tests.library.test_fault_paths import intercept, lose_next_reply, recovered
from tests.library.test_snapshot_cache import assert_view_is_current, count_calls

pytestmark = pytest.mark.timeout(60)

# Long enough that nothing goes by itself while a test looks (neither a held
# transition nor a re-read of an aged view: the tests count calls); tests that want
# the timed flush set a short one.
HOLD = {
    "carry_ms": 1000,
    "recovery_interval_ms": 20,
    "snapshot_max_age_ms": 600_000,
    "live_refresh_ms": 600_000,
    "instance_ttl_ms": 2_400_000,
}


async def inflight(c: Coordinator, instance_id: str) -> int:
    return (await counters(c))["inflight"].get(instance_id, 0)


async def node_with_pool(make_coordinator: MakeCoordinator, **overrides: Any) -> Coordinator:
    c = await make_coordinator("carrier", **{**HOLD, **overrides})
    for i in range(4):
        await c.register_instance(spec(i))
    await c.refresh()
    return c


async def test_transitions_ride_on_the_next_reserve(make_coordinator: MakeCoordinator) -> None:
    c = await node_with_pool(make_coordinator)
    first = await c.reserve(100, 10)
    second = await c.reserve(100, 10)
    calls = count_calls(c)
    c.first_token_soon(first.rid)
    c.first_token_soon(second.rid)
    c.release_soon(first.rid)
    assert await inflight(c, first.instance_id) >= 1, "held, not sent yet"
    third = await c.reserve(100, 10)
    assert calls == {"reserve": 1}, "the three transitions came with the reservation"
    phases = {rid: r["phase"] for rid, r in (await live_reservations(c)).items()}
    assert phases == {second.rid: "decode", third.rid: "prefill"}
    await assert_counters_match_reservations(c)
    assert second.rid in c.local_reservations and first.rid not in c.local_reservations
    # The reply's records kept the view current: no read needed to see it.
    await assert_view_is_current(c, make_coordinator)


async def test_held_transitions_go_by_themselves_after_carry_ms(
    make_coordinator: MakeCoordinator,
) -> None:
    c = await node_with_pool(make_coordinator, carry_ms=20)
    res = await c.reserve(100, 10)
    calls = count_calls(c)
    c.first_token_soon(res.rid)
    c.release_soon(res.rid)

    async def released() -> bool:
        return await inflight(c, res.instance_id) == 0

    await wait_for(released, what="the held release to be sent")
    assert calls == {"carry": 1}, "both in one call"
    assert c.stats.carry_calls == 1
    await assert_counters_match_reservations(c)


async def test_a_lost_reserve_reply_sends_its_transitions_again(
    make_coordinator: MakeCoordinator,
) -> None:
    c = await node_with_pool(make_coordinator, carry_ms=20)
    res = await c.reserve(100, 10)
    c.release_soon(res.rid)
    lose_next_reply(c, "reserve")  # the release happened in Redis; the node cannot know
    assert (await c.reserve(100, 10)).degraded
    await recovered(c)
    await wait_for(lambda: not c._carry, what="the held release to be sent again")
    await assert_counters_match_reservations(c)
    assert res.rid not in await c.redis.hkeys(c.keys.column("reservations"))


async def test_a_refused_reserve_keeps_its_transitions(make_coordinator: MakeCoordinator) -> None:
    c = await node_with_pool(make_coordinator, carry_ms=20)
    res = await c.reserve(100, 10)
    c.release_soon(res.rid)
    refused = False

    async def refuse_once(name: str, real: Any, *args: Any) -> Any:
        nonlocal refused
        if name == "reserve" and not refused:
            refused = True
            raise RedisConnectionError("connection refused")  # never reached Redis
        return await real(*args)

    intercept(c, refuse_once)
    assert (await c.reserve(100, 10)).degraded
    await recovered(c)

    async def released() -> bool:
        return await inflight(c, res.instance_id) == 0

    await wait_for(released, what="the release held by the refused reserve")
    await assert_counters_match_reservations(c)


async def test_close_sends_what_is_held(make_coordinator: MakeCoordinator) -> None:
    c = await node_with_pool(make_coordinator)
    observer = await make_coordinator("observer")
    res = await c.reserve(100, 10)
    c.first_token_soon(res.rid)
    c.release_soon(res.rid)
    await c.close()
    assert await inflight(observer, res.instance_id) == 0
    await assert_counters_match_reservations(observer)


async def test_a_release_held_while_degraded_goes_with_the_re_assert(
    make_coordinator: MakeCoordinator,
) -> None:
    c = await node_with_pool(make_coordinator)
    res = await c.reserve(100, 10)
    c._enter_degraded("test: Redis unreachable")
    c.release_soon(res.rid)
    assert not c._carry, "a degraded node hands releases to its re-assert"
    await recovered(c)
    assert await inflight(c, res.instance_id) == 0
    await assert_counters_match_reservations(c)


async def test_an_invalid_rid_is_refused_at_once(make_coordinator: MakeCoordinator) -> None:
    c = await node_with_pool(make_coordinator)
    for bad in ("", "has space", "x" * 129):
        with pytest.raises(ValueError):
            c.release_soon(bad)
        with pytest.raises(ValueError):
            c.first_token_soon(bad)
    assert not c._carry and c._carry_flush is None


async def test_a_cancelled_reserve_keeps_its_transitions(make_coordinator: MakeCoordinator) -> None:
    """A client that hangs up while its reserve waits for Redis: the call is cancelled
    before it is sent, and nothing else (no degraded mode, no re-assert) would send
    the transitions it carried."""
    c = await node_with_pool(make_coordinator, carry_ms=20)
    res = await c.reserve(100, 10)
    c.release_soon(res.rid)
    stuck = asyncio.Event()

    async def hang_once(name: str, real: Any, *args: Any) -> Any:
        if name == "reserve" and not stuck.is_set():
            stuck.set()
            await asyncio.Event().wait()  # never answers; cancelled below
        return await real(*args)

    intercept(c, hang_once)
    task = asyncio.create_task(c.reserve(100, 10))
    await stuck.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert c.coordination == "ok"

    async def released() -> bool:
        return await inflight(c, res.instance_id) == 0

    await wait_for(released, what="the release the cancelled reserve carried")
    await assert_counters_match_reservations(c)


async def test_a_retry_under_the_same_rid_is_a_new_reservation(
    make_coordinator: MakeCoordinator,
) -> None:
    """The proxy retries a refused connection elsewhere under the same rid: the held
    release of the first attempt rides on the retry's reserve, which must not answer
    `dup` with the reservation that release ends."""
    c = await node_with_pool(make_coordinator)
    first = await c.reserve(100, 10, rid="retried")
    c.release_soon(first.rid)
    again = await c.reserve(100, 10, rid="retried", exclude=[first.instance_id])
    assert again.instance_id != first.instance_id
    assert (await live_reservations(c))["retried"]["instance"] == again.instance_id
    await assert_counters_match_reservations(c)


async def test_a_burst_of_held_transitions_goes_in_bounded_calls(
    make_coordinator: MakeCoordinator,
) -> None:
    """Many completions at once (an engine dropped its streams): no call carries more
    than CARRY_STEP transitions, the rest follow in carry calls, none is lost, and each
    reservation's mark still precedes its release."""
    c = await node_with_pool(make_coordinator)
    held = [await c.reserve(100, 10) for _ in range(3 * CARRY_STEP)]
    sizes: list[tuple[str, int]] = []

    async def sized(name: str, real: Any, *args: Any) -> Any:
        if name in ("reserve", "carry"):
            script_args = args[1]
            count_at = (
                0 if name == "carry" else RESERVE_HEAD_ARGS + CANDIDATE_ARGS * int(script_args[9])
            )
            sizes.append((name, int(script_args[count_at])))
        return await real(*args)

    intercept(c, sized)
    for res in held:
        c.first_token_soon(res.rid)
    for res in held:
        c.release_soon(res.rid)
    last = await c.reserve(100, 10)
    await c.flush_carried()
    assert sizes[0] == ("reserve", CARRY_STEP)
    assert all(n <= CARRY_STEP for _, n in sizes)
    assert sum(n for _, n in sizes) == 2 * len(held)
    assert set(await live_reservations(c)) == {last.rid}
    await assert_counters_match_reservations(c)


async def test_a_retry_carries_its_own_release_past_a_full_step(
    make_coordinator: MakeCoordinator,
) -> None:
    """Behind more than CARRY_STEP other held transitions, the release that ends the
    first attempt of a retried rid still rides on the retry's reserve (else it would
    answer `dup` with the attempt it ends)."""
    c = await node_with_pool(make_coordinator)
    others = [await c.reserve(100, 10) for _ in range(CARRY_STEP)]
    first = await c.reserve(100, 10, rid="retried")
    for res in others:
        c.first_token_soon(res.rid)
    c.release_soon(first.rid)
    again = await c.reserve(100, 10, rid="retried", exclude=[first.instance_id])
    assert again.instance_id != first.instance_id
    assert (await live_reservations(c))["retried"]["instance"] == again.instance_id
    await c.flush_carried()
    phases = {rid: r["phase"] for rid, r in (await live_reservations(c)).items()}
    assert phases == {**{r.rid: "decode" for r in others}, "retried": "prefill"}
    await assert_counters_match_reservations(c)


async def test_a_call_carrying_more_than_the_script_allows_is_refused(
    make_coordinator: MakeCoordinator,
) -> None:
    """The scripts bound a call's work themselves: 65 carried transitions are refused,
    whoever sends them, and nothing is written."""
    c = await node_with_pool(make_coordinator)
    res = await c.reserve(100, 10)
    args: list[Any] = [65]
    for _ in range(65):
        args += ["f", res.rid]
    with pytest.raises(InvalidArgumentError, match="transitions"):
        await c._call("carry", args, (c._node_rids,))
    assert (await live_reservations(c))[res.rid]["phase"] == "prefill"
    await assert_counters_match_reservations(c)


async def test_a_carry_call_refused_for_its_own_reason_loses_no_transition(
    make_coordinator: MakeCoordinator,
) -> None:
    """A record the script rejects fails the whole carry call it rides in; the marks
    and releases in that call then go one by one, and only the record is lost."""
    c = await node_with_pool(make_coordinator, carry_ms=20)
    ended, decoding = await c.reserve(100, 10), await c.reserve(100, 10)
    count = c.hold_record("no such#1", 8, ["ab", 1])  # an id the scripts refuse
    c.first_token_soon(decoding.rid)
    c.release_soon(ended.rid)
    with pytest.raises(InvalidArgumentError, match="record 1"):
        await count

    async def settled() -> bool:
        return ended.rid not in await live_reservations(c)

    await wait_for(settled, what="the release that rode with the refused record")
    assert (await live_reservations(c))[decoding.rid]["phase"] == "decode"
    assert c.coordination == "ok" and not c._carry
    await assert_counters_match_reservations(c)
