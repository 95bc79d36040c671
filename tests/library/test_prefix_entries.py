"""The prefix index's format and meaning (coordinator/prefix_entries.py), without Redis."""

from __future__ import annotations

from coordinator.prefix_entries import (
    COUNT_FRESH_MS,
    Entry,
    SeenCounts,
    cached_blocks,
    current_stems,
    parse_entries,
    reclaimed,
    sampled_names,
    valid,
)


def test_entries_parse_ids_with_colons_and_skip_anything_else() -> None:
    assert parse_entries("x:y#3|12 bad z#q|1 w#2|x i-1#0|4+17 v#1|+1 u#1|2+ t#1|2++1") == [
        Entry("x:y", 3, 12),
        Entry("i-1", 0, 4, continued=17),
    ]
    assert [e.text for e in parse_entries("x:y#3|12 i-1#0|4+17")] == ["x:y#3|12", "i-1#0|4+17"]
    assert parse_entries(None) == []


def test_an_entry_is_valid_within_its_instances_last_capacity_blocks() -> None:
    assert valid(10, 10, 4) and valid(7, 10, 4)
    assert not valid(6, 10, 4)  # 4 blocks were recorded after it: out
    assert valid(12, 10, 4)  # newer than the count a node saw: valid
    assert not valid(5, None, 4)  # no count at that epoch
    assert not valid(0, 0, 4)


def test_cached_blocks_credits_the_deepest_valid_entry_at_the_current_epoch() -> None:
    epochs = {"a": 1, "b": 2}.get
    values = ["a#1|9 b#2|9 c#1|9", "a#1|8 b#1|8", None, "a#1|7", "a#1|1"]
    entries = [parse_entries(v) for v in values]
    counts = {"a#1": 10, "b#2": 9, "c#1": 9}
    # c is not registered and b's second block is from an older epoch: b holds 1
    # block. a holds block 4, so the prompt up to its end (chained hashes), although
    # block 3 has no entry; a's entry at block 5 fell out (capacity 4, count 10).
    assert cached_blocks(entries, counts, epochs, lambda _: 4) == {"a": 4, "b": 1}
    assert cached_blocks(entries, counts, epochs, lambda _: 100) == {"a": 5, "b": 1}
    assert cached_blocks([], counts, epochs, lambda _: 4) == {}
    assert cached_blocks(entries, counts, epochs, lambda _: 4).continued == {}
    # Only the counts of owners at their current epoch are asked for.
    assert current_stems(entries, epochs) == ["a#1", "b#2"]


def test_continued_names_the_instances_credited_inside_a_recorded_prompt() -> None:
    """A credit at an entry a prompt went on past ('+<second>') is another prompt
    through a shared prefix; at a prompt's last block, that prompt's next turn."""
    epochs = {"a": 1, "b": 1}.get
    entries = [parse_entries(v) for v in ("a#1|9+5 b#1|9+6", "a#1|8", "b#1|7+7")]
    held = cached_blocks(entries, {"a#1": 10, "b#1": 10}, epochs, lambda _: 100)
    assert held == {"a": 2, "b": 3} and held.continued == {"b": 7}
    # the deepest valid entry decides: b's at block 3 fell out, its first is inside
    held = cached_blocks(entries, {"a#1": 10, "b#1": 12}, epochs, lambda _: 4)
    assert held == {"a": 2, "b": 1} and held.continued == {"b": 6}


def test_reclaim_keeps_valid_entries_and_drops_the_rest() -> None:
    sampled = [
        ("h1", "a#1|9+5 b#1|3"),  # b is at epoch 2 now: its entry goes
        ("h2", "a#1|2"),  # a has moved 8 blocks on: out of its 4
        ("h3", "a#1|8 c#1|5"),  # all valid: untouched
        ("a#1", "10"),
        ("b#1", "7"),  # b's count at an older epoch
        ("u#1", "3"),  # u is not registered
        ("a#", "1"),
        ("#about", "..."),
    ]
    owners, stems = sampled_names(sampled)
    assert sorted(owners) == ["a", "b", "c", "u"]
    assert sorted(stems) == ["a#1", "b#1", "c#1"]
    epochs = {"a": 1, "b": 2, "c": 1, "u": None}
    counts = {"a#1": 10, "b#1": 7, "c#1": 5}
    dels, sets = reclaimed(sampled, epochs, counts, lambda _: 4)
    assert sorted(dels) == ["b#1", "h2", "u#1"]
    assert sets == {"h1": "a#1|9+5"}  # as it was


def test_a_count_seen_stands_for_as_long_as_its_growth_allows() -> None:
    seen = SeenCounts()
    seen.note("a#1", 100, 0.0)
    # growth unknown: COUNT_FRESH_MS
    assert seen.fresh("a#1", 2048, COUNT_FRESH_MS) == 100
    assert seen.fresh("a#1", 2048, COUNT_FRESH_MS + 1) is None
    seen.note("a#1", 164, 2000.0)  # 64 blocks in 2 s
    # 1/32 of 2048 blocks at 0.032 blocks/ms: 2 s
    assert seen.fresh("a#1", 2048, 3999.0) == 164
    assert seen.fresh("a#1", 2048, 4001.0) is None
    assert seen.fresh("a#1", 64 * 2048, 12_000.0) == 164  # a large cache: 10 s at most
    assert seen.fresh("a#1", 64 * 2048, 12_001.0) is None
    seen.note("b#1", 5, 0.0)
    seen.note("b#1", 5, 1000.0)  # idle: it stands for 10 s
    assert seen.fresh("b#1", 1, 11_000.0) == 5
    seen.note("c#1", 0, 0.0)
    seen.note("c#1", 100_000, 1000.0)  # very busy: 0.1 s at least
    assert seen.fresh("c#1", 64, 1100.0) == 100_000
    assert seen.fresh("c#1", 64, 1101.0) is None
    seen.note("c#1", 3, 1200.0)  # below what was seen: the index was emptied
    assert seen.fresh("c#1", 64, 2200.0) == 3  # growth unknown again
    assert seen.fresh("d#1", 64, 0.0) is None
