"""Passive health on a big pool: no script scans the pool (issue 12's no-stall rule).

read_outliers reads the outliers hash a page per call, and record_outcome weighs an
ejection against the cap with one ZCOUNT of the `ejected` zset and the alive count
of the calling node's view, instead of scanning every instance's liveness.
"""

from __future__ import annotations

from typing import Any

import pytest

from coordinator import Coordinator
from coordinator.errors import InvalidArgumentError, UnknownInstanceError
from coordinator.outliers import RATE_WINDOW_MS, FailureShares, OutlierPolicy
from tests.conftest import MakeCoordinator
from tests.helpers import spec
from tests.library.test_fault_paths import intercept

pytestmark = pytest.mark.timeout(60)

EJECT_AT_ONCE = OutlierPolicy(consecutive_failures=1, max_ejection_percent=50.0)


async def pool_of(make_coordinator: MakeCoordinator, instances: int) -> Coordinator:
    c = await make_coordinator("health")
    for i in range(instances):
        await c.register_instance(spec(i))
    await c.refresh(live=True)
    return c


async def test_read_outliers_walks_the_hash_a_page_per_call(
    make_coordinator: MakeCoordinator,
) -> None:
    c = await pool_of(make_coordinator, 300)
    policy = OutlierPolicy(consecutive_failures=1000)  # count, never eject
    for i in range(300):
        await c.record_outcome(f"i{i}", False, policy, "status_500")
    calls: list[str] = []

    async def counted(name: str, real: Any, *args: Any) -> Any:
        calls.append(name)
        return await real(*args)

    intercept(c, counted)
    view = await c.read_outliers()
    assert set(view.states) == {f"i{i}" for i in range(300)}
    assert all(s.consecutive_failures == 1 for s in view.states.values())
    # 300 records of 4 fields each: more than one page of about 256 fields.
    assert calls.count("read_outliers") > 1


async def test_the_ejection_cap_counts_the_ejected_zset(make_coordinator: MakeCoordinator) -> None:
    c = await pool_of(make_coordinator, 4)
    states = [(await c.record_outcome(f"i{i}", False, EJECT_AT_ONCE, "x")).state for i in range(4)]
    # Half of 4 alive instances may be out at once.
    assert states == ["ejected", "ejected", "capped", "capped"]
    ejected = await c.redis.zrange(c.keys.ejected(), 0, -1)
    assert sorted(x.decode() if isinstance(x, bytes) else x for x in ejected) == ["i0", "i1"]
    # A restarted engine starts clean: out of the zset, so another may take its place.
    restarted = await c.register_instance(spec(0))
    await c.register_instance(spec(0, epoch=restarted.epoch + 1))
    assert (await c.record_outcome("i0", True, EJECT_AT_ONCE)).state == "ok"
    assert (await c.record_outcome("i2", False, EJECT_AT_ONCE, "x")).state == "ejected"


async def test_a_recovered_instance_leaves_no_record(make_coordinator: MakeCoordinator) -> None:
    """A success after failures that ejected nothing deletes the instance's record: the
    hash every node reads each second holds only failing or recently ejected ones."""
    c = await pool_of(make_coordinator, 3)
    policy = OutlierPolicy(consecutive_failures=3)
    await c.record_outcome("i0", False, policy, "status_500")
    await c.record_outcome("i1", False, EJECT_AT_ONCE, "status_500")  # ejected
    assert set((await c.read_outliers()).states) == {"i0", "i1"}
    assert (await c.record_outcome("i0", True, policy)).state == "ok"
    fields = {
        f.decode() if isinstance(f, bytes) else f for f in await c.redis.hkeys(c.keys.outliers())
    }
    assert not {f for f in fields if f.startswith("i0:")}
    assert set((await c.read_outliers()).states) == {"i1"}  # the ejected one stays


async def test_read_outliers_leaves_out_earlier_epochs_and_removed_instances(
    make_coordinator: MakeCoordinator,
) -> None:
    """A record is read only while its instance is registered at the epoch it failed
    under: a restarted or removed engine's failures say nothing about it now."""
    c = await pool_of(make_coordinator, 200)  # several pages of records
    policy = OutlierPolicy(consecutive_failures=1000)  # count, never eject
    for i in range(200):
        await c.record_outcome(f"i{i}", False, policy, "status_500")
    restarted = await c.register_instance(spec(7))
    await c.register_instance(spec(7, epoch=restarted.epoch + 1))
    await c.unregister_instance("i9")
    view = await c.read_outliers()
    assert set(view.states) == {f"i{i}" for i in range(200)} - {"i7", "i9"}


async def test_a_rate_failure_ejects_at_once_within_the_cap(
    make_coordinator: MakeCoordinator,
) -> None:
    """record_outcome's 'rate': the node's failure share reached the policy's, so the
    instance goes whatever its count in a row, unless the share cap says no; with
    consecutive failures off, plain failures only count."""
    c = await pool_of(make_coordinator, 4)
    policy = OutlierPolicy(consecutive_failures=0)
    for _ in range(30):
        assert (await c.record_outcome("i0", False, policy, "status_500")).state == "counted"
    first = await c.record_outcome("i0", False, policy, "status_502", rate=True)
    assert first.state == "ejected" and first.ejections == 1
    assert (await c.read_outliers()).state("i0").reason == "status_502"
    assert (await c.record_outcome("i1", False, policy, "x", rate=True)).state == "ejected"
    # Half of 4 alive instances are out: a third may not go.
    assert (await c.record_outcome("i2", False, policy, "x", rate=True)).state == "capped"
    assert (await c.read_outliers()).ejected_ids() == {"i0", "i1"}


def test_failure_shares_judge_a_nodes_last_exchanges_within_the_window() -> None:
    shares = FailureShares(OutlierPolicy(failure_percent=25.0, failure_volume=8))
    # Below the volume nothing is judged, however bad.
    assert [shares.add("a", False, t) for t in range(7)] == [None] * 7
    assert shares.add("a", False, 7) == 100.0
    shares.forget("a")
    outcomes = [True, True, False, True, True, True, True, False]  # 2 of 8: 25%
    judged = [shares.add("a", ok, 100 + t) for t, ok in enumerate(outcomes)]
    assert judged == [None] * 7 + [25.0]
    assert shares.add("a", True, 108) is None  # a success never ejects
    # Exchanges older than the window leave it: 8 recent ones are needed again.
    late = 108 + RATE_WINDOW_MS + 1
    assert shares.add("a", False, late) is None
    assert shares.add("b", False, 0) is None  # instances are judged apart
    off = FailureShares(OutlierPolicy(failure_percent=0.0))
    assert [off.add("a", False, t) for t in range(50)] == [None] * 50


def test_failure_shares_keep_a_bounded_number_of_instances() -> None:
    shares = FailureShares(OutlierPolicy(), kept=2)
    shares.add("a", True, 0)
    shares.add("b", True, 0)
    shares.add("c", True, RATE_WINDOW_MS + 1)  # a and b are stale by then
    assert set(shares._last) == {"c"}


@pytest.mark.parametrize(
    "bad", [{"failure_percent": -1.0}, {"failure_percent": 101.0}, {"failure_volume": 0}]
)
def test_failure_share_policy_rejects(bad: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        OutlierPolicy(**bad)


async def test_a_cordon_holds_through_outcomes_until_lifted_or_a_new_epoch(
    make_coordinator: MakeCoordinator,
) -> None:
    """An operator's cordon is fleet-wide state beside passive health: successes,
    failures and ejections neither lift it nor count it; lifting leaves no record;
    a restarted engine (a new epoch) comes back uncordoned."""
    c = await pool_of(make_coordinator, 3)
    assert (await c.cordon("i0", "engine upgrade")).state == "cordoned"
    await c.cordon("i1")  # no reason
    view = await c.read_outliers()
    assert view.cordoned_ids() == {"i0", "i1"} and view.ejected_ids() == frozenset()
    assert view.state("i0").cordon == "engine upgrade" and view.state("i1").cordon == ""
    assert view.state("i0").as_dict(view.now_ms)["cordon_reason"] == "engine upgrade"
    # A request in flight there succeeds: the cordon stays (the failures' record went).
    assert (await c.record_outcome("i0", True, EJECT_AT_ONCE)).state == "ok"
    # Failures still eject it, and the cordon outlives the ejection's record.
    assert (await c.record_outcome("i1", False, EJECT_AT_ONCE, "x")).state == "ejected"
    view = await c.read_outliers()
    assert view.cordoned_ids() == {"i0", "i1"} and view.ejected_ids() == {"i1"}
    # Lifted with nothing else on record: the record goes.
    assert (await c.cordon("i0", lift=True)).state == "uncordoned"
    fields = {
        f.decode() if isinstance(f, bytes) else f for f in await c.redis.hkeys(c.keys.outliers())
    }
    assert not {f for f in fields if f.startswith("i0:")}
    # A restart under a new epoch: i1 comes back in rotation, clean.
    await c.register_instance(spec(1, epoch=5))
    assert (await c.record_outcome("i1", True, EJECT_AT_ONCE)).state == "ok"
    assert (await c.read_outliers()).cordoned_ids() == frozenset()
    with pytest.raises(UnknownInstanceError):
        await c.cordon("nobody")
    for bad in ("x" * 201, "line\nbreak", "\x1b[31mred"):
        with pytest.raises(InvalidArgumentError):
            await c.cordon("i2", bad)


async def test_unregistering_drops_the_record_and_the_cordon(
    make_coordinator: MakeCoordinator,
) -> None:
    """An id registered again later starts clean and in rotation, even at its old
    epoch: the outliers record and the ejection go with the unregistration."""
    c = await pool_of(make_coordinator, 4)
    await c.cordon("i0", "broken fan")
    assert (await c.record_outcome("i0", False, EJECT_AT_ONCE, "x")).state == "ejected"
    await c.unregister_instance("i0")
    fields = {
        f.decode() if isinstance(f, bytes) else f for f in await c.redis.hkeys(c.keys.outliers())
    }
    assert not {f for f in fields if f.startswith("i0:")}
    assert await c.redis.zscore(c.keys.ejected(), "i0") is None
    await c.register_instance(spec(0, epoch=1))
    view = await c.read_outliers()
    assert view.cordoned_ids() == frozenset() and view.ejected_ids() == frozenset()
