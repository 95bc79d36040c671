"""Hypothesis stateful test of the reservation lifecycle (DESIGN.md §6 invariants).

Two nodes share one pool. Hypothesis drives registrations, restarts (higher epochs),
fenced registrations, unregistrations, heartbeats, reserves (fresh and duplicate rids),
first tokens, releases (double, unknown) and reaping, and after every step checks that
Redis holds exactly the reservations the model expects, with exact counters.

The Coordinator is asyncio; a state machine is synchronous, so each machine owns an
event loop and runs every call through it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, ClassVar, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from coordinator import (
    Coordinator,
    EpochFencedError,
    InstanceSpec,
    NoInstanceError,
    Reservation,
    Settings,
    UnknownInstanceError,
    Weights,
)
from coordinator.connection import connect_redis
from tests.conftest import MakeCoordinator
from tests.helpers import (
    assert_counters_match_reservations,
    delete_pool,
    live_reservations,
    packed_counters,
    spec,
)

T = TypeVar("T")

NODES = 2
INSTANCE_IDS = ("i0", "i1", "i2")
# Hypothesis replays a choice sequence and needs the same draws each time, so every
# decision must be deterministic: nothing may expire within an example, rids come
# from a counter, and the backlog (the one score input that moves with the Redis
# clock) has weight 0. Pending and decoding counts still score the predicted layer.
BASE_SETTINGS = Settings(
    redis_timeout_ms=5000,
    lease_ms=600_000,
    instance_ttl_ms=600_000,
    hint_ttl_ms=600_000,
    weights=Weights(backlog_ms=0.0),
)
# A 0 ms overhead: short prompts have 0 ms prefills, the '-0' edge the scripts must take.
TIMING = {"prefill_ms_per_token": 0.01, "prefill_overhead_ms": 0.0, "decode_ms_per_token": 10.0}
# Node 0 reads the snapshot before every decision; node 1 decides from the deltas its
# own replies piggyback, so it often works from a stale view (version conflicts,
# retries, forced reserves).
NODE_SETTINGS = (
    BASE_SETTINGS.with_(snapshot_max_age_ms=0),
    BASE_SETTINGS.with_(snapshot_max_age_ms=600_000),
)
RUN_SETTINGS = settings(
    max_examples=30,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

node_index = st.integers(0, NODES - 1)
instance_id = st.sampled_from(INSTANCE_IDS)
hints = st.one_of(
    st.none(),
    st.fixed_dictionaries(
        {},
        optional={
            "engine_running": st.integers(0, 64).map(float),
            "engine_waiting": st.floats(0, 1000, allow_nan=False),
            "queue_depth": st.integers(0, 10).map(float),
        },
    ),
)


class ReservationMachine(RuleBasedStateMachine):
    """Model: registered epochs and the live reservations, per rid."""

    redis_url: ClassVar[str | None] = None  # None: a fresh fakeredis server per example

    rids = Bundle("rids")

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.pool = f"h{uuid.uuid4().hex[:10]}"
        self.nodes: list[Coordinator] = self.run(self._make_nodes)
        self.epochs: dict[str, int] = {}
        self.live: dict[str, tuple[str, str]] = {}  # rid -> (instance, phase)
        self.owner: dict[str, int] = {}  # rid -> index of the node that reserved it
        self.unknown_rids = 0
        self.next_rid = 0

    async def _make_nodes(self) -> list[Coordinator]:
        url = self.redis_url
        if url is None:
            import fakeredis

            server = fakeredis.FakeServer()

            def client() -> Any:
                return fakeredis.FakeAsyncRedis(server=server, decode_responses=True)
        else:

            def client() -> Any:
                return connect_redis(url, BASE_SETTINGS)

        return [
            Coordinator(
                client(), pool=self.pool, node_id=f"n{k}", settings=NODE_SETTINGS[k], seed=k
            )
            for k in range(NODES)
        ]

    def run(self, make: Callable[[], Awaitable[T]]) -> T:
        """Run one coroutine to completion on this machine's loop."""

        async def call() -> T:
            return await make()

        return self.loop.run_until_complete(call())

    def reserve_on(
        self, node: int, prompt: int, output: int, strategy: str | None, rid: str | None = None
    ) -> Reservation:
        """Reserve through one node (expects at least one registered instance)."""
        c = self.nodes[node]
        return self.run(lambda: c.reserve(prompt, output, strategy, rid=rid))

    def teardown(self) -> None:
        try:
            node = self.nodes[0]
            self.run(lambda: delete_pool(node.redis, node.settings.key_prefix, self.pool))
            for n in self.nodes:
                self.run(n.close)
        finally:
            self.loop.close()

    # -------------------------------------------------------------- registry

    @initialize(count=st.integers(0, len(INSTANCE_IDS)))
    def start_with_instances(self, count: int) -> None:
        for iid in INSTANCE_IDS[:count]:
            self.register(0, iid)

    @rule(node=node_index, iid=instance_id)
    def register(self, node: int, iid: str) -> None:
        result = self.run(lambda: self.nodes[node].register_instance(spec(iid, **TIMING)))
        if iid in self.epochs:
            assert (result.status, result.epoch, result.voided_reservations) == (
                "updated",
                self.epochs[iid],
                0,
            )
        else:
            assert (result.status, result.epoch, result.voided_reservations) == ("new", 1, 0)
            self.epochs[iid] = 1

    @precondition(lambda self: bool(self.epochs))
    @rule(node=node_index, data=st.data(), bump=st.sampled_from([1, 2, -1]))
    def restart(self, node: int, data: st.DataObject, bump: int) -> None:
        iid = data.draw(st.sampled_from(sorted(self.epochs)))
        epoch = self.epochs[iid] + bump
        register = self.nodes[node].register_instance
        if bump < 0 and epoch >= 1:
            with pytest.raises(EpochFencedError):  # an older engine epoch is fenced off
                self.run(lambda: register(spec(iid, epoch=epoch, **TIMING)))
            return
        if epoch == 0:  # 0 means "keep the stored epoch"
            result = self.run(lambda: register(spec(iid, epoch=0, **TIMING)))
            assert (result.status, result.epoch) == ("updated", self.epochs[iid])
            return
        result = self.run(lambda: register(spec(iid, epoch=epoch, **TIMING)))
        voided = [rid for rid, (on, _) in self.live.items() if on == iid]
        assert (result.status, result.epoch, result.voided_reservations) == (
            "restarted",
            epoch,
            len(voided),
        )
        self.epochs[iid] = epoch
        for rid in voided:
            del self.live[rid]

    @rule(node=node_index, iid=instance_id)
    def unregister(self, node: int, iid: str) -> None:
        if iid not in self.epochs:
            with pytest.raises(UnknownInstanceError):
                self.run(lambda: self.nodes[node].unregister_instance(iid))
            return
        voided = self.run(lambda: self.nodes[node].unregister_instance(iid))
        gone = [rid for rid, (on, _) in self.live.items() if on == iid]
        assert voided == len(gone)
        del self.epochs[iid]
        for rid in gone:
            del self.live[rid]

    # -------------------------------------------------------------- reservations

    @rule(
        target=rids,
        node=node_index,
        count=st.integers(1, 3),
        prompt=st.integers(0, 4000),
        output=st.integers(0, 400),
        strategy=st.sampled_from([None, "least_load", "round_robin", "power_of_two"]),
    )
    def reserve(self, node: int, count: int, prompt: int, output: int, strategy: str | None) -> Any:
        if not self.epochs:
            with pytest.raises(NoInstanceError):
                self.run(lambda: self.nodes[node].reserve(prompt, output, strategy))
            return multiple()
        made = []
        for _ in range(count):
            self.next_rid += 1
            r = self.reserve_on(node, prompt, output, strategy, f"r{self.next_rid}")
            assert not r.degraded
            assert r.instance_id in self.epochs and r.epoch == self.epochs[r.instance_id]
            assert r.prompt_tokens == prompt and r.expected_output_tokens == output
            assert r.rid not in self.owner
            self.live[r.rid] = (r.instance_id, "prefill")
            self.owner[r.rid] = node
            made.append(r.rid)
        return multiple(*made)

    @rule(rid=rids)
    def reserve_same_rid(self, rid: str) -> None:
        node = self.owner[rid]
        if rid in self.live:
            r = self.reserve_on(node, 10, 10, None, rid)
            assert r.instance_id == self.live[rid][0]  # a duplicate, not a second claim
        elif self.epochs:
            r = self.reserve_on(node, 10, 10, None, rid)
            self.live[rid] = (r.instance_id, "prefill")  # the old one ended: a new claim

    @rule(rid=rids, node=node_index)
    def mark_first_token(self, rid: str, node: int) -> None:
        moved = self.run(lambda: self.nodes[node].mark_first_token(rid))
        expected = rid in self.live and self.live[rid][1] == "prefill"
        assert moved is expected
        if expected:
            self.live[rid] = (self.live[rid][0], "decode")

    @rule(rid=rids)
    def release(self, rid: str) -> None:
        # Twice, unknown or voided: the bundle keeps released rids, so all are drawn.
        released = self.run(lambda: self.nodes[self.owner[rid]].release(rid))
        assert released is (rid in self.live)
        self.live.pop(rid, None)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), first_token=st.booleans())
    def finish_live(self, data: st.DataObject, first_token: bool) -> None:
        # The bundle rules above mostly draw dead rids once reservations churn; this
        # one always ends a live reservation, as a completed request does.
        rid = data.draw(st.sampled_from(sorted(self.live)))
        node = self.owner[rid]
        if first_token:
            moved = self.run(lambda: self.nodes[node].mark_first_token(rid))
            assert moved is (self.live[rid][1] == "prefill")
            self.live[rid] = (self.live[rid][0], "decode")
            self.redis_matches_model()
        assert self.run(lambda: self.nodes[node].release(rid)) is True
        del self.live[rid]

    @rule(node=node_index, iid=instance_id, values=hints)
    def background(self, node: int, iid: str, values: dict[str, float] | None) -> None:
        """What runs beside requests: heartbeats, stray rids, the reaper."""
        c = self.nodes[node]
        if iid in self.epochs:
            assert self.run(lambda: c.heartbeat_instance(iid, values)) == self.epochs[iid]
        else:
            with pytest.raises(UnknownInstanceError):
                self.run(lambda: c.heartbeat_instance(iid, values))
        self.unknown_rids += 1
        rid = f"unknown-{self.unknown_rids}"
        assert self.run(lambda: c.release(rid)) is False
        assert self.run(lambda: c.mark_first_token(rid)) is False
        # Every node's lease is long: nothing may be reaped.
        assert self.run(c.reap_expired) == 0

    # -------------------------------------------------------------- invariants

    @invariant()
    def redis_matches_model(self) -> None:
        node = self.nodes[0]
        self.run(lambda: assert_counters_match_reservations(node))
        records = self.run(lambda: live_reservations(node))
        assert set(records) == set(self.live)
        for rid, rec in records.items():
            assert (rec["instance"], rec["phase"]) == self.live[rid], rid
            assert rec["node"] == f"n{self.owner[rid]}"
        stored = self.run(lambda: node.redis.hgetall(node.keys.column("epoch")))
        assert {k: int(v) for k, v in stored.items()} == self.epochs
        # The serialized-prefill cursor's input: the prefill work still queued.
        pending_ms = dict.fromkeys(self.epochs, 0)
        for rec in records.values():
            if rec["phase"] == "prefill":
                pending_ms[rec["instance"]] += rec["prefill_ms"]
        stored = self.run(lambda: packed_counters(node))
        assert stored["pending_prefill_ms"] == pending_ms
        for k, n in enumerate(self.nodes):
            mine = {rid for rid in self.live if self.owner[rid] == k}
            assert mine <= set(n.local_reservations)
            assert mine <= self.run(partial(node_rids, n))


async def node_rids(c: Coordinator) -> set[str]:
    """The reservation ids Redis files under a node (what its reaper would drain)."""
    return set(await c.redis.smembers(c.keys.node_rids(c.node_id)))


def machine_for(redis_url: str | None) -> type[ReservationMachine]:
    """The machine bound to a server (None: fakeredis)."""
    return type("BoundReservationMachine", (ReservationMachine,), {"redis_url": redis_url})


@pytest.mark.real
def test_reservation_invariants_real_server(redis_url: str) -> None:
    run_state_machine_as_test(machine_for(redis_url), settings=RUN_SETTINGS)  # type: ignore[no-untyped-call]


@pytest.mark.fake
def test_reservation_invariants_fakeredis() -> None:
    run_state_machine_as_test(machine_for(None), settings=RUN_SETTINGS)  # type: ignore[no-untyped-call]


async def test_zero_prefill_ms_lifecycle(
    make_coordinator: MakeCoordinator, backend: str, request: pytest.FixtureRequest
) -> None:
    """An instance predicted to prefill in 0 ms goes through the whole lifecycle."""
    c = await make_coordinator("n1")
    zero = {"prefill_ms_per_token": 0.0, "prefill_overhead_ms": 0.0, "decode_ms_per_token": 0.0}
    await c.register_instance(InstanceSpec(id="i0", url="http://127.0.0.1:9000", **zero))
    first = await c.reserve(100, 10)
    second = await c.reserve(0, 0)
    assert first.prefill_ms == second.prefill_ms == 0
    assert await c.mark_first_token(first.rid) is True
    assert await c.release(second.rid) is True
    assert await c.release(first.rid) is True
    await assert_counters_match_reservations(c)
    assert await live_reservations(c) == {}
