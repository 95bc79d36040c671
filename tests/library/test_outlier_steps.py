"""Passive health on a big pool: no script scans the pool (issue 12's no-stall rule).

read_outliers reads the outliers hash a page per call, and record_outcome weighs an
ejection against the cap with one ZCOUNT of the `ejected` zset and the alive count
of the calling node's view, instead of scanning every instance's liveness.
"""

from __future__ import annotations

from typing import Any

import pytest

from coordinator import Coordinator
from coordinator.outliers import OutlierPolicy
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
