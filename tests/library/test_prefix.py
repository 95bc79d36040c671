"""Prefix block hashing (coordinator/prefix.py): chain, salt, canonical prompts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator.errors import InvalidArgumentError
from coordinator.prefix import (
    POPULAR_COUNT,
    CachedTokens,
    HotPrefixes,
    PromptBlocks,
    RecentStarts,
    Room,
    block_hashes,
    canonical_prompt,
    cheap_copy_tokens,
    guarded_cached_tokens,
    hot_capacity,
    hot_instances,
    hot_room,
    idle_fleet_room,
    salt_key,
)
from coordinator.prefix_entries import HeldBlocks
from coordinator.settings import Settings

KEY = salt_key("pool", "")


@given(st.text(min_size=0, max_size=200), st.text(min_size=0, max_size=200))
def test_equal_hashes_exactly_up_to_the_first_differing_block(a: str, b: str) -> None:
    ha, hb = block_hashes(a, KEY, 8, 64), block_hashes(b, KEY, 8, 64)
    for i in range(min(len(ha), len(hb))):
        same_prefix = a[: 8 * (i + 1)] == b[: 8 * (i + 1)]
        assert (ha[i] == hb[i]) == same_prefix


def test_only_whole_blocks_are_hashed_and_capped() -> None:
    assert len(block_hashes("x" * 23, KEY, 8, 64)) == 2
    assert len(block_hashes("x" * 800, KEY, 8, 5)) == 5
    assert block_hashes("short", KEY, 8, 64) == []


def test_a_block_hash_depends_on_everything_before_it() -> None:
    # The same second block behind a different first block hashes differently.
    assert (
        block_hashes("AAAAAAAACCCCCCCC", KEY, 8, 4)[1]
        != block_hashes("BBBBBBBBCCCCCCCC", KEY, 8, 4)[1]
    )


def test_salt_separates_pools_and_deployments() -> None:
    text = "y" * 64
    base = block_hashes(text, salt_key("p", ""), 8, 8)
    assert base != block_hashes(text, salt_key("q", ""), 8, 8)
    assert base != block_hashes(text, salt_key("p", "secret"), 8, 8)
    assert base == block_hashes(text, salt_key("p", ""), 8, 8)


def test_hashes_are_hex_digests_that_carry_no_text() -> None:
    text = "the secret plan " * 8
    for h in block_hashes(text, KEY, 16, 64):
        assert len(h) == 16 and int(h, 16) >= 0
        assert "secret" not in h


def test_a_follow_up_turn_extends_the_previous_canonical_prompt() -> None:
    turn1 = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"}]}
    turn2 = {
        "messages": [
            *turn1["messages"],
            {"role": "assistant", "content": [{"type": "text", "text": "a1"}]},
            {"role": "user", "content": "q2"},
        ]
    }
    assert canonical_prompt(turn2).startswith(canonical_prompt(turn1))
    assert canonical_prompt(turn1) == "system\x1fS\x1euser\x1fq1\x1e"
    # Roles are part of the prompt: the same text as another role is another prompt.
    swapped = {"messages": [{"role": "user", "content": "S"}, {"role": "user", "content": "q1"}]}
    assert canonical_prompt(swapped) != canonical_prompt(turn1)


def test_completion_prompts_and_other_bodies() -> None:
    assert canonical_prompt({"prompt": "abc"}) == "abc"
    assert canonical_prompt({"prompt": ["first", "second"]}) == "first"
    assert canonical_prompt({"prompt": 5}) == ""
    assert canonical_prompt({}) == ""


def test_guard_fades_credit_with_backlog_above_the_idlest() -> None:
    backlogs = {"hot": 3000.0, "warm": 1500.0, "idle": 1000.0, "blind": None}.get
    cached = {"hot": 8000, "warm": 8000, "idle": 8000, "blind": 8000}
    # Floor 1000 ms, guard 2000 ms: warm is 500 ms ahead (a quarter faded), hot 2000
    # ms ahead (all faded), an instance without a backlog keeps nothing.
    assert guarded_cached_tokens(cached, backlogs, 1000.0, 2000) == {
        "warm": 6000,
        "idle": 8000,
    }
    assert guarded_cached_tokens(cached, backlogs, 1000.0, 0) == cached


def test_a_hot_prefix_fades_over_the_hot_distance_a_cold_one_over_the_guard() -> None:
    """Both holders are 1500 ms busier than the idlest: the popular prefix's credit is
    gone at a 1000 ms hot distance, the conversation's turn keeps 85% at 10 s."""
    backlogs = {"popular": 1500.0, "turn": 1500.0, "idle": 0.0}.get
    cached = CachedTokens({"popular": 8000, "turn": 8000}, hot={"popular"})
    assert guarded_cached_tokens(cached, backlogs, 0.0, 10_000, 1000) == {"turn": 6800}
    # hot_guard_ms 0: hot prefixes fade over the guard distance like the others.
    same = CachedTokens(cached, hot={"popular"})
    assert guarded_cached_tokens(same, backlogs, 0.0, 10_000, 0) == {"popular": 6800, "turn": 6800}
    # A plain mapping has no hot prefixes; guard 0 turns everything off.
    assert guarded_cached_tokens(dict(cached), backlogs, 0.0, 10_000, 1000) == {
        "popular": 6800,
        "turn": 6800,
    }
    assert guarded_cached_tokens(cached, backlogs, 0.0, 0, 1000) == cached
    # It is a dict to everything else.
    assert cached == {"popular": 8000, "turn": 8000} and isinstance(cached, dict)


def test_a_block_inside_a_routed_prompt_is_hot_for_one_to_two_windows() -> None:
    hot = HotPrefixes(1000)
    hot.note(["a", "b"], now_ms=0)  # "a" inside the prompt, "b" its last block
    assert hot.is_hot("a", 999) and not hot.is_hot("b", 999) and not hot.is_hot("c", 999)
    hot.note(["c", "d"], now_ms=1000)  # a new generation: a is in the previous one
    assert hot.is_hot("a", 1999) and hot.is_hot("c", 1999)
    assert not hot.is_hot("a", 2000)  # two generations on: a is forgotten
    assert hot.is_hot("c", 2000)
    assert not hot.is_hot("c", 4000)  # idle for two windows: nothing is hot
    off = HotPrefixes(0)
    off.note(["a", "b"], 0)
    assert not off.is_hot("a", 0)


def test_a_last_block_is_hot_for_another_prompt_not_for_the_next_turn() -> None:
    """A conversation's next turn repeats the previous prompt, tail included: its
    holder's credit is not hot, however often the turns go through this node. Another
    prompt through the same last block (a shared system prompt, then a different
    question) is."""
    hot = HotPrefixes(10_000)
    turn = "user: how do I ...?"
    hot.note(["sys", "end"], 0, tail=turn)
    assert not hot.is_hot("end", 1, after=turn + " assistant: like so. user: and then?")
    assert not hot.is_hot("end", 1, after=None)  # no text: continues (the simulator)
    assert hot.is_hot("end", 1, after="user: something else entirely")
    assert hot.is_hot("end", 1, after=turn[:5])  # shorter than what followed: another prompt
    hot.note(["sys", "end"], 2, tail=turn + " assistant: like so.")  # the next turn
    assert not hot.is_hot("end", 3, after=turn + " assistant: like so. user: more")
    hot.note(["sys", "end"], 4, tail="user: another question")  # another prompt
    assert hot.is_hot("end", 5, after=turn)  # two prompts: hot for everyone
    untold = HotPrefixes(10_000)
    for t in range(3):
        untold.note(["x"], t)  # no tails: each continues the last
    assert not untold.is_hot("x", 3)


def test_recent_starts_count_what_the_fleet_started_since_the_older_mark() -> None:
    starts = RecentStarts(1000)
    assert starts.counts({"i0": 5, "i1": 9}, 0) == {}  # the first mark: nothing yet
    assert starts.counts({"i0": 7, "i1": 9}, 500) == {"i0": 2.0}
    # a new generation: still counted from the mark at 0
    assert starts.counts({"i0": 8, "i1": 10, "i2": 1}, 1000) == {"i0": 3.0, "i1": 1.0, "i2": 1.0}
    # from the mark at 1000 on; a counter that went down (a slot taken again, or a
    # wrap at STARTED_WRAP) counts from 0
    assert starts.counts({"i0": 8, "i1": 1, "i2": 1}, 2000) == {"i1": 1.0}
    assert starts.counts({"i0": 9, "i1": 1, "i2": 1}, 5000) == {}  # marks too old: anew
    assert RecentStarts(0).counts({"i0": 9}, 0) == {}  # off


def test_the_hot_set_is_bounded() -> None:
    hot = HotPrefixes(10_000, max_size=4)
    hot.note([0, 1, 2, 3, 99], 0)  # full: the next note starts a new generation
    hot.note([10, 98], 1)
    hot.note([11, 12, 13, 97], 2)
    hot.note([14, 96], 3)
    assert not hot.is_hot(0, 3) and hot.is_hot(10, 3) and hot.is_hot(14, 3)


def test_hot_capacity_is_the_bounded_loads_share() -> None:
    assert hot_capacity(0, 8, 125) == 1  # at least one
    assert hot_capacity(63, 8, 125) == 10  # 1.25 x 64 / 8
    assert hot_capacity(10, 8, 125) == 1  # rounded down: 1.72
    assert hot_capacity(10, 8, 0) is None and hot_capacity(10, 0, 125) is None
    assert cheap_copy_tokens(400_000) == 12_500  # 1/32 of the default cache


def test_a_hot_prefix_loses_its_credit_on_an_instance_over_its_share() -> None:
    cached = CachedTokens({"busy": 8000, "spare": 8000, "turn": 8000}, hot={"busy", "spare"})
    inflight = {"busy": 1.0, "spare": 0.0, "turn": 5.0}
    routed = {"busy": 3.0, "spare": 1.0, "turn": 9.0}
    # capacities: in flight floor(1.25 x 7 / 3) = 2, routed floor(1.25 x 14 / 3) = 5
    room = hot_room([(inflight, 6.0), (routed, 13.0)], 3, 125)
    assert room is not None and room("busy") and room("spare") and not room("turn")
    room = hot_room([(inflight, 1.0), (routed, 1.0)], 3, 125)  # capacities 1, 1
    assert room is not None and not room("busy") and not room("spare")
    assert hot_room([(inflight, 1.0)], 3, 0) is None  # off
    spare_only = lambda i: i == "spare"  # noqa: E731
    out = guarded_cached_tokens(cached, lambda _: 0.0, 0.0, 10_000, 3000, spare_only, 8000)
    assert out == {"spare": 8000, "turn": 8000}  # turn is not hot: no share applies
    assert guarded_cached_tokens(cached, lambda _: 0.0, 0.0, 10_000, 3000, None, 8000) == cached
    # A long prefix (over the cheap copy) keeps its credit unless it is popular.
    assert guarded_cached_tokens(cached, lambda _: 0.0, 0.0, 10_000, 3000, spare_only, 7999) == (
        cached
    )
    popular = CachedTokens(cached, hot=cached.hot, popular={"busy"})
    out = guarded_cached_tokens(popular, lambda _: 0.0, 0.0, 10_000, 3000, spare_only, 7999)
    assert out == {"spare": 8000, "turn": 8000}


def test_hot_instances_look_at_each_deepest_credited_block() -> None:
    hot = HotPrefixes(1000)
    blocks = ["h1", "h2", "h3"]
    hot.note(["h2", "other"], 0)  # h2 inside a prompt
    assert hot_instances({"a": 2, "b": 3, "c": 0}, blocks, hot, 10, 10) == ({"a"}, set())
    for t in range(1, 4):
        hot.note(["h2", f"other{t}"], t)  # inside 4 prompts: popular
    assert hot_instances({"a": 2, "b": 3}, blocks, hot, 10, 10) == ({"a"}, {"a"})
    assert hot.popularity("h2", 10) == POPULAR_COUNT


def test_a_credit_inside_a_prompt_another_node_routed_lately_is_hot() -> None:
    # "a" is credited inside a prompt recorded at Redis second 100 (a '+100' entry),
    # "b" at a prompt's end; this node routed neither, so only the index's time tells.
    held = HeldBlocks({"a": 2, "b": 2}, continued={"a": 100})
    blocks = ["h1", "h2"]
    assert hot_instances(held, blocks, HotPrefixes(2000), 0, 101_500) == ({"a"}, set())
    # the window from the latest the entry may have been written (second 100 ends at
    # 101,000 ms): hot up to 2,000 ms past that
    assert hot_instances(held, blocks, HotPrefixes(2000), 0, 103_000) == ({"a"}, set())
    assert hot_instances(held, blocks, HotPrefixes(2000), 0, 103_001) == (set(), set())
    assert hot_instances(held, blocks, HotPrefixes(2000), 0, 160_000) == (set(), set())
    assert hot_instances(held, blocks, HotPrefixes(0), 0, 101_500) == (set(), set())  # off


def test_hot_instances_tell_a_next_turn_from_another_prompt_by_the_text() -> None:
    system = "s" * 32
    first = block_hashes(system + "user: one?", KEY, 16, 8)  # 2 whole blocks, then a tail
    assert isinstance(first, PromptBlocks) and len(first) == 2
    assert first.after(2) == "user: one?" and first.after(1) == system[16:]
    hot = HotPrefixes(10_000)
    hot.note(first, 0, first.after(len(first)))
    turn = block_hashes(system + "user: one? assistant: yes. user: two?", KEY, 16, 8)
    other = block_hashes(system + "user: something else", KEY, 16, 8)
    assert turn[:2] == other[:2] == list(first)
    # the holder of both blocks: the next turn is not hot, another prompt is
    assert hot_instances({"i0": 2}, turn, hot, 1, 1) == (set(), set())
    assert hot_instances({"i0": 2}, other, hot, 1, 1) == ({"i0"}, set())


def test_bounded_loads_count_the_pool_in_flight_only_while_an_instance_is_idle() -> None:
    routes = {"i0": 3.0, "i1": 1.0}  # requests the fleet sent each lately
    busy = {"i0": 1.0, "i1": 1.0, "i2": 2.0}
    room = idle_fleet_room(busy, routes, 125)
    # none idle: the routes alone, floor(1.25 x 5 / 3) = 2, and no bound in flight
    assert room is not None and not room.idle and room.most_inflight is None
    assert not room("i0") and room("i1") and room("i2")
    idle = {"i0": 1.0, "i1": 0.0, "i2": 0.0}
    room = idle_fleet_room(idle, routes, 125)
    # in flight: capacity floor(1.25 x 2 / 3) -> 1; routed: floor(1.25 x 5 / 3) = 2
    assert room is not None and room.idle and room.most_inflight == 0
    assert not room("i0") and room("i1") and room("i2")
    assert room.crowded() == {"i0"}
    idle["i1"] = 1.0  # i1 now has its share in flight
    assert idle_fleet_room(idle, routes, 125).crowded() == {"i0", "i1"}  # type: ignore[union-attr]
    assert idle_fleet_room(idle, routes, 0) is None  # off


def test_with_every_instance_over_one_share_the_recent_starts_decide() -> None:
    """Two loads can leave no instance within both shares: the only idle instance is
    the one the fleet sent most lately. Then those counts alone say who is crowded,
    so the request still goes to an instance within its share of them, not to the
    idle one."""
    routes = {"i0": 3.0, "i1": 3.0}
    inflight = {"i0": 0.0, "i1": 1.0, "i2": 1.0, "i3": 1.0}
    room = idle_fleet_room(inflight, routes, 125)
    # in flight: floor(1.25 x 4 / 4) = 1 (only i0 has room); routed: floor(1.25 x 7 / 4) = 2
    assert room is not None and not any(room(i) for i in inflight)
    assert room.crowded() == {"i0", "i1"}
    # One route each: floor(1.25 x 5 / 4) = 1, every one over on the routes too: the
    # rule cannot choose, and names every instance (the caller then ranks them all).
    even = dict.fromkeys(inflight, 1.0)
    assert idle_fleet_room(inflight, even, 125).crowded() == set(inflight)  # type: ignore[union-attr]


def _room(idle: bool, without: set[str], ids: set[str]) -> Room:
    return Room([({i: 1.0 for i in without}, 1)], 0 if idle else None, ids, idle)


def test_a_hot_prefix_passes_the_instances_over_their_share_by() -> None:
    """Bounded loads pass a crowded instance by, not only its credit: with every holder
    of a shared system prompt equally credited, dropping the credit alone changes
    nothing, and the first-turns of new conversations pile up on one of them."""
    everyone = {"a", "b", "c", "d"}
    cached = CachedTokens({"a": 2048, "b": 2048, "c": 2048}, hot={"a", "b", "c"})
    guarded = lambda c, room: guarded_cached_tokens(  # noqa: E731
        c, lambda _: 0.0, 0.0, 10_000, 3000, room, 8000
    )
    # Some instance idle: every instance over its share is passed by; the holders that
    # keep their credit get the bound in flight reserve enforces on Redis's counts.
    out = guarded(cached, _room(True, {"a", "d"}, everyone))
    assert out == {"b": 2048, "c": 2048}
    assert out.crowded == {"a", "d"} and out.most_inflight == {"b": 0, "c": 0}
    # None idle: only holders over their share, while another holder has room.
    out = guarded(cached, _room(False, {"a", "d"}, everyone))
    assert out == cached and out.crowded == {"a"} and out.most_inflight == {}
    assert guarded(cached, _room(False, {"a", "b", "c"}, everyone)).crowded == set()
    # A deeper credit that is not hot is a conversation's own history: nothing passed by.
    turn = CachedTokens({"a": 4096, "b": 2048, "c": 2048}, hot={"b", "c"})
    assert guarded(turn, _room(True, {"a", "d"}, everyone)).crowded == set()
    # A long prefix that is not popular stays with its holders: nothing passed by.
    long = CachedTokens({"a": 9000, "b": 9000}, hot={"a", "b"})
    assert guarded(long, _room(True, {"a"}, everyone)).crowded == set()


def test_the_bounded_loads_share_is_off_or_at_least_the_mean() -> None:
    assert Settings(prefix_hot_load_pct=0).prefix_hot_load_pct == 0
    assert Settings(prefix_hot_load_pct=100).prefix_hot_load_pct == 100
    for bad in (50, 1001, -1):
        with pytest.raises(InvalidArgumentError, match="prefix_hot_load_pct"):
            Settings(prefix_hot_load_pct=bad)
