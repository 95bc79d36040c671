"""The shared prefix index (coordinator/prefix_index.py, lua/_lib.lua record_prefix)
against the real server and fakeredis (they must agree): lookup, bounds, epochs,
privacy."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from coordinator import Coordinator, ScriptArgumentError
from coordinator.held_records import RECORD_PAIRS, RECORD_STEP, HeldRecords
from coordinator.models import RequestShape
from coordinator.prefix import CachedTokens
from coordinator.prefix_entries import COUNT_FRESH_MS
from coordinator.prefix_index import SAMPLE_EVERY, recorded_entries
from tests.conftest import MakeCoordinator
from tests.helpers import assert_counters_match_reservations, live_reservations, spec
from tests.library.test_fault_paths import lose_next_reply, recovered
from tests.library.test_snapshot_cache import count_calls

BLOCK = 64  # characters per block in these tests
TOKENS = BLOCK // 4  # tokens one block stands for


async def setup(
    make: MakeCoordinator, n: int = 3, stride: int = 1, carry_ms: int = 20, **spec_fields: int
) -> Coordinator:
    """A node indexing every block (`stride` 1) unless told, and `n` instances."""
    c = await make("n1", prefix_block_chars=BLOCK, prefix_record_stride=stride, carry_ms=carry_ms)
    for i in range(n):
        await c.register_instance(spec(i, **spec_fields))
    await c.refresh()
    return c


def text(*parts: str) -> str:
    """One BLOCK-sized block per part: the part repeated."""
    return "".join((p * BLOCK)[:BLOCK] for p in parts)


def hashes(c: Coordinator, *parts: str) -> list[str]:
    return c.prefix.hashes({"prompt": text(*parts)})


async def owners(c: Coordinator) -> dict[str, str]:
    """The index's block fields (its count fields have a '#')."""
    values = await c.redis.hgetall(c.keys.prefix_index())
    return {str(k): str(v) for k, v in values.items() if "#" not in str(k)}


async def untimed(c: Coordinator) -> dict[str, str]:
    """`owners`, with the Redis second of each entry inside a prompt ("+<second>")
    left as "+"."""
    return {k: re.sub(r"\+\d+", "+", v) for k, v in (await owners(c)).items()}


async def counts(c: Coordinator) -> dict[str, str]:
    """The index's count and latest-epoch fields ("<id>#<epoch>", "<id>#")."""
    values = await c.redis.hgetall(c.keys.prefix_index())
    return {str(k): str(v) for k, v in values.items() if "#" in str(k)[1:]}


async def test_lookup_counts_the_leading_blocks_each_instance_holds(
    make_coordinator: MakeCoordinator,
) -> None:
    c = await setup(make_coordinator)
    await c.prefix.record("i0", hashes(c, "a", "b", "c", "d"))
    await c.prefix.record("i1", hashes(c, "a", "b"))
    assert await c.prefix.cached_tokens(hashes(c, "a", "b", "c", "x")) == {
        "i0": 3 * TOKENS,
        "i1": 2 * TOKENS,
    }
    # A block only counts behind its whole prefix: "b" after "x" is another hash.
    assert await c.prefix.cached_tokens(hashes(c, "x", "b")) == {}
    assert await c.prefix.cached_tokens([]) == {}


async def test_capacity_bounds_an_instance_and_evicts_oldest_tails_first(
    make_coordinator: MakeCoordinator,
) -> None:
    c = await setup(make_coordinator, prefix_cache_tokens=4 * TOKENS)
    await c.prefix.record("i0", hashes(c, "a", "b", "c"))
    await c.prefix.record("i0", hashes(c, "x", "y"))
    assert await c.prefix.index_tokens([("i0", 1)]) == {"i0": 4 * TOKENS}
    assert await counts(c) == {"i0#1": "5", "i0#": "1"}
    # The older request lost its deepest block; its head is still held.
    assert await c.prefix.cached_tokens(hashes(c, "a", "b", "c")) == {"i0": 2 * TOKENS}
    assert await c.prefix.cached_tokens(hashes(c, "x", "y")) == {"i0": 2 * TOKENS}


async def test_recording_again_refreshes_instead_of_duplicating(
    make_coordinator: MakeCoordinator,
) -> None:
    c = await setup(make_coordinator)
    for _ in range(3):
        await c.prefix.record("i0", hashes(c, "a", "b"))
    values = await owners(c)
    assert len(values) == 2 and all(value.count("i0#") == 1 for value in values.values())


async def test_max_owners_keeps_the_most_recent_instances(
    make_coordinator: MakeCoordinator,
) -> None:
    c = await make_coordinator(
        "n1", prefix_block_chars=BLOCK, prefix_max_owners=2, prefix_record_stride=1
    )
    for i in range(4):
        await c.register_instance(spec(i))
    await c.refresh()
    for i in range(4):
        await c.prefix.record(f"i{i}", hashes(c, "a"))
    assert await c.prefix.cached_tokens(hashes(c, "a")) == {"i2": TOKENS, "i3": TOKENS}
    assert [v.split() for v in (await owners(c)).values()] == [["i2#1|1", "i3#1|1"]]


async def test_a_record_keeps_the_other_instances_marked_entries(
    make_coordinator: MakeCoordinator,
) -> None:
    """Entries a prompt went on past ('+<second>') stay as they are when another
    instance records the block, and the recording instance's own entry is rewritten
    as this prompt has it: inside it or at its end."""
    c = await setup(make_coordinator)
    await c.prefix.record("i1", hashes(c, "a", "b"))
    await c.prefix.record("i0", hashes(c, "a", "c"))
    await c.prefix.record("i1", hashes(c, "a"))  # a prompt that ends there
    a = hashes(c, "a")[0]
    assert (await untimed(c))[a].split() == ["i0#1|2+", "i1#1|3"]
    found = await c.prefix.cached_tokens(hashes(c, "a", "d"))
    assert found == {"i0": TOKENS, "i1": TOKENS} and found.hot == {"i0"}


async def test_epoch_bump_voids_at_once_and_storage_is_reclaimed(
    make_coordinator: MakeCoordinator,
) -> None:
    c = await setup(make_coordinator)
    await c.prefix.record("i0", hashes(c, "a", "b"))
    await c.register_instance(spec(0, epoch=2))
    await c.refresh()
    assert await c.prefix.cached_tokens(hashes(c, "a", "b")) == {}
    # The node's next sampled record (one in SAMPLE_EVERY, the first one included)
    # reclaims the old epoch: this index is small enough to be sampled whole.
    for _ in range(SAMPLE_EVERY):
        await c.prefix.record("i0", hashes(c, "z"))
    assert list((await owners(c)).values()) == [f"i0#2|{SAMPLE_EVERY}"]
    assert await counts(c) == {"i0#2": str(SAMPLE_EVERY), "i0#": "2"}


async def test_an_unregistered_instance_is_reclaimed_by_later_records(
    make_coordinator: MakeCoordinator,
) -> None:
    c = await setup(make_coordinator)
    await c.prefix.record("i1", hashes(c, "a", "b", "c"))
    await c.prefix.record("i0", hashes(c, "q"))
    await c.unregister_instance("i1")
    await c.refresh()
    assert await c.prefix.cached_tokens(hashes(c, "a")) == {}
    # The node's next sampled record reads this small index whole.
    for _ in range(SAMPLE_EVERY):
        await c.prefix.record("i0", hashes(c, "q"))
    assert list(await owners(c)) == hashes(c, "q")
    # i1's count goes; its latest epoch stays, for an automatic epoch to continue above
    assert await counts(c) == {"i0#1": str(SAMPLE_EVERY + 1), "i0#": "1", "i1#": "1"}


async def test_sampled_records_sweep_a_large_index_whole(
    make_coordinator: MakeCoordinator,
) -> None:
    """On an index far larger than one sample, the sampled records go on where the
    previous sample ended (HSCAN), so within about one sweep every field has been read
    and every entry of an unregistered instance is gone; random samples would leave
    some for a long time."""
    c = await setup(make_coordinator)
    for k in range(80):  # 240 fields of i1, against samples of 32 (one entry a record)
        await c.prefix.record("i1", hashes(c, f"x{k}", "y", "z"))
    await c.unregister_instance("i1")
    await c.refresh()
    samples = 0
    while any("i1#" in v for v in (await owners(c)).values()):
        assert samples < 24, "the sweep should have reached every field by now"
        for _ in range(SAMPLE_EVERY):
            await c.prefix.record("i0", hashes(c, "q"))
        samples += 1
    # a sample reads about 32 of the ~250 fields (a sweep takes about 8), not all
    assert samples >= 3


async def test_nothing_but_hashes_and_ids_is_stored(make_coordinator: MakeCoordinator) -> None:
    c = await setup(make_coordinator)
    secret = "my password is hunter2 " * 20
    await c.prefix.record("i0", c.prefix.hashes({"prompt": secret}))
    values = await c.redis.hgetall(c.keys.prefix_index())
    stored = " ".join([*values, *values.values()])
    assert values and "hunter2" not in stored and "password" not in stored


async def test_bad_records_are_refused_and_nothing_is_written(
    make_coordinator: MakeCoordinator,
) -> None:
    """A record rides on a `carry` (or `reserve`) call as r, then per record its stem,
    max_owners, k and k pairs: anything else is refused before the call writes."""
    c = await setup(make_coordinator)
    res = await c.reserve(100, 10)
    keys = (c._node_rids, c.keys.prefix_index())
    for record in (
        ["i0#1", 8, 1, "not-hex", 1],
        ["i0#1", 8, 2, "ab", 1, "", 1],
        ["i0#1", 8, 1, "ab cd", 1],
        ["i0#1", 8, 1, "ab"],  # no weight
        ["i0#1", 8, 0],  # no block
        ["i0#1", 8, 1, "ab", 513],
        ["i0#1", 0, 1, "ab", 1],
        ["i0", 8, 1, "ab", 1],  # no epoch
        ["i 0#1", 8, 1, "ab", 1],
        ["i0#x", 8, 1, "ab", 1],
        ["i0#1", 8, 1, "ab", 1, "extra"],
    ):
        with pytest.raises(ScriptArgumentError):
            await c._direct_call("carry", [2, "f", res.rid, "r", res.rid, 1, *record], keys)
    with pytest.raises(ScriptArgumentError, match="KEYS"):  # a record needs the index key
        await c._direct_call("carry", [0, 1, "i0#1", 8, 1, "ab", 1], (c._node_rids,))
    with pytest.raises(ScriptArgumentError, match="records"):
        await c._direct_call("carry", [0, 17, *["i0#1", 8, 1, "ab", 1] * 17], keys)
    assert not await c.redis.exists(c.keys.prefix_index())
    assert (await live_reservations(c))[res.rid]["phase"] == "prefill", "no mark applied"
    await assert_counters_match_reservations(c)


async def test_a_record_rides_on_the_next_reserve(make_coordinator: MakeCoordinator) -> None:
    """A request's record is no call of its own: the node's next reserve carries it,
    and the count it replies reaches the record (the node's view of the count)."""
    c = await setup(make_coordinator, carry_ms=1000)
    calls = count_calls(c)
    first = await c.reserve(100, 10)
    blocks = hashes(c, "a", "b")
    recording = asyncio.create_task(c.prefix.record(first.instance_id, blocks))
    await asyncio.sleep(0)  # the record is held
    assert calls == {"reserve": 1}
    await c.reserve(100, 10)
    await recording
    assert calls == {"reserve": 2}, "the record came with the second reservation"
    epoch = await c.redis.hget(c.keys.column("epoch"), first.instance_id)
    stem = f"{first.instance_id}#{epoch}"
    assert await untimed(c) == {blocks[0]: f"{stem}|2+", blocks[1]: f"{stem}|1"}
    assert c.prefix.seen.fresh(stem, 10**6, time.monotonic() * 1000) == 2, "the reply's count"
    assert await c.prefix.cached_tokens(blocks) == {first.instance_id: 2 * TOKENS}


async def test_held_records_go_by_themselves_in_bounded_calls(
    make_coordinator: MakeCoordinator,
) -> None:
    """Records with no reserve to ride on go in carry calls after carry_ms, at most
    RECORD_STEP each, and none is lost."""
    c = await setup(make_coordinator, carry_ms=20)
    calls = count_calls(c)
    parts = [chr(ord("a") + k) for k in range(2 * RECORD_STEP + 1)]
    await asyncio.gather(*(c.prefix.record("i1", hashes(c, p)) for p in parts))
    assert calls == {"carry": 3}
    index = await counts(c)
    epoch = await c.redis.hget(c.keys.column("epoch"), "i1")
    assert index[f"i1#{epoch}"] == str(len(parts))
    for p in parts:
        assert await c.prefix.cached_tokens(hashes(c, p)) == {"i1": TOKENS}


async def test_a_degraded_node_holds_no_record(make_coordinator: MakeCoordinator) -> None:
    c = await setup(make_coordinator)
    c._enter_degraded("test")
    calls = count_calls(c)
    await c.prefix.record("i0", hashes(c, "a"))  # best effort: nothing recorded, no error
    assert not c._records
    assert calls == {}


async def test_reserve_follows_the_cache_until_the_guard_says_it_is_too_busy(
    make_coordinator: MakeCoordinator,
) -> None:
    """Predicted prefill 0.1 ms/token: 9000 cached tokens save 900 ms on i0."""
    for guard_ms, expected in ((0, "i0"), (200, "i1")):
        c = await make_coordinator(f"n-guard-{guard_ms}", prefix_guard_ms=guard_ms)
        for i in range(2):
            await c.register_instance(spec(i, prefill_ms_per_token=0.1, prefill_overhead_ms=5.0))
        await c.refresh()
        busy = await c.reserve(5000, 1, exclude=["i1"])  # i0: ~505 ms of backlog
        res = await c.reserve(10_000, 1, cached_tokens={"i0": 9000})
        # Without the guard, 505 ms of queue beats 900 ms of prefill: i0 piles up.
        # With a 200 ms guard, i0's credit is gone: the idle i1 computes the prefix.
        assert res.instance_id == expected, guard_ms
        # Whatever ranking used, the reservation keeps the full expected credit.
        assert res.cached_tokens == (9000 if expected == "i0" else 0)
        for r in (busy, res):
            await c.release(r.rid)
        await c.unregister_instance("i0")
        await c.unregister_instance("i1")


async def test_a_prefix_this_node_just_routed_is_hot_on_this_node_only(
    make_coordinator: MakeCoordinator,
) -> None:
    c = await setup(make_coordinator)
    other = await make_coordinator("n2", prefix_block_chars=BLOCK, prefix_record_stride=1)
    await other.refresh()
    turn = hashes(c, "a", "b")
    await other.prefix.record("i0", turn)  # another node routed it
    found = await c.prefix.cached_tokens(hashes(c, "a", "b", "c"))
    assert isinstance(found, CachedTokens) and found == {"i0": 2 * TOKENS}
    assert found.hot == frozenset()
    other.prefix.routed(hashes(c, "a", "b", "y"))  # hot on the other node only
    c.prefix.routed(hashes(c, "a"))  # this node: a prompt of the first block
    await c.prefix.record("i1", hashes(c, "a"))
    found = await c.prefix.cached_tokens(hashes(c, "a", "b", "c"))
    # a prompt that goes on from it, as a conversation's next turn does: not hot
    assert found == {"i0": 2 * TOKENS, "i1": TOKENS} and found.hot == frozenset()
    c.prefix.routed(hashes(c, "a", "x"))  # another prompt through "a"
    found = await c.prefix.cached_tokens(hashes(c, "a", "b", "c"))
    # i1's deepest credited block ("a") is hot here; i0's ("a", "b") is not.
    assert found == {"i0": 2 * TOKENS, "i1": TOKENS} and found.hot == {"i1"}


async def test_reserve_guards_a_hot_prefix_sooner_than_a_conversation_turn(
    make_coordinator: MakeCoordinator,
) -> None:
    """Predicted prefill 0.1 ms/token: 9000 cached tokens save 900 ms on i0, which is
    ~505 ms busier. A 10 s guard keeps a turn's credit; a hot prefix's 200 ms is gone."""
    c = await make_coordinator("n-hot", prefix_guard_ms=10_000, prefix_hot_guard_ms=200)
    for i in range(2):
        await c.register_instance(spec(i, prefill_ms_per_token=0.1, prefill_overhead_ms=5.0))
    await c.refresh()
    busy = await c.reserve(5000, 1, exclude=["i1"])
    for hot, expected in ((frozenset(), "i0"), (frozenset({"i0"}), "i1")):
        cached = CachedTokens({"i0": 9000}, hot=hot)
        res = await c.reserve(10_000, 1, cached_tokens=cached)
        assert res.instance_id == expected, hot
        await c.release(res.rid)
    await c.release(busy.rid)


async def test_a_stale_view_still_follows_the_cache_while_the_credit_outweighs_the_change(
    make_coordinator: MakeCoordinator,
) -> None:
    """Reserve passes over a candidate that got busier since the caller's view (so
    simultaneous bursts spread); a cache credit worth more than that change keeps it."""
    timing = {"prefill_ms_per_token": 0.1, "prefill_overhead_ms": 5.0}
    stale = await make_coordinator("n-stale", snapshot_max_age_ms=600_000)
    other = await make_coordinator("n-other")
    for i in range(2):
        await stale.register_instance(spec(i, **timing))
    await stale.refresh()  # the view this node decides on below
    await other.refresh()
    taken = await other.reserve(100, 1, exclude=["i1"])  # i0 is now busier than seen
    assert taken.instance_id == "i0"
    # 9000 cached tokens save 900 ms, worth 900 * 0.05 / 2 = 22 requests of load.
    res = await stale.reserve(10_000, 1, cached_tokens={"i0": 9000})
    assert res.instance_id == "i0" and res.cached_tokens == 9000


async def test_a_follow_up_records_only_the_blocks_it_adds(
    make_coordinator: MakeCoordinator,
) -> None:
    c = await setup(make_coordinator)
    first = hashes(c, "a", "b", "c")
    await c.prefix.record("i0", first)
    follow_up = hashes(c, "a", "b", "c", "d", "e")
    held = (await c.prefix.cached_tokens(follow_up))["i0"]
    assert held == 3 * TOKENS
    before = await owners(c)
    await c.prefix.record("i0", follow_up, held)
    after = await owners(c)
    # The head it already had is untouched, its deepest block refreshed, two added.
    assert sorted(after) == sorted(follow_up)
    assert [after[h] == before[h] for h in first] == [True, True, False]
    assert await c.prefix.cached_tokens(follow_up) == {"i0": 5 * TOKENS}
    # Nothing new: only the deepest block is refreshed, and the count stays.
    await c.prefix.record("i0", follow_up, 5 * TOKENS)
    again = await owners(c)
    assert [again[h] == after[h] for h in follow_up] == [True] * 4 + [False]
    assert (await counts(c))["i0#1"] == "5"


async def test_a_degraded_node_does_not_ask_redis(make_coordinator: MakeCoordinator) -> None:
    """Degraded, every lookup would wait for a Redis timeout: it answers at once."""
    c = await setup(make_coordinator)
    h = hashes(c, "a", "b")
    await c.prefix.record("i0", h)
    assert await c.prefix.cached_tokens(h) == {"i0": 2 * TOKENS}

    class Refusing:
        async def hmget(self, *args: object) -> None:
            raise AssertionError("a degraded node sent HMGET")

    c.prefix._redis = Refusing()
    c._degraded = True  # what _enter_degraded sets (without starting its recovery task)
    assert await c.prefix.cached_tokens(h) == {}
    await c.prefix.record("i0", h)  # and records nothing, silently


async def test_a_re_registered_id_gets_no_credit_for_its_old_registration(
    make_coordinator: MakeCoordinator,
) -> None:
    """Unregistering an id with no reservations forgets its epoch at once; registering
    it again must not revive the blocks its old (restarted) engine held."""
    c = await setup(make_coordinator)
    await c.prefix.record("i1", hashes(c, "a", "b", "c"))
    await c.unregister_instance("i1")
    status = await c.register_instance(spec(1))
    await c.refresh()
    assert status.status == "new"
    assert await c.prefix.cached_tokens(hashes(c, "a", "b", "c")) == {}


async def test_an_explicit_epoch_keeps_the_credit_of_the_same_engine(
    make_coordinator: MakeCoordinator,
) -> None:
    """An engine that names its epoch (its start time, say) and comes back with the
    same one after an unregister is the same process: its cache is still there."""
    c = await setup(make_coordinator, n=0)
    await c.register_instance(spec(1, epoch=5))
    await c.refresh()
    await c.prefix.record("i1", hashes(c, "a", "b"))
    await c.unregister_instance("i1")
    status = await c.register_instance(spec(1, epoch=5))
    await c.refresh()
    assert (status.status, status.epoch) == ("new", 5)
    assert await c.prefix.cached_tokens(hashes(c, "a", "b")) == {"i1": 2 * TOKENS}


async def test_a_prompt_in_constant_use_is_not_evicted_as_the_oldest(
    make_coordinator: MakeCoordinator,
) -> None:
    """An engine's cache refreshes a prefix on every hit; so must the index, or a
    prompt repeated all the time loses its credit to newer, colder ones."""
    c = await setup(make_coordinator, prefix_cache_tokens=4 * TOKENS)
    hot = hashes(c, "a", "b")
    await c.prefix.record("i0", hot)
    await c.prefix.record("i0", hashes(c, "x", "y"))
    held = (await c.prefix.cached_tokens(hot))["i0"]
    assert held == 2 * TOKENS
    await c.prefix.record("i0", hot, held)  # the hot prompt again: a whole hit
    await c.prefix.record("i0", hashes(c, "z", "w"))  # two over capacity
    assert await c.prefix.cached_tokens(hot) == {"i0": 2 * TOKENS}
    # The refresh added no block: "x", "y" and the new two are the last four added.
    assert await c.prefix.cached_tokens(hashes(c, "x", "y")) == {"i0": 2 * TOKENS}
    await c.prefix.record("i0", hashes(c, "v"))  # one more: "y" falls out
    assert await c.prefix.cached_tokens(hashes(c, "x", "y")) == {"i0": TOKENS}
    assert await c.prefix.cached_tokens(hot) == {"i0": 2 * TOKENS}


def test_recorded_entries_are_every_stride_th_block_and_the_last() -> None:
    assert recorded_entries(20, 0, 8) == [(8, 8), (16, 8), (20, 4)]
    assert recorded_entries(16, 0, 8) == [(8, 8), (16, 8)]
    # A follow-up: the deepest held block refreshed (weight 0), then the new ones.
    assert recorded_entries(32, 30, 8) == [(30, 0), (32, 2)]
    assert recorded_entries(5, 5, 8) == [(5, 0)]  # a whole hit: only the refresh
    assert recorded_entries(3, 0, 1) == [(1, 1), (2, 1), (3, 1)]
    assert recorded_entries(3, 9, 1) == [(3, 0)]  # held is capped at the prompt


async def test_a_strided_index_credits_the_deepest_entry_and_counts_blocks(
    make_coordinator: MakeCoordinator,
) -> None:
    c = await setup(make_coordinator, stride=8)
    parts = [chr(ord("a") + k) for k in range(20)]
    whole = hashes(c, *parts)
    await c.prefix.record("i0", whole)
    # Entries at blocks 8, 16 and 20, at the counts their weights brought, deepest
    # first; the prompt went on past 8 and 16 ('+').
    assert await untimed(c) == {whole[19]: "i0#1|4", whole[15]: "i0#1|12+", whole[7]: "i0#1|20+"}
    found = await c.prefix.cached_tokens(hashes(c, *parts))
    assert found == {"i0": 20 * TOKENS} and found.hot == frozenset()
    # Its next turn: credited at its last block, not hot (no node routed it lately).
    found = await c.prefix.cached_tokens(hashes(c, *parts, "y"))
    assert found == {"i0": 20 * TOKENS} and found.hot == frozenset()
    # A prompt that leaves this one after 13 blocks: credited up to the entry at 8,
    # which the recorded prompt went on past: another prompt through a shared prefix,
    # hot on a node that never routed it.
    found = await c.prefix.cached_tokens(hashes(c, *parts[:13], "z"))
    assert found == {"i0": 8 * TOKENS} and found.hot == {"i0"}
    # ... within COORD_PREFIX_HOT_MS only: the same entry recorded a minute ago is not.
    now = int((await c.redis.time())[0])
    await c.redis.hset(c.keys.prefix_index(), whole[7], f"i0#1|20+{now - 60}")
    found = await c.prefix.cached_tokens(hashes(c, *parts[:13], "z"))
    assert found == {"i0": 8 * TOKENS} and found.hot == frozenset()
    assert await c.prefix.index_tokens([("i0", 1)]) == {"i0": 20 * TOKENS}
    # The next turn: its previous prompt credited in full, 3 blocks added.
    turn = hashes(c, *parts, "x", "y", "w")
    held = (await c.prefix.cached_tokens(turn))["i0"]
    assert held == 20 * TOKENS
    await c.prefix.record("i0", turn, held)
    assert await c.prefix.cached_tokens(turn) == {"i0": 23 * TOKENS}
    # The refresh added no block: the count is the prompt's blocks.
    assert await c.prefix.index_tokens([("i0", 1)]) == {"i0": 23 * TOKENS}
    assert len(await owners(c)) == 4


async def test_a_strided_index_evicts_the_oldest_tails_within_its_capacity(
    make_coordinator: MakeCoordinator,
) -> None:
    """Capacity counts blocks (the entries' weights), not entries; the oldest entry
    falls out first, which is a prompt's tail."""
    c = await setup(make_coordinator, stride=4, prefix_cache_tokens=12 * TOKENS)
    first = hashes(c, *"abcdefgh")
    second = hashes(c, *"ijklmnop")
    await c.prefix.record("i0", first)
    await c.prefix.record("i0", second)
    # 16 blocks recorded, 12 kept: the first prompt lost its tail entry (4 blocks).
    assert await c.prefix.index_tokens([("i0", 1)]) == {"i0": 12 * TOKENS}
    assert await c.prefix.cached_tokens(first) == {"i0": 4 * TOKENS}
    assert await c.prefix.cached_tokens(second) == {"i0": 8 * TOKENS}
    third = hashes(c, *"qrstuvwx")
    await c.prefix.record("i0", third)  # 8 more: the first is out, the second's tail
    assert await c.prefix.cached_tokens(first) == {}
    assert await c.prefix.cached_tokens(second) == {"i0": 4 * TOKENS}
    assert await c.prefix.cached_tokens(third) == {"i0": 8 * TOKENS}


async def test_a_sampled_record_unlinks_the_index_of_earlier_versions(
    make_coordinator: MakeCoordinator,
) -> None:
    """Earlier versions kept an owners hash and an LRU zset: read by nothing now, they
    go with the node's first sampled record."""
    c = await setup(make_coordinator)
    old_owners, old_lru = c.keys.legacy_prefix_keys()
    await c.redis.hset(old_owners, "ab", "i0|1|7999|1")
    await c.redis.zadd(old_lru, {"i0#0000000001|00000000000007999|1|ab": 0})
    await c.prefix.record("i0", hashes(c, "a"))  # the node's first record is sampled
    assert not await c.redis.exists(old_owners, old_lru)


@pytest.mark.parametrize("backend", ["real"])  # encodings are the real server's own
async def test_the_owners_hash_is_a_hashtable_from_its_first_record(
    make_coordinator: MakeCoordinator,
) -> None:
    # As a listpack, a lookup's HMGET would scan the whole hash once per block.
    c = await setup(make_coordinator)
    await c.prefix.record("i0", hashes(c, "a"))
    assert await c.redis.object("encoding", c.keys.prefix_index()) == "hashtable"
    about = await c.redis.hget(c.keys.prefix_index(), "#about")
    assert len(about) > 64  # longer than hash-max-listpack-value's default
    await c.prefix.record("i1", hashes(c, "b"))
    assert await c.redis.hget(c.keys.prefix_index(), "#about") == about


async def test_an_index_without_its_about_field_gets_it_on_a_sampled_record(
    make_coordinator: MakeCoordinator,
) -> None:
    c = await setup(make_coordinator)
    await c.prefix.record("i0", hashes(c, "a"))
    await c.redis.hdel(c.keys.prefix_index(), "#about")  # as an older version left it
    for _ in range(SAMPLE_EVERY):
        await c.prefix.record("i0", hashes(c, "b"))
    assert len(await c.redis.hget(c.keys.prefix_index(), "#about")) > 64


async def test_reserve_spreads_a_short_hot_prefix_while_an_instance_is_idle(
    make_coordinator: MakeCoordinator,
) -> None:
    """Bounded loads (coordinator/prefix.py idle_fleet_room): i0 holds a hot prefix and
    has one request in flight, i1 and i2 are idle. A short prefix (under 1/32 of a
    cache) goes where the load is; with the rule off, a long one, or nobody idle, it
    stays with its holder."""
    fields = {"prefill_ms_per_token": 0.1, "prefill_overhead_ms": 5.0}
    for pct, short_goes_to in ((125, {"i1", "i2"}), (0, {"i0"})):
        c = await make_coordinator(f"n-bounded-{pct}", prefix_hot_load_pct=pct)
        for i in range(3):
            await c.register_instance(spec(i, **fields))
        await c.refresh()
        busy = await c.reserve(100, 1, exclude=["i1", "i2"])
        for tokens, prompt, expected in ((2000, 4000, short_goes_to), (20_000, 30_000, {"i0"})):
            cached = CachedTokens({"i0": tokens}, hot={"i0"})
            res = await c.reserve(prompt, 1, cached_tokens=cached)
            assert res.instance_id in expected, (pct, tokens)
            # done, not cancelled: a cancel of a prefill predicted to have started
            # (once `busy`'s 15 ms have passed) leaves i0's prefill cursor where it
            # was (lua/_lib.lua rechain_after_cancel), which the last reserve would see
            await c.mark_first_token(res.rid)
            await c.release(res.rid)
        # nobody idle (i0 has 2 in flight, i1 and i2 one each: i0 is over its share, as
        # it was above): the rule does not apply, the credit keeps the request on i0
        others = [await c.reserve(100, 1, exclude=[f"i{j}" for j in range(3) if j != k])
                  for k in (0, 1, 2)]  # fmt: skip
        res = await c.reserve(4000, 1, cached_tokens=CachedTokens({"i0": 2000}, hot={"i0"}))
        assert res.instance_id == "i0"
        for r in (res, *others, busy):
            await c.release(r.rid)


async def mark_recent_starts(c: Coordinator) -> None:
    """A hot-prefix decision on i2, so that `c` marks the instances' `started` counters
    (coordinator/prefix.py RecentStarts): what the fleet starts from here on counts."""
    res = await c.reserve(
        100, 1, exclude=["i0", "i1"], cached_tokens=CachedTokens({"i2": 1}, hot={"i2"})
    )
    assert res.instance_id == "i2"
    await c.release(res.rid)


async def test_reserve_passes_a_holder_the_fleet_crowded_by_for_another_holder(
    make_coordinator: MakeCoordinator,
) -> None:
    """Nobody idle, i0 and i1 hold a hot system prompt equally, and *another node* sent
    i0 over its share lately: the request goes to i1, though i1 is busier now (credit
    dropping alone would change nothing: both hold it). The counts are the fleet's
    (the instances' `started` counters), not this node's: nodes that each bound an
    instance by their own routes all send it their next request. With the rule off,
    to i0."""
    for pct, goes_to in ((125, "i1"), (0, "i0")):
        c = await make_coordinator(f"n-crowded-{pct}", prefix_hot_load_pct=pct)
        other = await make_coordinator(f"n-other-{pct}")
        for i in range(3):
            await c.register_instance(spec(i))
        await c.refresh()
        await mark_recent_starts(c)  # i2: one start
        for _ in range(3):  # the other node's requests, done by now
            await other.release((await other.reserve(100, 1, exclude=["i1", "i2"])).rid)
        held = [await c.reserve(100, 1, exclude=[f"i{j}" for j in range(3) if j != k])
                for k in (0, 1, 1, 2)]  # fmt: skip
        # started since the mark: i0 4, i1 2, i2 2; share floor(1.25 x 9 / 3) = 3
        await c.refresh()
        cached = CachedTokens({"i0": 2000, "i1": 2000}, hot={"i0", "i1"})
        res = await c.reserve(4000, 1, cached_tokens=cached)
        assert res.instance_id == goes_to, pct
        for r in (res, *held):
            await c.release(r.rid)
    # Every instance over its share (all idle, each started one lately): the request
    # is placed all the same, as if no rule applied.
    c = await make_coordinator("n-crowded-all")
    for i in range(3):
        await c.register_instance(spec(i))
    await c.refresh()
    await mark_recent_starts(c)
    for k in (0, 1):
        await c.release(
            (await c.reserve(100, 1, exclude=[f"i{j}" for j in (0, 1, 2) if j != k])).rid
        )
    res = await c.reserve(4000, 1, cached_tokens=cached)
    assert res.instance_id in {"i0", "i1", "i2"}


async def test_crowded_instances_stay_candidates_after_the_others(
    make_coordinator: MakeCoordinator,
) -> None:
    """Crowded instances are passed by, not left out: reserve gets them after the
    others, so when every other candidate got busier than the node saw, its walk on
    Redis's counts still has somewhere to go (left out, a view with one instance
    within its share would force the request on it)."""
    c = await make_coordinator("n-crowded-order")
    for i in range(4):
        await c.register_instance(spec(i))
    await c.refresh()
    shape = RequestShape(4000, 1, CachedTokens({}, crowded={"i0", "i2"}))
    candidates, _, _ = c._candidates(None, frozenset(), shape)
    assert sorted(candidates[:2]) == ["i1", "i3"] and sorted(candidates[2:]) == ["i0", "i2"]
    candidates, _, _ = c._candidates(None, frozenset({"i1", "i3"}), shape)
    assert sorted(candidates) == ["i0", "i2"]


async def test_sampled_records_keep_the_index_within_its_valid_entries_and_a_few(
    make_coordinator: MakeCoordinator,
) -> None:
    """Nothing deletes an entry when it falls out of its instance's capacity; sampled
    records do. This index is smaller than one sample, so each sampled record reads it
    whole: at most the entries of the records since the last sample are invalid."""
    c = await setup(make_coordinator, prefix_cache_tokens=8 * TOKENS)
    most = 0
    for k in range(100):
        await c.prefix.record("i0", hashes(c, f"p{k}"))
        most = max(most, len(await owners(c)))
    assert 8 < most <= 8 + SAMPLE_EVERY  # without reclaiming, 100
    # Validity is the count's, whatever storage holds: the last 8 prompts only.
    assert await c.prefix.cached_tokens(hashes(c, "p99")) == {"i0": TOKENS}
    assert await c.prefix.cached_tokens(hashes(c, "p92")) == {"i0": TOKENS}
    assert await c.prefix.cached_tokens(hashes(c, "p91")) == {}


async def test_a_count_seen_within_a_second_spares_the_lookup_a_read(
    make_coordinator: MakeCoordinator,
) -> None:
    """A node takes a count it read or wrote within COUNT_FRESH_MS as the instance's
    (a floor: counts only grow; its growth unknown yet); it reads the others. Within
    that window another node's records can push an entry out unseen: a credit that
    is late to go."""
    c = await setup(make_coordinator, prefix_cache_tokens=4 * TOKENS)
    other = await make_coordinator(
        "n2", prefix_block_chars=BLOCK, prefix_record_stride=1, prefix_cache_tokens=4 * TOKENS
    )
    await other.refresh()
    reads: list[int] = []
    redis = c.prefix._redis

    class Counting:
        def __getattr__(self, name: str) -> object:
            return getattr(redis, name)

        async def hmget(self, key: str, fields: list[str]) -> object:
            reads.append(len(fields))
            return await redis.hmget(key, fields)

    c.prefix._redis = Counting()
    turn = hashes(c, "a", "b")
    await c.prefix.record("i0", turn)  # this node wrote i0's count just now
    reads.clear()
    assert await c.prefix.cached_tokens(turn) == {"i0": 2 * TOKENS}
    assert reads == [2]  # the blocks; i0's count was fresh
    other.prefix._records = 1  # its next record is not a sampled one (which would delete them)
    await other.prefix.record("i0", hashes(c, "x", "y", "z", "w"))  # pushes "a", "b" out
    reads.clear()
    assert await c.prefix.cached_tokens(turn) == {"i0": 2 * TOKENS}  # not seen yet
    assert reads == [2]
    for seen in c.prefix.seen._seen.values():  # as if a second had passed
        seen.at -= COUNT_FRESH_MS + 1
        seen.base_at -= COUNT_FRESH_MS + 1
    reads.clear()
    assert await c.prefix.cached_tokens(turn) == {}
    assert reads == [2, 1]  # the blocks, then i0's count


async def test_garbage_in_the_index_costs_credit_never_a_request(
    make_coordinator: MakeCoordinator,
) -> None:
    """Whatever a hand edit or another program left in the hash (bytes that are not
    UTF-8 included), a lookup answers and a record writes over it."""
    c = await setup(make_coordinator)
    turn = hashes(c, "a", "b")
    await c.redis.hset(
        c.keys.prefix_index(),
        mapping={
            turn[0]: "i0#1|x i1#1|2 junk",
            turn[1]: b"\xff\xfe|1",
            "i0#1": "several",
            "i1#1": "many",
            "#about": "x",
        },
    )
    assert await c.prefix.cached_tokens(turn) == {}  # no count is a number
    await c.prefix.record("i0", turn)  # i0's count starts again
    assert await c.prefix.cached_tokens(turn) == {"i0": 2 * TOKENS}
    assert (await counts(c))["i0#1"] == "2"
    assert await untimed(c) == {turn[0]: "i0#1|2+", turn[1]: "i0#1|1"}  # entries only


async def test_a_call_carries_a_bounded_number_of_block_entries() -> None:
    """Records go RECORD_STEP at a time and RECORD_PAIRS entries in all, but one record
    of any size still goes, and none is lost or reordered."""
    held = HeldRecords()
    sizes = [1, RECORD_PAIRS, 3, 2 * RECORD_STEP, *[1] * (2 * RECORD_STEP)]
    for size in sizes:
        held.hold("i0#1", 8, ["ab", 1] * size)
    calls = []
    while held:
        calls.append([record.args[2] for record in held.take()])
    assert calls == [
        [1],
        [RECORD_PAIRS],
        [3, 2 * RECORD_STEP, *[1] * (RECORD_STEP - 2)],
        [1] * RECORD_STEP,
        [1] * 2,
    ]
    assert [size for call in calls for size in call] == sizes


async def test_a_reserve_whose_reply_is_lost_counts_its_record_as_not_recorded(
    make_coordinator: MakeCoordinator,
) -> None:
    """The record rode on a reserve that ran in Redis, but the reply never came: the
    record's holder returns (nothing hangs, nothing is noted), the node degrades and
    recovers as after any lost reply, and the next records ride along again."""
    c = await setup(make_coordinator, carry_ms=1000)
    first = await c.reserve(100, 10)
    blocks = hashes(c, "a", "b")
    recording = asyncio.create_task(c.prefix.record(first.instance_id, blocks))
    await asyncio.sleep(0)  # the record is held
    lose_next_reply(c, "reserve")
    assert (await c.reserve(100, 10)).degraded
    await recording  # returned: not known to be recorded
    epoch = await c.redis.hget(c.keys.column("epoch"), first.instance_id)
    stem = f"{first.instance_id}#{epoch}"
    assert c.prefix.seen.fresh(stem, 10**6, time.monotonic() * 1000) is None, "nothing noted"
    assert not c._records
    await recovered(c)
    again = asyncio.create_task(c.prefix.record(first.instance_id, hashes(c, "c")))
    await asyncio.sleep(0)
    await c.reserve(100, 10)
    await again
    # The lost call had recorded its 2 blocks all the same: the count says so.
    assert c.prefix.seen.fresh(stem, 10**6, time.monotonic() * 1000) == 3
