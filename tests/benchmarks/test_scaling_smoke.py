"""bench/scaling.py's stall scenario at a tiny scale: long work runs in bounded steps.

No timing is asserted: the durations the benchmark reports depend on the machine.
What must hold anywhere is the shape of the work: reaping and sweeping take several
calls of at most one step (coordinator.coordinator.REAP_STEP, SWEEP_STEP) each, a re-assert
restores one reservation per call, a new node reads a big pool's specs in steps
(SPEC_READ_STEP), and a timing flush merges TIMING_STEP instances' samples per call.
The cycle measurement's replay sends the very calls the nodes made, from the state
they started on, and leaves the pool as the nodes left it. The breakdown of a proxied
request's call cuts the real reserve script where it says, and counts its commands.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from collections.abc import Iterator

import pytest
from redis import Redis

from bench.scaling import (
    Scale,
    _cycles,
    _stalls,
    register_pool,
    reserve_breakdown,
    took_best,
)
from coordinator import Settings
from coordinator.coordinator import REAP_STEP, SPEC_READ_STEP, SWEEP_STEP, TIMING_STEP
from coordinator.keys import PoolKeys
from local_fleet.embedded import EmbeddedRedis
from tests.helpers import private_server

pytestmark = pytest.mark.real


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    """A private server: the scenario changes SLOWLOG settings."""
    with private_server() as server:
        yield server


async def test_stall_scenario_runs_long_work_in_bounded_steps(server: EmbeddedRedis) -> None:
    scale = Scale(
        instances=2 * SWEEP_STEP + 50,
        reservations=5 * SWEEP_STEP,
        dead_node=2 * SWEEP_STEP + 100,
        one_instance=2 * SWEEP_STEP + 100,
        reassert=40,
        churned=300,
        spec_changes=10,
        releases=20,
    )
    ops = {x["op"].split(".")[0]: x for x in await _stalls(server.url, scale)}
    assert set(ops) == {"a", "b", "c", "d", "e", "f0", "f", "g", "h"}
    # A new node reads every spec in steps of about SPEC_READ_STEP instances: HSCAN
    # gathers at least that COUNT and stops within a bucket of it (under 2 x COUNT).
    assert ops["a"]["steps"]["read_specs"] >= math.ceil(scale.instances / (2 * SPEC_READ_STEP))
    assert ops["a"]["steps"]["read_specs"] >= 2
    # The dead node's reservations go in steps of REAP_STEP (the scenario checks all went).
    assert ops["c"]["steps"] == {"reap_node": math.ceil(scale.dead_node / REAP_STEP)}
    # Unregister voids at once and sweeps one step; the lease loop sweeps the rest.
    assert ops["d"]["steps"]["unregister"] == 1
    assert ops["d"]["steps"]["sweep"] >= math.ceil(scale.one_instance / SWEEP_STEP) - 1
    # A timing flush with samples of every instance merges TIMING_STEP of them per call.
    assert ops["g"]["steps"]["merge_timing"] >= math.ceil(scale.instances / TIMING_STEP)
    # Every instance's failure record is read a page per call.
    assert ops["h"]["steps"]["read_outliers"] > 1
    # Re-assert: one restore per reservation made while degraded.
    assert ops["e"]["steps"]["restore"] == scale.reassert
    # After churn the small pool is read in one step each, as before it.
    assert ops["f"]["steps"] == ops["f0"]["steps"] == {"read_state": 1, "read_specs": 1}
    assert ops["f"]["keys"]["spec"] == 10
    assert ops["f"]["keys"]["retired"] == 0


async def test_cycle_replay_repeats_the_run_and_restores_the_pool(server: EmbeddedRedis) -> None:
    register_pool(server.url, "replay", 8)
    meta = PoolKeys(Settings().key_prefix, "replay").column("meta")
    client = Redis.from_url(server.url, decode_responses=True)

    def state_ver() -> int:
        return int(client.hget(meta, "state_ver") or 0)

    versions = [state_ver()]
    for _ in range(2):
        r, recording = await _cycles(server.url, "replay", 1, 40, in_flight=8)
        r.update(recording.replay(server.url))
        recording.close()
        versions.append(state_ver())
        # One node sends one call at a time: the replay meets exactly the states the
        # run met, so every call gets the status it got then.
        assert r["replay_same"] == 1.0
        # A reserve per request (carrying the marks and releases), then one carry
        # with the last ones.
        assert round(r["calls_per_req"] * 40) == 41
        assert r["busy_cpu_us_per_req"] > 0
        # A lone node's view is current: every reserve took a candidate it ranked best,
        # and the replay timed each (SLOWLOG).
        assert r["walked_share"] == 0.0 and r["first_us"] > 0
    # Each run changed `state` three times per request (reserve, first token, release),
    # the 8 held in flight around the measured 40 included, and its replay counted none
    # twice: the pool ends as the nodes left it, empty.
    assert [b - a for a, b in itertools.pairwise(versions)] == [3 * 48, 3 * 48]
    assert client.hlen(PoolKeys(Settings().key_prefix, "replay").column("reservations")) == 0
    client.close()


async def test_cycles_hold_the_same_load_in_flight_whatever_the_node_count(
    server: EmbeddedRedis,
) -> None:
    """The measured calls start from a pool holding `in_flight` reservations, each node
    its share, and every measured request releases one: the pool ends as it began."""
    register_pool(server.url, "flight", 8)
    keys = PoolKeys(Settings().key_prefix, "flight")
    client = Redis.from_url(server.url, decode_responses=True)
    for nodes in (1, 4):
        _, recording = await _cycles(server.url, "flight", nodes, 40, in_flight=16)
        recording.start.restore()
        held = client.hvals(keys.column("reservations"))
        assert len(held) == 16
        assert sorted(set(Counter(json.loads(h)["node"] for h in held).values())) == [16 // nodes]
        recording.end.restore()
        assert client.hlen(keys.column("reservations")) == 0
        recording.close()
    client.close()


def test_a_reserve_took_its_best_when_it_took_its_first_or_a_tie_for_first() -> None:
    def args(ties: int) -> list[object]:
        head: list[object] = ["rid", "node", 512, 128, 0, 0, 1000, 0, "", 3, ties, ""]
        return [*head, "a", "b0", "b", "b1", "c", "b2"]

    assert took_best(args(0), "a") and not took_best(args(0), "b")
    assert took_best(args(2), "b") and not took_best(args(2), "c")
    assert took_best(args(3), "c")


def test_reserve_breakdown_cuts_the_real_script_and_counts_its_commands(
    server: EmbeddedRedis,
) -> None:
    register_pool(server.url, "parts", 64)
    parts = reserve_breakdown(server.url, "parts", 20)
    assert set(parts) == {"upto_args", "upto_decided", "whole", "whole_inner", "whole_commands"}
    assert all(value > 0 for value in parts.values())
    # A proxied request's one call: reserve (TIME, the lease, meta, the first
    # candidate's liveness, slot, max_slots and record, its epoch, then the record
    # (HSETNX: the duplicate check), the index, the node's set, the packed record and
    # meta) = 13; the carried first-token mark (record, index out and in, epoch, packed
    # record read and write: the slot is the record's) = 7; the carried release (node's
    # set, record, its deletion, index, epoch, packed record read and write) = 7. Fewer
    # when two of them touch one instance (its record is read once); one more when a
    # release ends the instance's earliest reservation (the index is read for the next).
    assert 25 <= parts["whole_commands"] <= 29
