"""The shared continuous-batching timing model, driven with explicit times (no wall clock)."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from local_fleet.engine_model import EngineEvent, EngineModel, EngineTiming, PrefixCache

# Binary-exact numbers, so event times compare exactly.
T = EngineTiming(
    prefill_ms_per_token=0.5,
    prefill_overhead_ms=10.0,
    decode_base_ms=20.0,
    decode_ms_per_seq=2.0,
    max_batch=2,
)


def drain(model: EngineModel, limit: int = 10_000) -> list[EngineEvent]:
    """Advance iteration by iteration until idle (bounded)."""
    events: list[EngineEvent] = []
    for _ in range(limit):
        due = model.next_event_ms()
        if due is None:
            return events
        events.extend(model.advance(due))
    raise AssertionError("model did not drain")


def times(events: list[EngineEvent], rid: str, kind: str) -> list[float]:
    return [e.at_ms for e in events if e.rid == rid and e.kind == kind]


def test_single_request_first_token_after_prefill() -> None:
    model = EngineModel(T)
    model.submit("a", 100, 3, now_ms=1000.0)
    assert model.next_event_ms() == 1000.0 + 10.0 + 0.5 * 100
    assert model.advance(1059.9) == []
    events = model.advance(1060.0)
    assert events == [EngineEvent("first_token", "a", 1060.0, 1)]
    rest = drain(model)
    # Two decode steps at batch size 1 (20 + 2 * 1 ms each).
    assert [(e.kind, e.at_ms, e.generated) for e in rest] == [
        ("token", 1082.0, 2),
        ("token", 1104.0, 3),
        ("done", 1104.0, 3),
    ]
    assert model.next_event_ms() is None
    assert model.num_running == 0 and model.num_waiting == 0


def test_prefill_is_serialized() -> None:
    model = EngineModel(T)
    model.submit("a", 100, 5, now_ms=0.0)
    model.submit("b", 40, 5, now_ms=0.0)
    events = drain(model)
    first_a = times(events, "a", "first_token")[0]
    first_b = times(events, "b", "first_token")[0]
    assert first_a == 60.0
    # b's prefill starts only when a's ends, and goes before any decode step.
    assert first_b == first_a + T.prefill_ms(40) == 90.0


def test_decode_step_grows_with_batch() -> None:
    alone = EngineModel(T)
    alone.submit("a", 0, 3, now_ms=0.0)
    solo = times(drain(alone), "a", "token")
    pair = EngineModel(T)
    pair.submit("a", 0, 3, now_ms=0.0)
    pair.submit("b", 0, 3, now_ms=0.0)
    both = drain(pair)
    duo = times(both, "a", "token")
    assert solo[1] - solo[0] == T.step_ms(1) == 22.0
    assert duo[1] - duo[0] == T.step_ms(2) == 24.0
    # Every running sequence gets one token per step.
    assert times(both, "a", "token") == times(both, "b", "token")


def test_fcfs_order() -> None:
    model = EngineModel(EngineTiming(0.5, 10.0, 20.0, 2.0, max_batch=8))
    for i, prompt in enumerate((400, 10, 200, 10)):
        model.submit(f"r{i}", prompt, 2, now_ms=float(i))
    events = drain(model)
    firsts = [e.rid for e in events if e.kind == "first_token"]
    assert firsts == ["r0", "r1", "r2", "r3"]


def test_max_batch_is_respected() -> None:
    model = EngineModel(T)  # max_batch 2
    for rid in ("a", "b", "c"):
        model.submit(rid, 0, 3, now_ms=0.0)
    assert (model.num_running, model.num_waiting) == (1, 2)  # a is being prefilled
    model.advance(10.0)  # a's prefill
    model.advance(20.0)  # b's prefill
    assert (model.num_running, model.num_waiting) == (2, 1)
    events = drain(model)
    done_first = min(times(events, "a", "done") + times(events, "b", "done"))
    # c is prefilled only after a slot frees up.
    assert times(events, "c", "first_token")[0] == done_first + T.prefill_ms(0)
    running_max = 0
    probe = EngineModel(T)
    for rid in ("a", "b", "c", "d"):
        probe.submit(rid, 0, 4, now_ms=0.0)
    while (due := probe.next_event_ms()) is not None:
        probe.advance(due)
        running_max = max(running_max, probe.num_running)
    assert running_max == T.max_batch


@pytest.mark.parametrize("n", [1, 2, 7, 33])
def test_output_has_exactly_n_tokens(n: int) -> None:
    model = EngineModel(T)
    model.submit("a", 10, n, now_ms=0.0)
    model.submit("b", 10, 3, now_ms=0.0)
    events = drain(model)
    tokens = [e for e in events if e.rid == "a" and e.kind in ("first_token", "token")]
    assert [e.generated for e in tokens] == list(range(1, n + 1))
    assert [(e.kind, e.generated) for e in events if e.rid == "a" and e.kind == "done"] == [
        ("done", n)
    ]


arrivals = st.lists(
    st.tuples(
        st.integers(0, 200),  # arrival gap, ms
        st.integers(0, 500),  # prompt tokens
        st.integers(1, 20),  # output tokens
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=60, deadline=None)
@given(arrivals=arrivals, cut=st.integers(0, 40))
def test_remaining_work_equals_drain_time(arrivals: list[tuple[int, int, int]], cut: int) -> None:
    model = EngineModel(T)
    now = 0.0
    for i, (gap, prompt, out) in enumerate(arrivals):
        now += gap
        model.advance(now)
        model.submit(f"r{i}", prompt, out, now_ms=now)
    # Stop exactly at an iteration boundary, `cut + 1` iterations in: remaining work is
    # counted from the model's last iteration end, not from an arbitrary `now`.
    at = now
    for _ in range(cut + 1):
        due = model.next_event_ms()
        if due is None:
            break
        model.advance(due)
        at = due
    remaining = model.remaining_work_ms()
    events = drain(model)
    end = max((e.at_ms for e in events), default=at)
    assert remaining == pytest.approx(end - at)


def test_cancel_waiting_and_running() -> None:
    model = EngineModel(T)
    for rid in ("a", "b", "c"):
        model.submit(rid, 0, 5, now_ms=0.0)
    assert model.cancel("c") is True  # waiting (a is being prefilled, b waits)
    assert (model.num_running, model.num_waiting) == (1, 1)
    model.advance(20.0)  # a and b prefilled
    assert model.num_running == 2
    assert model.cancel("a") is True  # running
    assert model.num_running == 1
    assert model.cancel("a") is False
    assert model.cancel("nope") is False
    events = drain(model)
    assert {e.rid for e in events} == {"b"}
    assert times(events, "b", "done")


def test_cancel_during_prefill() -> None:
    model = EngineModel(T)
    model.submit("a", 100, 5, now_ms=0.0)
    model.submit("b", 10, 2, now_ms=0.0)
    assert model.cancel("a") is True
    events = drain(model)
    assert {e.rid for e in events} == {"b"}
    # The cancelled prefill still occupied the engine for its whole duration.
    assert times(events, "b", "first_token")[0] == T.prefill_ms(100) + T.prefill_ms(10)


def test_remaining_work_counts_from_now() -> None:
    model = EngineModel(T)
    model.submit("a", 100, 1, now_ms=0.0)
    total = T.prefill_ms(100)
    assert model.remaining_work_ms(now_ms=0.0) == total
    model.advance(total / 2)
    assert model.remaining_work_ms(now_ms=total / 2) == total / 2
    assert model.remaining_work_ms() == total


def test_scaled_divides_every_duration() -> None:
    fast = T.scaled(4.0)
    assert fast.prefill_ms_per_token == T.prefill_ms_per_token / 4
    assert fast.prefill_overhead_ms == T.prefill_overhead_ms / 4
    assert fast.decode_base_ms == T.decode_base_ms / 4
    assert fast.decode_ms_per_seq == T.decode_ms_per_seq / 4
    assert fast.max_batch == T.max_batch

    def trace(timing: EngineTiming) -> list[tuple[str, str, float]]:
        model = EngineModel(timing)
        model.submit("a", 100, 4, now_ms=0.0)
        model.submit("b", 30, 3, now_ms=0.0)
        return [(e.kind, e.rid, e.at_ms) for e in drain(model)]

    slow_trace = trace(T)
    assert trace(fast) == [(k, r, at / 4) for k, r, at in slow_trace]
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError):
            T.scaled(bad)


@pytest.mark.parametrize(
    "overrides",
    [
        {"prefill_ms_per_token": -0.1},
        {"prefill_overhead_ms": -1.0},
        {"decode_ms_per_seq": -0.5},
        {"decode_base_ms": 0.0},
        {"max_batch": 0},
    ],
)
def test_invalid_timing_raises(overrides: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        EngineTiming(**overrides)  # type: ignore[arg-type]


def test_invalid_submit_raises() -> None:
    model = EngineModel(T)
    with pytest.raises(ValueError):
        model.submit("a", -1, 3, now_ms=0.0)
    with pytest.raises(ValueError):
        model.submit("a", 10, 0, now_ms=0.0)
    assert model.num_waiting == 0 and model.next_event_ms() is None


def test_idle_engine_starts_at_arrival_time() -> None:
    model = EngineModel(T)
    model.submit("a", 0, 1, now_ms=0.0)
    assert drain(model)[-1] == EngineEvent("done", "a", 10.0, 1)
    model.advance(500.0)
    model.submit("b", 0, 1, now_ms=500.0)
    assert model.next_event_ms() == 510.0
    per_rid: dict[str, int] = defaultdict(int)
    for e in drain(model):
        per_rid[e.rid] += 1
    assert per_rid == {"b": 2}  # first_token + done


def first_token_ms(model: EngineModel, rid: str) -> float:
    return next(e.at_ms for e in drain(model) if e.kind == "first_token" and e.rid == rid)


def test_prefix_cache_prefill_computes_only_uncached_tokens() -> None:
    model = EngineModel(T, PrefixCache(capacity_tokens=1000, block_tokens=100))
    model.submit("a", 400, 1, 0.0, blocks=("b1", "b2", "b3", "b4"))
    assert first_token_ms(model, "a") == 10.0 + 0.5 * 400  # cold: all 400 tokens
    # Shares the first two blocks: 200 tokens cached, 300 computed.
    model.submit("b", 500, 1, 1000.0, blocks=("b1", "b2", "x3", "x4", "x5"))
    assert first_token_ms(model, "b") == 1000.0 + 10.0 + 0.5 * 300
    # A fully cached prompt still computes one token, as vLLM does.
    model.submit("c", 400, 1, 2000.0, blocks=("b1", "b2", "b3", "b4"))
    assert first_token_ms(model, "c") == 2000.0 + 10.0 + 0.5 * 1
    cache = model.prefix_cache
    assert cache is not None and (cache.queries, cache.hits) == (1300, 200 + 399)


def test_prefix_cache_is_lru_in_blocks_and_evicts_tails_first() -> None:
    cache = PrefixCache(capacity_tokens=300, block_tokens=100)
    cache.insert(("a1", "a2"))
    cache.insert(("b1", "b2"))  # 4 blocks > 3: a's tail goes, its head stays
    assert len(cache) == 3
    assert cache.lookup(("a1", "a2"), 1000) == 100
    assert cache.lookup(("b1", "b2"), 1000) == 200
    # A prefix whose head is missing is not a hit, whatever follows.
    assert cache.lookup(("zz", "b2"), 1000) == 0
    none = PrefixCache(capacity_tokens=0, block_tokens=100)
    none.insert(("a1",))
    assert len(none) == 0 and none.lookup(("a1",), 500) == 0


def test_without_a_cache_blocks_change_nothing() -> None:
    model = EngineModel(T)
    model.submit("a", 400, 1, 0.0, blocks=("b1",))
    model.submit("b", 400, 1, 0.0, blocks=("b1",))
    assert first_token_ms(model, "b") == 2 * (10.0 + 0.5 * 400)
