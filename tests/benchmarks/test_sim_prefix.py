"""The simulator's prefix side: its index model against the real index on a server,
the baselines' choices, and prefix-aware replays."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from bench.prefix_report import popular_prefix
from bench.sim.prefix_policies import (
    HashRing,
    SglangThresholds,
    SharedPrefixIndex,
    dynamo_choice,
    sglang_choice,
)
from bench.sim.simulator import PREFIX_STRATEGIES, SimConfig, simulate
from bench.sim.traces import TraceRequest, parse_trace, scale_to_utilization
from coordinator.prefix import CachedTokens
from tests.conftest import MakeCoordinator
from tests.helpers import spec

BLOCK = 64  # characters per block on the real side
CAPACITY_BLOCKS = 6  # small: eviction happens, and below 8 the script evicts at once


def prompts(seed: int, count: int) -> list[tuple[int, ...]]:
    """Prompts as block ids, sharing prefixes like conversations: an id names the
    whole prefix up to its block (as Mooncake's hash_ids and chained hashes do)."""
    rng = random.Random(seed)
    ids: dict[tuple[int, ...], int] = {}
    out: list[tuple[int, ...]] = []
    for _ in range(count):
        base = list(rng.choice(out)) if out and rng.random() < 0.7 else []
        base = base[: rng.randint(0, len(base))] + [rng.randrange(1000)] * rng.randint(1, 3)
        path: list[int] = []
        for j in range(len(base)):
            path.append(ids.setdefault((*base[: j + 1],), len(ids)))
        out.append(tuple(path))
    return out


@pytest.mark.parametrize("stride", [1, 3])
async def test_the_sim_index_agrees_with_the_real_one(
    make_coordinator: MakeCoordinator, stride: int
) -> None:
    tokens = BLOCK // 4
    c = await make_coordinator(
        f"n-sim-{stride}",
        prefix_block_chars=BLOCK,
        prefix_max_owners=2,
        prefix_max_blocks=512,
        prefix_record_stride=stride,
    )
    for i in range(3):
        await c.register_instance(spec(i, prefix_cache_tokens=CAPACITY_BLOCKS * tokens))
    await c.refresh()
    sim = SharedPrefixIndex(CAPACITY_BLOCKS, max_owners=2, stride=stride)
    rng = random.Random(7)

    def text(blocks: tuple[int, ...]) -> str:
        return "".join(f"<{b:06d}>".ljust(BLOCK, ".") for b in blocks)

    for blocks in prompts(3, 60):
        hashes = c.prefix.hashes({"prompt": text(blocks)})
        found = await c.prefix.cached_tokens(hashes)
        real = {k: v // tokens for k, v in found.items()}
        expected = sim.cached_blocks(blocks)
        assert real == expected, blocks
        # This node routed nothing: its hot credits are those inside a recorded prompt.
        assert isinstance(found, CachedTokens) and found.hot == set(expected.continued), blocks
        chosen = f"i{rng.randrange(3)}"
        held = real.get(chosen, 0)
        await c.prefix.record(chosen, hashes, held * tokens)
        sim.record(chosen, blocks, held)
    assert any(sim.size(f"i{i}") == CAPACITY_BLOCKS for i in range(3))  # evictions ran
    held = await c.prefix.index_tokens([(f"i{i}", 1) for i in range(3)])
    assert held == {f"i{i}": sim.size(f"i{i}") * tokens for i in range(3)}


def test_consistent_hashing_keeps_a_first_block_on_one_instance() -> None:
    ring = HashRing([f"i{k}" for k in range(8)])
    assert len({ring.owner(42) for _ in range(5)}) == 1
    assert len({ring.owner(b) for b in range(200)}) == 8  # and spreads different ones


def test_sglang_choice_follows_the_cache_until_the_load_is_imbalanced() -> None:
    ids = ["a", "b", "c"]
    t = SglangThresholds(cache_threshold=0.5, balance_abs_threshold=4, balance_rel_threshold=1.5)
    # Balanced, a long match on b: b.
    assert sglang_choice(ids, [3, 4, 3], {"b": 900}, 1000, [10, 10, 10], t) == 1
    # A match below the threshold: the instance with the smallest index.
    assert sglang_choice(ids, [3, 4, 3], {"b": 100}, 1000, [10, 10, 5], t) == 2
    # Imbalanced (10 - 1 > 4 and 10 > 1.5 x 1): the least loaded, whatever it holds.
    assert sglang_choice(ids, [1, 10, 3], {"b": 900}, 1000, [10, 10, 10], t) == 0


def test_dynamo_choice_trades_overlap_against_active_blocks() -> None:
    # a holds the prompt (8 of 10 blocks cached) but runs 12 blocks of decode;
    # b holds nothing and runs 1: cost a = 1*(0+2)+12 = 14, b = 1*(0+10)+1 = 11.
    assert dynamo_choice([0, 0], [2 * 512, 10 * 512], [12 * 512, 512], 512) == 1
    # A heavier overlap weight prefers the cache: a = 4*2+12 = 20, b = 4*10+1 = 41.
    assert dynamo_choice([0, 0], [2 * 512, 10 * 512], [12 * 512, 512], 512, 4.0) == 0


def mooncake_like(count: int = 300) -> list[TraceRequest]:
    rows = []
    for i, blocks in enumerate(prompts(11, count)):
        rows.append(
            f'{{"timestamp": {i * 150}, "input_length": {len(blocks) * 512}, '
            f'"output_length": {20 + i % 50}, "hash_ids": {list(blocks)}}}'
        )
    return parse_trace("\n".join(rows))


def test_prefix_replays_are_deterministic_and_affinity_hits_more() -> None:
    requests = mooncake_like()
    config = SimConfig(instances=4, nodes=3, prefix_cache_tokens=200_000)
    results = {s: simulate(requests, s, config) for s in ("least_load", *PREFIX_STRATEGIES)}
    again = simulate(requests, "least_load_affinity", config)
    assert again.ttft_ms == results["least_load_affinity"].ttft_ms
    for r in results.values():
        assert r.completed == len(requests) and 0.0 <= r.prefix_hit_rate <= 1.0
    # Routing by the cache finds more of it than routing blind to it.
    assert results["least_load_affinity"].prefix_hit_rate > results["least_load"].prefix_hit_rate
    assert results["consistent_hash"].prefix_hit_rate > results["least_load"].prefix_hit_rate
    # Without an engine cache nothing is queried: the hit rate is undefined.
    assert math.isnan(simulate(requests, "least_load", SimConfig(instances=4)).prefix_hit_rate)


def test_a_popular_prefix_spreads_while_hot_and_piles_up_without_the_hot_guard() -> None:
    """The credit a conversation's turn keeps against a busy holder (prefill_ms, the
    long guard) would pile a popular prefix onto its first holder; the short guard of
    a hot prefix spreads it over the fleet: its short backlog distance, and the
    bounded-loads rule (no holder over 125% of its share of a node's recent requests),
    which leaves at most one of 8 instances without the prefix (7 holders take 8/7 of
    the mean each, within 125%). Fresh views (NodeView): the guard is judged on the
    backlogs as they are."""
    config = SimConfig(
        instances=8,
        nodes=3,
        prefix_cache_tokens=400_000,
        snapshot_max_age_ms=0,
        live_refresh_ms=0,
    )
    requests = scale_to_utilization(popular_prefix(count=600, shared=80), config.timing, 8, 0.8)
    spread = simulate(requests, "least_load_affinity", config)
    assert sorted(spread.assigned)[1] > 0 and spread.imbalance < 1.3
    piled = simulate(requests, "least_load_affinity", replace(config, prefix_hot_ms=0))
    assert sorted(piled.assigned)[-2] == 0  # one instance served everything


def test_ttft_floors_count_what_no_earlier_request_or_the_pooled_cache_had() -> None:
    from bench.prefix_report import ttft_floors
    from local_fleet.stats import percentile

    a = TraceRequest(0, 0.0, 1024, 1, (1, 2))
    b = TraceRequest(1, 1.0, 3072, 1, (1, 2, 3, 4, 5, 6))
    config = SimConfig(instances=1, prefix_cache_tokens=512)  # the pool holds one block
    prefill = config.timing.prefill_ms
    never, pooled = ttft_floors([a, b], config)
    assert never == percentile([prefill(1024), prefill(2048)], 99)  # b had a's 2 blocks
    assert pooled == percentile([prefill(1024), prefill(2560)], 99)  # of which 1 pooled


def test_hash_ids_are_read_from_jsonl_traces() -> None:
    trace = parse_trace(
        '{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]}\n'
        '{"timestamp": 5, "input_length": 10, "output_length": 5}'
    )
    assert [r.blocks for r in trace] == [(1, 2), ()]


def test_perturbed_arrivals_move_each_request_later_by_at_most_the_jitter() -> None:
    from bench.prefix_report import perturbed_arrivals

    requests = [TraceRequest(i, 10.0 * i, 512, 1, (i,)) for i in range(200)]
    moved = perturbed_arrivals(requests, 3.0, seed=1)
    shifts = [m.arrival_ms - r.arrival_ms for m, r in zip(moved, requests, strict=True)]
    assert all(0.0 <= s <= 3.0 for s in shifts) and max(shifts) > 2.5 and min(shifts) < 0.5
    assert [m.index for m in moved] == [r.index for r in requests]
    assert perturbed_arrivals(requests, 3.0, seed=1) == moved  # one seed, one replay
    assert perturbed_arrivals(requests, 3.0, seed=2) != moved


def test_perturbed_sims_of_a_live_slice_are_one_replay_per_seed() -> None:
    from bench.live import LiveConfig
    from bench.prefix_report import perturbed_sims

    requests = scale_to_utilization(
        [TraceRequest(i, 40.0 * i, 2048, 20, (i % 7, 100 + i)) for i in range(120)],
        SimConfig().timing,
        4,
        0.8,
    )
    config = LiveConfig(instances=4, nodes=2, speed=1.0, prefix_cache_tokens=100_000)
    sims = perturbed_sims(requests, config, replays=3)
    assert [s.requests for s in sims] == [120, 120, 120]
    assert all(s.strategy == "least_load_affinity" and s.prefix_hit_rate > 0 for s in sims)
    again = perturbed_sims(requests, config, replays=3)
    assert [s.ttft_p50_ms for s in again] == [s.ttft_p50_ms for s in sims]
