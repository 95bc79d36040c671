"""Prefix-cache affinity measured against issue 16's targets, in one run.

    python bench/prefix_report.py [--write-docs] [--no-live]

1. Simulated Mooncake (`hash_ids`): least_load without and with affinity, the
   anchor-style baselines (consistent hashing on the first block, SGLang's
   cache-aware policy) and Dynamo's KV cost, at each engine prefix-cache size of
   `--capacities`; each engine has that cache in every run, so least_load alone is
   "least_load without affinity". The affinity row without the hot-spot guard shows
   what the guard does.
2. A popular prefix (synthetic): every request shares one long document prefix,
   the case the hot-spot guard is for, with the same rows.
3. Simulated Azure traces (no prefixes): least_load with the affinity code path
   against least_load without it.
4. Live: a slice of Mooncake through a local cluster (mock engines with the prefix
   cache, 3 proxy nodes) next to the sim of the same slice: hit rate and TTFT p50.
5. Live, follow-up turns: 24 four-turn chats through 3 nodes in their default
   configuration (bench/prefix_live.py).
6. Redis cost of the index per request at 64 and 1,024 instances.

With --write-docs the text between `<!-- prefix:start -->` and `<!-- prefix:end -->`
of docs/benchmarks.md is replaced; without it the section is only printed.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import shlex
import statistics
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.docs import add_write_docs, write_section
from bench.live import LiveConfig, LiveRun, run_live, slice_requests
from bench.prefix_live import CostResult, TurnsResult, follow_up_turns, redis_cost
from bench.sim.simulator import NODE_STRIDE, SimConfig, StrategyResult, simulate
from bench.sim.traces import TraceRequest, load_trace, scale_to_utilization
from coordinator.settings import Settings
from local_fleet.stats import percentile

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT.parent / "shared" / "traces"
MOONCAKE = TRACES / "mooncake_synthetic.jsonl"
AZURE = [TRACES / f"azure_llm_2023_{k}.csv" for k in ("conv", "code")]
CAPACITIES = (400_000, 1_000_000, 2_000_000)
# (label, sim strategy, SimConfig changes from the node defaults)
MOONCAKE_ROWS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("least_load", "least_load", {}),
    ("least_load_affinity", "least_load_affinity", {}),
    ("least_load_affinity, bounded loads off", "least_load_affinity", {"prefix_hot_load_pct": 0}),
    ("least_load_affinity, guard off", "least_load_affinity", {"prefix_guard_ms": 0}),
    ("consistent_hash", "consistent_hash", {}),
    ("sglang_cache_aware", "sglang_cache_aware", {}),
    ("dynamo_kv", "dynamo_kv", {}),
)
POPULAR_REQUESTS = 2000  # the popular-prefix workload: requests
POPULAR_BLOCKS = 80  # blocks of the shared prefix (40,960 tokens), then 2 unique ones
HIT_SHARE = 0.9  # affinity's hit rate >= this x pure affinity's
TTFT_SHARE = 0.7  # affinity's TTFT p50 and p99 <= this x least_load's
ANCHOR_SHARE = 1.1  # affinity's TTFT p99 <= this x the better anchor's
AZURE_SHARE = 1.03  # no regression without prefixes: within 3%
LIVE_SHARE = 0.15  # live agrees with the sim within 15% (hit rate, TTFT p50)
SIM_REPLAYS = 20  # the live slice simulated this many times, arrivals perturbed
ARRIVAL_JITTER_MS = 2.0  # each arrival later by up to this (real ms): the client's lateness
STICKY_SHARE = 0.8  # follow-up turns on their previous turn's instance, at least
TURNS_CONVERSATIONS = 24  # the follow-up trial's conversations (bench/prefix_live.py)
BUSIEST_SHARE = 1.6  # the busiest instance serves at most this x the mean
COST_US = 30.0  # Redis CPU the index may add per request
COST_POOLS = (64, 1024)
COST_CAPACITY = 100_000  # tokens per instance in the cost run (the index is kept full)

Check = tuple[str, float, float, bool]  # what, measured, bound, met


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def ms(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:,.0f}"


def scaled(
    trace: Path, limit: int | None, config: SimConfig, utilization: float
) -> list[TraceRequest]:
    return scale_to_utilization(
        load_trace(trace, limit=limit), config.timing, config.instances, utilization
    )


def popular_prefix(
    seed: int = 1, count: int = POPULAR_REQUESTS, shared: int = POPULAR_BLOCKS
) -> list[TraceRequest]:
    """Poisson arrivals that all start with the same long prefix (a shared document)."""
    rng = random.Random(seed)
    out, at = [], 0.0
    for i in range(count):
        at += rng.expovariate(1.0)
        blocks = (*range(shared), 1_000_000 + 2 * i, 1_000_001 + 2 * i)
        output = max(1, int(rng.lognormvariate(4.0, 1.0)))
        out.append(TraceRequest(i, at, len(blocks) * 512, output, blocks))
    return out


def _leading(blocks: Sequence[Hashable], held: Callable[[Hashable], bool]) -> int:
    """How many leading blocks are held."""
    return next((i for i, b in enumerate(blocks) if not held(b)), len(blocks))


def ttft_floors(requests: Sequence[TraceRequest], config: SimConfig) -> tuple[float, float]:
    """TTFT p99 floors no router goes below, with no queueing at all: each request's own
    prefill of the prompt past its leading blocks (1) that any earlier request had, or
    (2) that one LRU holding the whole fleet's cache holds (`instances` x the engine
    cache, pooled: nothing duplicated). A TTFT is at least its own uncached prefill."""
    block, timing = config.block_tokens, config.timing
    seen: set[Hashable] = set()
    pooled: OrderedDict[Hashable, None] = OrderedDict()
    capacity = config.instances * config.prefix_cache_tokens // block
    never: list[float] = []
    unpooled: list[float] = []
    for r in requests:
        for out, k in (
            (never, _leading(r.blocks, seen.__contains__)),
            (unpooled, _leading(r.blocks, pooled.__contains__)),
        ):
            cached = min(k * block, max(0, r.prompt_tokens - 1))
            out.append(timing.prefill_ms(r.prompt_tokens - cached))
        seen.update(r.blocks)
        for b in reversed(r.blocks):
            pooled[b] = None
            pooled.move_to_end(b)
        while len(pooled) > capacity:
            pooled.popitem(last=False)
    return percentile(sorted(never), 99), percentile(sorted(unpooled), 99)


def run_rows(requests: Sequence[TraceRequest], config: SimConfig) -> dict[str, StrategyResult]:
    out = {}
    for label, strategy, changes in MOONCAKE_ROWS:
        started = time.monotonic()
        row_config = replace(config, **changes)
        out[label] = simulate(requests, strategy, row_config)
        log(f"sim: {label}: {time.monotonic() - started:.1f} s")
    return out


def sim_table(results: dict[str, StrategyResult]) -> str:
    lines = [
        "| strategy | hit rate | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | e2e p50 ms "
        "| imbalance | requests per instance |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for label, r in results.items():
        hit = "n/a" if math.isnan(r.prefix_hit_rate) else f"{r.prefix_hit_rate:.3f}"
        lines.append(
            f"| {label} | {hit} | {ms(r.ttft_p50_ms)} | {ms(r.ttft_p90_ms)} "
            f"| {ms(r.ttft_p99_ms)} | {ms(r.e2e_p50_ms)} | {r.imbalance:.2f} "
            f"| {' / '.join(map(str, r.assigned))} |"
        )
    return "\n".join(lines)


def mooncake_checks(r: dict[str, StrategyResult]) -> list[Check]:
    aff, base = r["least_load_affinity"], r["least_load"]
    pure, sglang = r["consistent_hash"], r["sglang_cache_aware"]
    anchor = min(pure.ttft_p99_ms, sglang.ttft_p99_ms)
    return [
        ("hit rate >= 0.9 x pure affinity", aff.prefix_hit_rate, HIT_SHARE * pure.prefix_hit_rate,
         aff.prefix_hit_rate >= HIT_SHARE * pure.prefix_hit_rate),
        ("TTFT p50 <= 0.7 x least_load", aff.ttft_p50_ms, TTFT_SHARE * base.ttft_p50_ms,
         aff.ttft_p50_ms <= TTFT_SHARE * base.ttft_p50_ms),
        ("TTFT p99 <= 0.7 x least_load", aff.ttft_p99_ms, TTFT_SHARE * base.ttft_p99_ms,
         aff.ttft_p99_ms <= TTFT_SHARE * base.ttft_p99_ms),
        ("TTFT p99 <= 1.1 x the better anchor", aff.ttft_p99_ms, ANCHOR_SHARE * anchor,
         aff.ttft_p99_ms <= ANCHOR_SHARE * anchor),
    ]  # fmt: skip


def checks_list(checks: Sequence[Check]) -> str:
    lines = []
    for what, measured, bound, met in checks:
        fmt = (lambda v: f"{v:.3f}") if bound < 10 else ms
        ratio = measured / bound if bound else math.nan
        lines.append(
            f"- {'MET' if met else 'MISSED'}: {what}: {fmt(measured)} vs bound {fmt(bound)} "
            f"(measured / bound {ratio:.3f})"
        )
    return "\n".join(lines)


def azure_part(
    trace: Path, limit: int | None, config: SimConfig, util: float
) -> tuple[str, list[Check]]:
    requests = scaled(trace, limit, config, util)
    base = simulate(requests, "least_load", config)
    aff = simulate(requests, "least_load_affinity", config)
    log(f"sim: {trace.name} done")
    table = sim_table({"least_load": base, "least_load_affinity": aff})
    checks: list[Check] = [
        (f"{trace.name}: TTFT {q} within 3% of least_load (or better)", m, AZURE_SHARE * b,
         m <= AZURE_SHARE * b)
        for q, m, b in (("p50", aff.ttft_p50_ms, base.ttft_p50_ms),
                        ("p99", aff.ttft_p99_ms, base.ttft_p99_ms))
    ]  # fmt: skip
    return table, checks


def perturbed_sims(
    requests: Sequence[TraceRequest], config: LiveConfig, replays: int = SIM_REPLAYS
) -> list[StrategyResult]:
    """The live slice simulated `replays` times, each arrival moved later by a random
    0..ARRIVAL_JITTER_MS of real time (the order of the live client's own send
    lateness, p99 about 2 ms here), each replay with its own seed.

    Routing with prefix caches is chaotic at this load: a shift of one arrival by a
    millisecond can send a long prompt elsewhere, which moves every later hit and
    queue. The unperturbed sim is one draw from a spread as wide as the live runs'.
    """
    jitter = ARRIVAL_JITTER_MS * config.rate  # engine ms
    strategy = config.sim_strategy("least_load")
    return [
        simulate(
            perturbed_arrivals(requests, jitter, replay),
            strategy,
            replace(config.sim_config(), seed=replay),
        )
        for replay in range(replays)
    ]


def perturbed_arrivals(
    requests: Sequence[TraceRequest], jitter_ms: float, seed: int
) -> list[TraceRequest]:
    """Each arrival moved later by a random 0..jitter_ms (engine ms), from `seed`."""
    rng = random.Random(seed)
    return [replace(r, arrival_ms=r.arrival_ms + rng.uniform(0.0, jitter_ms)) for r in requests]


def _spread(values: Sequence[float], fmt: Callable[[float], str]) -> str:
    return f"mean {fmt(statistics.fmean(values))} ({fmt(min(values))}-{fmt(max(values))})"


def live_part(
    runs: Sequence[LiveRun],
    controls: Sequence[LiveRun],
    sims: Sequence[StrategyResult],
    control_sims: Sequence[StrategyResult],
) -> tuple[str, list[Check]]:
    """The live slice against the sim: one row per run (affinity on, and the control
    without any engine cache), the checks on the means over the live runs against the
    means over the perturbed sims."""
    sim = runs[0].comparisons[0].sim  # the same unperturbed simulation every run
    lives = [r.comparisons[0].live for r in runs]
    plains = [c.comparisons[0] for c in controls]
    hit = statistics.fmean(x.prefix_hit_rate for x in lives)
    p50 = statistics.fmean(x.ttft_p50_ms for x in lives)
    sim_hit = statistics.fmean(x.prefix_hit_rate for x in sims)
    sim_p50 = statistics.fmean(x.ttft_p50_ms for x in sims)
    control_p50 = statistics.fmean(x.ttft_p50_ms for x in control_sims)
    replays = f"{len(sims)} replays, arrivals perturbed by up to {ARRIVAL_JITTER_MS:g} ms real"
    lines = [
        "| | hit rate | TTFT p50 ms | TTFT p99 ms | e2e p50 ms | completed | per instance |",
        "|---|---:|---:|---:|---:|---:|---|",
        f"| sim ({sim.strategy}), unperturbed | {sim.prefix_hit_rate:.3f} "
        f"| {ms(sim.ttft_p50_ms)} | {ms(sim.ttft_p99_ms)} | {ms(sim.e2e_p50_ms)} "
        f"| {sim.completed}/{sim.requests} | {' / '.join(map(str, sim.assigned))} |",
        f"| sim, {replays} | {_spread([x.prefix_hit_rate for x in sims], '{:.3f}'.format)} "
        f"| {_spread([x.ttft_p50_ms for x in sims], ms)} "
        f"| {_spread([x.ttft_p99_ms for x in sims], ms)} "
        f"| {_spread([x.e2e_p50_ms for x in sims], ms)} | | |",
        *(
            f"| live {k + 1} ({live.strategy}, affinity on) | {live.prefix_hit_rate:.3f} "
            f"| {ms(live.ttft_p50_ms)} | {ms(live.ttft_p99_ms)} | {ms(live.e2e_p50_ms)} "
            f"| {live.completed}/{live.requests} "
            f"| {' / '.join(map(str, live.assigned.values()))} |"
            for k, live in enumerate(lives)
        ),
        f"| live, mean of {len(lives)} | {hit:.3f} | {ms(p50)} | | | | |",
        f"| control, sim (least_load, no engine cache), unperturbed | n/a "
        f"| {ms(plains[0].sim.ttft_p50_ms)} | {ms(plains[0].sim.ttft_p99_ms)} "
        f"| {ms(plains[0].sim.e2e_p50_ms)} "
        f"| {plains[0].sim.completed}/{plains[0].sim.requests} | - |",
        f"| control, sim, {replays} | n/a | {_spread([x.ttft_p50_ms for x in control_sims], ms)} "
        f"| {_spread([x.ttft_p99_ms for x in control_sims], ms)} "
        f"| {_spread([x.e2e_p50_ms for x in control_sims], ms)} | | - |",
        *(
            f"| control, live {k + 1} (least_load, no engine cache) | n/a "
            f"| {ms(plain.live.ttft_p50_ms)} | {ms(plain.live.ttft_p99_ms)} "
            f"| {ms(plain.live.e2e_p50_ms)} | {plain.live.completed}/{plain.live.requests} | - |"
            for k, plain in enumerate(plains)
        ),
    ]
    checks: list[Check] = []
    for what, a, b in (
        ("live hit rate within 15% of the sim's", hit, sim_hit),
        ("live TTFT p50 within 15% of the sim's", p50, sim_p50),
    ):
        deviation = abs(a / b - 1.0) if b else math.inf
        checks.append((what + f" (deviation {deviation:.1%})", a, b, deviation <= LIVE_SHARE))
    ratios = ", ".join(f"{plain.live.ttft_p50_ms / control_p50:.2f}" for plain in plains)
    note = (
        f"\n\n{len(runs)} live runs of each, interleaved (affinity on, then the control), "
        "each on a fresh fleet. With prefix caches, routing at this load is chaotic: "
        "moving one arrival by a millisecond can send a long prompt to another instance, "
        "and every later hit and queue moves with it. So one simulation is one draw: "
        f"the slice is simulated {len(sims)} times, each arrival moved later by a random "
        f"0-{ARRIVAL_JITTER_MS:g} ms of real time (the order of the live client's own send "
        "lateness), and its TTFT p50 spreads over the range above, as the live runs' does; "
        "without caches (the control) it barely moves. The checks compare the means "
        "over the live runs with the means over the perturbed sims (a spread with two "
        "modes makes a median of 3 jump between them). The control replays the same slice "
        "with no prefix cache anywhere: its live TTFT p50 is "
        f"{ratios}x the perturbed sims' mean, the harness's own deviation on these long "
        "prompts, with no affinity involved. Both sides' nodes decide on views of the pool "
        "of the same age in engine time (bench/live.py `NODE_TIMES`)."
    )
    return "\n".join(lines) + note, checks


def turns_part(instances: int, nodes: int) -> tuple[str, list[Check]]:
    from local_fleet.cluster import LocalCluster, free_port_block  # the live parts only

    s = Settings()
    results: list[tuple[str, TurnsResult]] = []
    harsh = f"one shared by all, {2 * nodes} nodes, twice the conversations"
    for label, shared, fleet, conversations in (
        ("a system prompt of its own", False, nodes, TURNS_CONVERSATIONS),
        ("one system prompt shared by all", True, nodes, TURNS_CONVERSATIONS),
        (harsh, True, 2 * nodes, 2 * TURNS_CONVERSATIONS),
    ):
        cluster = LocalCluster(  # a fresh cluster each: nothing carried from the other
            nodes=fleet,
            engines=instances,
            base_port=free_port_block(fleet, instances),
            pool=f"prefix-turns-{len(results)}",
            engine_args=["--prefix-cache-tokens", str(s.prefix_cache_tokens)],
        )
        cluster.start(timeout_s=60)
        try:
            r = asyncio.run(
                follow_up_turns(
                    cluster.node_urls,
                    instances,
                    shared_system=shared,
                    conversations=conversations,
                )
            )
            results.append((label, r))
        finally:
            cluster.stop()
    first = results[0][1]
    lines = [
        f"{first.conversations} conversations of {first.turns} turns (a 16,000-character "
        f"system prompt, each turn adds a question and the answer; ~1 s between turns, "
        f"turn k through node (conversation + k) mod {nodes}); {instances} mock engines at "
        f"speed 1 with a {s.prefix_cache_tokens:,}-token prefix cache; nodes in their "
        f"default configuration; the busiest instance against the mean over all "
        f"{instances}, idle ones included. Three runs, each on a fresh cluster: each "
        f"conversation with a system prompt of its own, then all with one shared system "
        f"prompt (a popular prefix: every first turn finds it cached somewhere), then "
        f"the shared prompt again with {2 * nodes} nodes and "
        f"{2 * TURNS_CONVERSATIONS} conversations (beyond the target's setting: each "
        f"node's first request through the prompt, and every node's view of who took "
        f"the last ones, is what piles conversations onto one instance).",
        "",
        "| system prompt | follow-ups on the previous turn's instance | requests per "
        "instance | busiest / mean | failed |",
        "|---|---:|---|---:|---:|",
    ]
    checks: list[Check] = []
    for label, r in results:
        lines.append(f"| {label} | {r.same_instance}/{r.follow_ups} | {r.counts_text} | "
                     f"{r.busiest_over_mean:.2f} | {r.failed} |")  # fmt: skip
        checks += [
            (f"{label}: follow-up turns on the previous turn's instance >= 80%",
             r.stickiness, STICKY_SHARE, r.stickiness >= STICKY_SHARE),
            (f"{label}: busiest instance <= 1.6 x the mean", r.busiest_over_mean,
             BUSIEST_SHARE, r.busiest_over_mean <= BUSIEST_SHARE),
        ]  # fmt: skip
    return "\n".join(lines), checks


def cost_part() -> tuple[str, list[Check]]:
    from local_fleet.embedded import EmbeddedRedis

    server = EmbeddedRedis().start()
    try:
        results: list[CostResult] = [
            r
            for n in COST_POOLS
            for r in asyncio.run(redis_cost(server.url, n, capacity_tokens=COST_CAPACITY))
        ]
    finally:
        server.stop()
    lines = [
        "| instances | requests | lookup µs | record µs | records per request "
        "| total µs per request | server CPU µs per request, live "
        "| server CPU µs per request, busy shard (replayed) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {r.instances:,} | {r.case} | {r.lookup_us:.1f} | {r.record_us:.1f} "
            f"| {r.records_per_request:.2f} | {r.total_us:.1f} | {r.cpu_us:.1f} "
            f"| {r.replayed_cpu_us:.1f} |"
            for r in results
        ),
    ]
    checks: list[Check] = [
        (f"index Redis CPU per request <= 30 µs at {r.instances:,} instances, {r.case}"
         f"{label}", value, COST_US, value <= COST_US)
        for r in results
        for label, value in (
            ("", r.total_us),
            (", server CPU live", r.cpu_us),
            (", busy shard (replayed)", r.replayed_cpu_us),
        )
    ]  # fmt: skip
    return "\n".join(lines), checks


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mooncake", type=Path, default=MOONCAKE, help="trace with hash_ids")
    parser.add_argument(
        "--azure", type=Path, nargs="*", default=AZURE, help="traces without prefixes"
    )
    parser.add_argument(
        "--azure-limit", type=int, default=10000, help="first N Azure requests (0 = all)"
    )
    parser.add_argument(
        "--capacities",
        default=",".join(map(str, CAPACITIES)),
        help="engine prefix caches (tokens) to simulate; the live run uses the first",
    )
    parser.add_argument("--utilization", type=float, default=0.8)
    parser.add_argument("--instances", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument(
        "--live-offset", type=int, default=0, help="first request of the live slice"
    )
    parser.add_argument("--live-limit", type=int, default=300, help="requests in the live slice")
    parser.add_argument("--speed", type=float, default=None, help="live speed (default: auto)")
    parser.add_argument(
        "--live-runs", type=int, default=3, help="live runs of the slice (checks take means)"
    )
    parser.add_argument("--no-live", action="store_true", help="simulate only")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    add_write_docs(parser, "--doc")
    args = parser.parse_args(argv)
    capacities = [int(c) for c in args.capacities.split(",") if c.strip()]
    started = time.monotonic()
    command = shlex.join(
        ["python", "bench/prefix_report.py", *(argv if argv is not None else sys.argv[1:])]
    )
    parts: list[str] = []
    summary: list[Check] = []
    for capacity in capacities:
        config = SimConfig(instances=args.instances, nodes=args.nodes, prefix_cache_tokens=capacity)
        requests = scaled(args.mooncake, None, config, args.utilization)
        log(f"sim: {args.mooncake.name}, {len(requests)} requests, cache {capacity:,} tokens")
        results = run_rows(requests, config)
        checks = mooncake_checks(results)
        own = sorted(config.timing.prefill_ms(r.prompt_tokens) for r in requests)
        never, pooled = ttft_floors(requests, config)
        summary += [(f"{w} (cache {capacity:,})", m, b, ok) for w, m, b, ok in checks]
        parts.append(
            f"### `{args.mooncake.name}`, engine prefix cache {capacity:,} tokens\n\n"
            f"{sim_table(results)}\n\n{checks_list(checks)}\n\n"
            f"For scale: a request's own prefill with nothing cached is "
            f"{ms(percentile(own, 50))} ms at p50 and {ms(percentile(own, 99))} ms at p99; "
            "a TTFT p99 near the latter comes from long prompts that share nothing cached. "
            f"No router's TTFT p99 goes below {ms(never)} ms here (each request's own "
            "prefill of the blocks no earlier request had), nor below "
            f"{ms(pooled)} ms with the fleet's {config.instances} caches pooled into one "
            "LRU (nothing duplicated), even with no queueing at all."
        )
    base = SimConfig(instances=args.instances, nodes=args.nodes, prefix_cache_tokens=capacities[0])
    popular = scale_to_utilization(popular_prefix(), base.timing, args.instances, args.utilization)
    log(f"sim: a popular prefix, {len(popular)} requests")
    parts.append(
        f"### A popular prefix (synthetic), engine prefix cache {capacities[0]:,} tokens\n\n"
        f"{len(popular)} Poisson requests, each a {POPULAR_BLOCKS}-block (40,960-token) shared "
        "prefix plus 2 blocks of its own, log-normal outputs (median 55); utilization "
        f"{args.utilization:g} of uncached work, so once cached the fleet is nearly idle: "
        "what matters is whether the shared prefix piles everything onto its holders "
        "(imbalance, idle instances) or spreads.\n\n"
        f"{sim_table(run_rows(popular, base))}"
    )
    for trace in args.azure:
        table, checks = azure_part(trace, args.azure_limit or None, base, args.utilization)
        summary += checks
        parts.append(f"### `{trace.name}` (no prefixes)\n\n{table}\n\n{checks_list(checks)}")
    if not args.no_live:
        live_config = LiveConfig(
            instances=args.instances,
            nodes=args.nodes,
            speed=args.speed,
            prefix_cache_tokens=capacities[0],
        )

        def slice_run(config: LiveConfig) -> LiveRun:
            return run_live(
                args.mooncake,
                offset=args.live_offset,
                limit=args.live_limit,
                utilization=args.utilization,
                strategies=["least_load"],
                config=config,
                progress=log,
            )

        requests, live_config = slice_requests(
            args.mooncake, args.live_offset, args.live_limit, args.utilization, live_config, log
        )
        control_config = replace(live_config, prefix_cache_tokens=0)
        log(f"sim: the live slice, {SIM_REPLAYS} perturbed replays with and without caches")
        sims = perturbed_sims(requests, live_config)
        control_sims = perturbed_sims(requests, control_config)
        runs: list[LiveRun] = []
        controls: list[LiveRun] = []
        for _ in range(args.live_runs):
            runs.append(slice_run(live_config))
            controls.append(slice_run(control_config))
        run = runs[0]
        table, checks = live_part(runs, controls, sims, control_sims)
        summary += checks
        parts.append(
            f"### Live: {run.limit} requests of `{args.mooncake.name}` from request "
            f"{run.offset}, engine prefix cache {capacities[0]:,} tokens, speed "
            f"{run.config.rate:g}\n\n{table}\n\n{checks_list(checks)}"
        )
        log("live: follow-up turns")
        text, checks = turns_part(args.instances, args.nodes)
        summary += checks
        parts.append(f"### Live: follow-up turns\n\n{text}\n\n{checks_list(checks)}")
    log("redis cost")
    table, checks = cost_part()
    summary += checks
    parts.append(
        "### Redis cost of the index\n\nRedis time per request in the commands a node "
        "sends (`INFO commandstats` on a private server, the median over chunks of 100 "
        "requests): the decision's lookup (an `HMGET` of the blocks and, unless the node "
        "saw them lately, one of the owners' counts; timed in a pass of its "
        "own) and the record after it, which rides along with the node's next call "
        "(its `reserve`, or a `carry` after `carry_ms`: coordinator/held_records.py), so "
        "it costs what carrying it adds to a call the node makes anyway: each record in a "
        "`carry` call of its own, less an empty `carry` call timed in a pass of its own; "
        "plus the `HSCAN` (a tree before 2026-12-05: `HRANDFIELD`), `HDEL`, `HSETNX` and "
        "`UNLINK` of one sampled reclaim in 16, whose `HMGET`s and `HSET`s share rows with "
        "the others' and are left out; "
        "with every instance's index full at "
        f"{COST_CAPACITY:,} tokens of 30-block conversations (Mooncake's mean prompt). This adds to the "
        "decision's flat cost (docs/scaling.md): the lookup reads a fixed number of "
        "fields and the record touches only the chosen instance's entries, whatever "
        "the pool size. Server CPU live is the server's main-thread CPU (INFO cpu, "
        "network and each call's wake-up included) while the node sent them, less the "
        "empty calls' (the lookup is a round trip of its own: its wake-up counts); the "
        "last column is the same CPU for the same lookups and records sent again in pipelines of "
        "500 from the state they started from, less the empty calls' sent the same way "
        "(median of 5 replays each): a busy shard's "
        "cost, where a server that idles between a waiting node's calls pays a wake-up "
        "in each command's time on this 2-core VM (docs/scaling.md, "
        f'"replayed").\n\n{table}\n\n{checks_list(checks)}'
    )
    seconds = time.monotonic() - started
    text = section(command, parts, summary, args, seconds)
    print(text)
    if args.write_docs:
        write_section("prefix", text, args.doc)
        log(f"wrote {args.doc} in {seconds:.0f} s")
    return 0


def section(
    command: str, parts: list[str], summary: list[Check], args: argparse.Namespace, seconds: float
) -> str:
    s = Settings()
    met = sum(1 for *_, ok in summary if ok)
    head = f"""## Prefix-cache affinity (issue 16)

Generated by `{command}` in {seconds:.0f} s: every table below comes from this one
run, side by side. Fleet: {args.instances} engines (`local_fleet.engine_model`, each
with a prefix cache: LRU of whole 512-token trace blocks, a prefill computes only
its uncached tokens), {args.nodes} proxy nodes (each ranking on its own view of the pool,
read again once {s.snapshot_max_age_ms} ms old, as the nodes do), utilization {args.utilization:g}
(computed on uncached work, so caching lowers the real load). The nodes' defaults:
`ttft_ms` weight {s.weights.ttft_ms:g}, `prefill_ms` weight {s.weights.prefill_ms:g},
hot-spot guard {s.prefix_guard_ms} ms ({s.prefix_hot_guard_ms} ms for a hot prefix: one the
node routed within {s.prefix_hot_ms} ms under another prompt; a hot prefix goes first to
instances within {s.prefix_hot_load_pct}% of their share of the requests, bounded loads, if
the prefix is short or popular: any instance while one is idle, else only among its
holders), at
most {s.prefix_max_blocks} blocks looked up per request, {s.prefix_max_owners}
owners per block, an index entry every {s.prefix_record_stride} blocks and at the
prompt's last (every {NODE_STRIDE} trace blocks in the sim, the same tokens; the
baselines see every block). *Hit rate*: cached / queried prompt tokens, from the engines'
caches (the counters the mock engine exports as `vllm:prefix_cache_hits` /
`vllm:prefix_cache_queries`). Baselines (bench/sim/prefix_policies.py):
*consistent_hash* routes on the first block alone (pure affinity);
*sglang_cache_aware* is the SGLang router's policy with its defaults (cache
threshold 0.5, balance thresholds abs 32 / rel 1.1 on inflight requests);
*dynamo_kv* is Dynamo's KV router cost with overlap weight 1. The oracle is left
out: it does not look into prefix caches.

Summary: {met} of {len(summary)} targets met.
"""
    return head + "\n" + "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.exit(main())
