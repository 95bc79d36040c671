"""A deterministic discrete-event simulation of a proxy fleet in front of engines.

The engines are `local_fleet.engine_model.EngineModel`, the same model the mock
engine runs. The strategies are the real ones from `coordinator.strategies`, scoring
rows that `coordinator.pressure.instance_load` derives from an in-memory pool with
the Lua scripts' semantics (`shared_state.SharedState`). Arrivals go to the N nodes
round-robin, as a load balancer in front of them would spread them. Every node keeps
its own round-robin counter, random generator and expected-output average, like a
real proxy process. Decisions are serialized (Redis is one round trip away), but a
node ranks on its own view of the shared state, as `Coordinator.reserve` does
(`NodeView`): the whole state read again once it is older than
`snapshot_max_age_ms`, engine hints only every `live_refresh_ms`, in between only
the rows its own reserves, first-token marks and releases patch, and the Redis time
of its last read or reserve, extrapolated to the current time, as "now". The reserve
script then takes the first ranked candidate no busier (live reservations,
prefill-phase reservations) than the node saw it, or than the least busy candidate
ranked after it, unless one passed over before it beats it now (fewer live
reservations and a TTFT no longer); when every candidate got busier, the least busy
one if it has no more live reservations than the pool's mean, else the node re-ranks
on the whole state; the last try forces the least reserved one. Both ages 0 give
every node the current state at every decision. Carried marks and releases
(`carry_ms`) are applied at once.

Strategies:

- `random`, `round_robin`: per-node, no load information;
- `local_least_inflight`: each node counts only the requests it sent (nginx
  `least_conn`); this is exactly the coordinator's degraded mode (local counters,
  lifecycle layer only, round-robin among ties);
- `least_load_instantaneous`: shared inflight plus engine hints scraped every
  `hint_interval_ms` (`least_load(..., use_predicted=False)`);
- `least_load`: the full three-layer score over shared reservations, given the
  request as a node's `Coordinator.reserve` gives it (its `ttft_ms` component; no
  cached tokens: a node with `prefix_affinity` off);
- `power_of_two`: two random candidates, the better by the full score;
- `oracle`: one central dispatcher that knows every engine's exact state and sends
  each request where its TTFT is smallest (see `exact_ttft_ms`; it does not look
  into prefix caches).

Prefix-aware strategies (`PREFIX_STRATEGIES`, for traces with `hash_ids` and
`prefix_cache_tokens > 0`; bench/sim/prefix_policies.py): `least_load_affinity` (the
full score with each candidate's expected cached tokens from the shared prefix index
taken off its predicted prefill, behind the hot-spot guard), and the baselines
`consistent_hash`, `sglang_cache_aware` and `dynamo_kv`. Each engine then has a prefix cache of
`prefix_cache_tokens`, the trace's blocks being its cache blocks; every strategy runs
on engines with caches, so `least_load` alone is "least_load without affinity".

Metrics per request: TTFT = first token - arrival; end-to-end = last token -
arrival; queue wait = prefill start - arrival (= TTFT - the request's own prefill
time, since a prefill is one uninterrupted engine iteration). Load imbalance =
max / mean over instances of the assigned work, where a request's work is its
`traces.service_ms` (the capacity unit of the utilization definition).
"""

from __future__ import annotations

import heapq
import math
import random
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from bench.sim.prefix_policies import (
    HashRing,
    SglangThresholds,
    SharedPrefixIndex,
    dynamo_choice,
    sglang_choice,
)
from bench.sim.shared_state import NodeView, SharedState
from bench.sim.traces import TRACE_BLOCK_TOKENS, TraceRequest, service_ms
from coordinator.guard import guard_bounds
from coordinator.models import InstanceLoad, InstanceRow, InstanceSpec, RequestShape
from coordinator.prefix import (
    CachedTokens,
    HotPrefixes,
    RecentStarts,
    block_tokens,
    cheap_copy_tokens,
    guarded_cached_tokens,
    hot_instances,
    idle_fleet_room,
)
from coordinator.pressure import instance_load
from coordinator.settings import Settings, Weights
from coordinator.strategies import (
    Ranking,
    RoundRobin,
    crowded_last,
    least_load,
    power_of_two,
    round_robin,
)
from coordinator.timing import (
    Observations,
    TimingPolicy,
    TimingSource,
    flush_interval_ms,
    merge_record,
    resolve_pool,
)
from local_fleet.engine_model import EngineModel, EngineTiming, PrefixCache
from local_fleet.stats import percentile

# The node's record stride in trace blocks: the same tokens per index entry.
NODE_STRIDE = max(
    1,
    Settings().prefix_record_stride
    * block_tokens(Settings().prefix_block_chars)
    // TRACE_BLOCK_TOKENS,
)

STRATEGIES = (
    "random",
    "round_robin",
    "local_least_inflight",
    "least_load_instantaneous",
    "least_load",
    "power_of_two",
    "oracle",
)
PREFIX_STRATEGIES = ("least_load_affinity", "consistent_hash", "sglang_cache_aware", "dynamo_kv")
ALL_STRATEGIES = STRATEGIES + PREFIX_STRATEGIES
SHARED = frozenset({"least_load_instantaneous", "least_load", "power_of_two", *PREFIX_STRATEGIES})
# Strategies a node runs through Coordinator.reserve: ranked on its view, then the
# reserve script's candidate loop (the prefix baselines model other routers).
RESERVED = frozenset(
    {"least_load_instantaneous", "least_load", "power_of_two", "least_load_affinity"}
)
EXPECTED_OUTPUT_MODES = ("avg", "true")
# What instances register: their exact timing, none (learned from traffic), or one
# shared timing (the base engine's) whatever their true speed.
REGISTERED_TIMING = ("exact", "none", "shared")
LIVENESS_TTL_MS = 2**40  # the sim does not model liveness: every instance stays alive

# Same-time events: engines first (their tokens happened), then scrapes, then arrivals.
_ENGINE, _SCRAPE = 0, 1

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Parameters of one simulated fleet."""

    instances: int = 8  # engine instances
    nodes: int = 3  # proxy nodes; arrivals go to them round-robin
    hint_interval_ms: float = 1000.0  # engine hints are scraped this often (staleness)
    hint_ttl_ms: int = Settings().hint_ttl_ms  # older hints count as missing
    expected_output: str = "avg"  # avg: running average of completed outputs; true: oracle
    initial_expected_output: int = 128  # a node's guess before it has seen a completion
    max_slots: int = -1  # max_slots registered per instance; -1 = the engine's max_batch
    seed: int = 0
    timing: EngineTiming = field(default_factory=EngineTiming)
    weights: Weights = field(default_factory=lambda: Settings().weights)  # serve's default
    prefix_cache_tokens: int = 0  # each engine's prefix cache and index capacity; 0 = none
    block_tokens: int = TRACE_BLOCK_TOKENS  # tokens per trace block (hash_ids)
    prefix_max_blocks: int = Settings().prefix_max_blocks  # blocks a node looks up
    prefix_record_stride: int = NODE_STRIDE  # index entries every this many trace blocks
    sglang: SglangThresholds = field(default_factory=SglangThresholds)
    dynamo_overlap_weight: float = 1.0  # Dynamo's kv-overlap-score-weight
    prefix_guard_ms: int = Settings().prefix_guard_ms  # the hot-spot guard (coordinator/prefix.py)
    prefix_hot_guard_ms: int = Settings().prefix_hot_guard_ms  # its distance for hot prefixes
    prefix_hot_ms: int = Settings().prefix_hot_ms  # what the guard counts as hot (ditto)
    prefix_hot_load_pct: int = Settings().prefix_hot_load_pct  # bounded loads when hot (ditto)
    speeds: tuple[float, ...] = ()  # true speed per instance, cycled (empty: all 1.0)
    registered_timing: str = "exact"  # exact | none | shared (REGISTERED_TIMING)
    learn: bool = False  # nodes learn timing from traffic (coordinator/timing.py)
    timing_flush_ms: int = Settings().timing_flush_ms  # how often a node merges samples
    timing_flush_nodes: int = Settings().timing_flush_nodes  # beyond: each merges less often
    # A node's view of the shared state (NodeView): the whole state is read again
    # when older than this (0: before every decision), and hints every
    # live_refresh_ms (0: before every decision), as in Coordinator._ensure_view.
    snapshot_max_age_ms: int = Settings().snapshot_max_age_ms
    live_refresh_ms: int = min(Settings().live_refresh_ms, Settings().instance_ttl_ms // 4)
    top_k: int = Settings().top_k  # ranked candidates the reserve script looks at
    reserve_retries: int = Settings().reserve_retries  # re-ranks before a forced reserve

    def __post_init__(self) -> None:
        if any(not (v > 0 and math.isfinite(v)) for v in self.speeds):
            raise ValueError("speeds must be finite and > 0")
        if self.registered_timing not in REGISTERED_TIMING:
            raise ValueError(f"registered_timing must be one of {REGISTERED_TIMING}")
        if self.instances < 1 or self.nodes < 1:
            raise ValueError("instances and nodes must be >= 1")
        if not self.hint_interval_ms > 0:
            raise ValueError("hint_interval_ms must be > 0")
        if self.hint_ttl_ms < 0:
            raise ValueError("hint_ttl_ms must be >= 0")
        if self.expected_output not in EXPECTED_OUTPUT_MODES:
            raise ValueError(f"expected_output must be one of {EXPECTED_OUTPUT_MODES}")
        if self.initial_expected_output < 0 or self.max_slots < -1:
            raise ValueError("initial_expected_output must be >= 0 and max_slots >= -1")
        if (
            self.prefix_cache_tokens < 0
            or self.block_tokens < 1
            or self.prefix_max_blocks < 1
            or self.prefix_record_stride < 1
        ):
            raise ValueError("need prefix_cache_tokens >= 0, block_tokens and max blocks >= 1")
        if self.snapshot_max_age_ms < 0 or self.live_refresh_ms < 0:
            raise ValueError("snapshot_max_age_ms and live_refresh_ms must be >= 0")
        if self.top_k < 1 or self.reserve_retries < 0:
            raise ValueError("need top_k >= 1 and reserve_retries >= 0")

    @property
    def registered_max_slots(self) -> int:
        """The max_slots every instance registers (0 = unlimited)."""
        return self.timing.max_batch if self.max_slots < 0 else self.max_slots

    def speed(self, k: int) -> float:
        """The true speed of instance k."""
        return self.speeds[k % len(self.speeds)] if self.speeds else 1.0

    def engine_timing(self, k: int) -> EngineTiming:
        """The true timing of instance k."""
        speed = self.speed(k)
        return self.timing if speed == 1.0 else self.timing.scaled(speed)

    @property
    def capacity(self) -> float:
        """The fleet's capacity in base-speed instances (what utilization divides by)."""
        return sum(self.speed(k) for k in range(self.instances))

    def spec(self, instance_id: str, k: int = 0) -> InstanceSpec:
        """What simulated engine k registers with the coordinator."""
        base = InstanceSpec(
            id=instance_id,
            url=f"http://127.0.0.1/{instance_id}",
            max_slots=self.registered_max_slots,
            prefix_cache_tokens=self.prefix_cache_tokens,
        )
        if self.registered_timing == "none":
            return base
        t = self.timing if self.registered_timing == "shared" else self.engine_timing(k)
        return replace(
            base,
            prefill_ms_per_token=t.prefill_ms_per_token,
            prefill_overhead_ms=t.prefill_overhead_ms,
            decode_ms_per_token=t.nominal_decode_ms_per_token(),
        )


@dataclass(frozen=True, slots=True)
class StrategyResult:
    """Outcome of one strategy over one trace (times in ms)."""

    strategy: str
    requests: int
    completed: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float
    queue_wait_mean_ms: float
    imbalance: float  # max / mean of assigned work per instance
    assigned: tuple[int, ...]  # requests per instance
    ttft_ms: tuple[float, ...] = field(repr=False)  # per request, for CDFs
    prefix_hit_rate: float = math.nan  # cached / queried prompt tokens (engine caches)
    wait_p99_ms: float = math.nan  # queueing wait (TTFT - own prefill), p99

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary (without per-request samples)."""
        return {
            "strategy": self.strategy,
            "requests": self.requests,
            "completed": self.completed,
            "ttft_p50_ms": self.ttft_p50_ms,
            "ttft_p90_ms": self.ttft_p90_ms,
            "ttft_p99_ms": self.ttft_p99_ms,
            "e2e_p50_ms": self.e2e_p50_ms,
            "e2e_p99_ms": self.e2e_p99_ms,
            "queue_wait_mean_ms": self.queue_wait_mean_ms,
            "wait_p99_ms": self.wait_p99_ms,
            "imbalance": self.imbalance,
            "assigned": list(self.assigned),
            "prefix_hit_rate": self.prefix_hit_rate,
        }


@dataclass(frozen=True, slots=True)
class TailReport:
    """The slowest requests of a run: on which true speeds, and what predicted them."""

    requests: int
    by_speed: dict[float, int]  # true speed of the chosen instance -> requests
    predicted_over_true: float  # median predicted / true prefill ms per token
    sources: dict[str, int]  # source of that prediction -> requests


def exact_ttft_ms(
    engine: EngineModel, prompt_tokens: int, now_ms: float, current_output: int | None
) -> float:
    """The TTFT a request submitted now would get if nothing else arrived (oracle).

    Follows EngineModel's rules forward, jumping over decode steps instead of taking
    them one by one: the iteration in progress ends, then FCFS prefills run while the
    batch has room, and a full batch decodes until its first sequence finishes.
    `current_output` is the output length of the sequence being prefilled right now
    (None when the iteration in progress is a decode step or the engine is idle).
    tests/benchmarks/test_sim.py checks it against a cloned engine run step by step.
    """
    t = engine.timing
    remaining = [s.output_tokens - s.generated for s in engine.running]
    busy = engine.next_event_ms()
    clock = now_ms
    if busy is not None:
        clock = busy
        if current_output is not None:
            if current_output > 1:
                remaining.append(current_output - 1)
        else:
            remaining = [r - 1 for r in remaining if r > 1]
    for seq in engine.waiting:
        clock = _decode_until_room(t, remaining, clock)
        clock += t.prefill_ms(seq.prompt_tokens)
        if seq.output_tokens > 1:
            remaining.append(seq.output_tokens - 1)
    clock = _decode_until_room(t, remaining, clock)
    return clock + t.prefill_ms(prompt_tokens) - now_ms


def _decode_until_room(t: EngineTiming, remaining: list[int], clock: float) -> float:
    """Decode a full batch until a sequence finishes (in place); the new clock."""
    while len(remaining) >= t.max_batch:
        steps = min(remaining)
        clock += steps * t.step_ms(len(remaining))
        remaining[:] = [r - steps for r in remaining if r > steps]
    return clock


@dataclass(slots=True)
class _Node:
    rr: RoundRobin
    rng: random.Random
    seen_outputs: int = 0
    seen_count: int = 0
    local: list[int] = field(default_factory=list)  # this node's inflight per instance
    observations: Observations = field(default_factory=Observations)
    flushed_ms: float = 0.0
    hot: HotPrefixes = field(default_factory=lambda: HotPrefixes(0))  # prefixes it routed
    starts: RecentStarts = field(default_factory=lambda: RecentStarts(0))  # fleet's, lately
    view: NodeView | None = None  # its view of the shared state (RESERVED strategies)


class Simulation:
    """One strategy over one trace; `run()` returns the result."""

    def __init__(
        self,
        requests: Sequence[TraceRequest],
        strategy: str,
        config: SimConfig | None = None,
        progress: Progress | None = None,
    ) -> None:
        if strategy not in ALL_STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; choose from {ALL_STRATEGIES}")
        self.requests = list(requests)
        self.strategy = strategy
        self.config = config or SimConfig()
        self.progress = progress
        c = self.config
        self.ids = [f"i{k:03d}" for k in range(c.instances)]
        self.index = {iid: k for k, iid in enumerate(self.ids)}
        self.configured = [c.spec(iid, k) for k, iid in enumerate(self.ids)]
        self.engines = [
            EngineModel(c.engine_timing(k), self._prefix_cache()) for k in range(c.instances)
        ]
        # The node's index records every few blocks; the baselines see every block (as
        # SGLang's radix tree and Dynamo's KV events do).
        stride = c.prefix_record_stride if self.strategy == "least_load_affinity" else 1
        self.prefix_index = SharedPrefixIndex(
            c.prefix_cache_tokens // c.block_tokens, stride=stride
        )
        self.ring = HashRing(self.ids)
        # What a Dynamo-style router tracks: prompt tokens still to prefill (uncached,
        # as predicted) and tokens of live requests (prompt + expected output).
        self.queued_prefill = [0] * c.instances
        self.active_tokens = [0] * c.instances
        self.uncached_of: dict[int, int] = {}
        self.state = SharedState()
        for s in self.configured:
            self.state.register(s, 0)
        # What predicts: the configured specs resolved with learned records (timing.py).
        self.policy = TimingPolicy()
        self._sources: list[TimingSource] = []
        self.records: dict[str, list[float]] = {}
        self.specs = self._resolve()
        for k, spec in enumerate(self.specs):
            self.state.set_timing(spec.id, spec, self._sources[k])
        self.learning = c.learn and strategy in SHARED
        # Coordinator.timing_flush_interval_ms: every node holds a lease in the sim.
        self._flush_interval_ms = flush_interval_ms(
            c.timing_flush_ms, c.timing_flush_nodes, Settings().timing_half_life_ms, c.nodes
        )
        self.alone = [False] * len(requests)  # reserved with no other prefill pending
        self.batch_of = [1] * len(requests)
        # The prefill ms/token and its source the chosen instance was predicted with.
        self.predicted_with: list[tuple[float | None, str] | None] = [None] * len(requests)
        self.nodes = [
            _Node(
                # Each node's rotation starts where the real Coordinator's does.
                RoundRobin(zlib.crc32(f"node-{n}".encode())),
                random.Random(f"{c.seed}:{strategy}:{n}"),
                local=[0] * c.instances,
                hot=HotPrefixes(c.prefix_hot_ms),
                starts=RecentStarts(c.prefix_hot_ms),
                view=(
                    NodeView(self.state, c.snapshot_max_age_ms, c.live_refresh_ms)
                    if strategy in RESERVED
                    else None
                ),
            )
            for n in range(c.nodes)
        ]
        self.tie_last = -1  # the slot reserve.lua last took with ties (meta tie_last)
        self.stale_retries = 0  # reserve calls that found every candidate busier
        self.forced = 0  # reserves forced on the last try
        self.central_rr = RoundRobin()
        # Sequences submitted to each engine and not yet prefilled, FCFS (oracle).
        self.unprefilled: list[deque[int]] = [deque() for _ in self.ids]
        n = len(self.requests)
        self.node_of = [0] * n
        self.instance_of = [-1] * n
        self.expected_of = [0] * n
        self.first_token = [math.nan] * n
        self.finished = [math.nan] * n
        self._heap: list[tuple[float, int, int, int]] = []
        self._seq = 0
        self._scheduled: list[float | None] = [None] * c.instances
        self._outstanding = 0
        self._static_rows: list[InstanceLoad] | None = None

    def _prefix_cache(self) -> PrefixCache | None:
        c = self.config
        if c.prefix_cache_tokens <= 0:
            return None
        return PrefixCache(c.prefix_cache_tokens, c.block_tokens)

    # ------------------------------------------------------------------ event loop

    def _push(self, at: float, kind: int, who: int) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, kind, self._seq, who))

    def _reschedule(self, k: int) -> None:
        at = self.engines[k].next_event_ms()
        if at is not None and at != self._scheduled[k]:
            self._push(at, _ENGINE, k)
        self._scheduled[k] = at

    def run(self) -> StrategyResult:
        """Replay every request to completion and summarize."""
        c = self.config
        uses_hints = self.strategy in SHARED
        if uses_hints:
            for k in range(c.instances):
                # Staggered scrapes: each instance's hints age independently.
                self._push(c.hint_interval_ms * k / c.instances, _SCRAPE, k)
        reqs = self.requests
        total = len(reqs)
        step = max(1, total // 10)
        heap = self._heap
        i = 0
        while i < total or heap:
            if heap and (i >= total or heap[0][0] <= reqs[i].arrival_ms):
                at, kind, _, who = heapq.heappop(heap)
                if kind == _ENGINE:
                    if self._scheduled[who] == at:
                        self._scheduled[who] = None
                        self._on_engine(who, at)
                else:
                    self._scrape(who, at)
                    if i < total or self._outstanding:
                        self._push(at + c.hint_interval_ms, _SCRAPE, who)
                continue
            self._arrive(reqs[i])
            i += 1
            if self.progress is not None and (i % step == 0 or i == total):
                self.progress(self.strategy, i, total)
        return self._summary()

    def _on_engine(self, k: int, at: float) -> None:
        now = int(at)
        for ev in self.engines[k].advance(at):
            kind = ev.kind
            if kind == "token":
                continue
            r = int(ev.rid)
            if kind == "first_token":
                self.first_token[r] = at
                if self.learning and self.alone[r]:
                    self._observe_prefill(r, k, at)
                self.unprefilled[k].popleft()
                self.queued_prefill[k] -= self.uncached_of.get(r, 0)
                if self.strategy in SHARED:
                    self.state.mark_first_token(ev.rid, now)
                    self._patch_view(r, k)
            else:  # done
                self.finished[r] = at
                if self.learning:
                    self._observe_decode(r, k, at)
                self._outstanding -= 1
                node = self.nodes[self.node_of[r]]
                node.seen_outputs += self.requests[r].output_tokens
                node.seen_count += 1
                node.local[k] -= 1
                req = self.requests[r]
                self.active_tokens[k] -= req.prompt_tokens + self.expected_of[r]
                if self.strategy in SHARED:
                    self.state.release(ev.rid, now)
                    self._patch_view(r, k)
        self._reschedule(k)

    def _patch_view(self, r: int, k: int) -> None:
        """The node that sent request r gets the record its mark or release rewrote."""
        view = self.nodes[self.node_of[r]].view
        if view is not None:
            view.patch(self.ids[k])

    def _scrape(self, k: int, at: float) -> None:
        eng = self.engines[k]
        self.state.heartbeat(
            self.ids[k],
            int(at),
            {"engine_running": eng.num_running, "engine_waiting": eng.num_waiting},
        )

    # ------------------------------------------------------------------ decisions

    def _expected_output(self, node: _Node, req: TraceRequest) -> int:
        if self.config.expected_output == "true":
            return req.output_tokens
        if node.seen_count == 0:
            return self.config.initial_expected_output
        return round(node.seen_outputs / node.seen_count)

    def _arrive(self, req: TraceRequest) -> None:
        r = req.index
        n = r % self.config.nodes
        node = self.nodes[n]
        now = int(req.arrival_ms)
        if self.learning and now - node.flushed_ms >= self._flush_interval_ms:
            self._flush(node, now)
        expected = self._expected_output(node, req)
        prefix_aware = self.strategy in PREFIX_STRATEGIES
        cached: dict[str, int] = {}
        held: dict[str, int] = {}
        if prefix_aware and req.blocks:
            held = self.prefix_index.cached_blocks(req.blocks, self.config.prefix_max_blocks)
            cached = {
                iid: min(b * self.config.block_tokens, req.prompt_tokens) for iid, b in held.items()
            }
            # as PrefixIndex.cached_tokens
            hot, popular = hot_instances(held, req.blocks, node.hot, now, now)
            cached = CachedTokens(cached, hot, popular)
        k = self._choose(node, req, now, expected, cached)
        self.node_of[r] = n
        self.instance_of[r] = k
        self.expected_of[r] = expected
        uncached = req.prompt_tokens - cached.get(self.ids[k], 0)
        self.uncached_of[r] = uncached
        self.queued_prefill[k] += uncached
        self.active_tokens[k] += req.prompt_tokens + expected
        if prefix_aware:
            blocks = req.blocks[: self.config.prefix_max_blocks]
            node.hot.note(blocks, now)
            self.prefix_index.record(self.ids[k], blocks, held.get(self.ids[k], 0), now)
        if self.strategy in SHARED:
            spec = self.specs[k]
            self.alone[r] = self.state.row(self.ids[k]).pending_prefill == 0
            self.predicted_with[r] = (spec.prefill_ms_per_token, self._sources[k].prefill)
            self.batch_of[r] = self.state.row(self.ids[k]).inflight + 1
            self.state.reserve(
                str(r),
                f"n{n}",
                self.ids[k],
                req.prompt_tokens,
                expected,
                spec.prefill_ms(uncached),
                spec.decode_ms(expected),
                now,
            )
            if node.view is not None:
                node.view.patch(self.ids[k])  # reserve's reply: the record it wrote
        node.local[k] += 1
        self._outstanding += 1
        self.unprefilled[k].append(r)
        self.engines[k].submit(
            str(r), req.prompt_tokens, req.output_tokens, req.arrival_ms, req.blocks
        )
        self._reschedule(k)

    def _view_rows(self, view: NodeView, now: int) -> list[InstanceLoad]:
        """The view's rows scored at the current time (Coordinator._current_snapshot
        extrapolates the Redis clock of its last call)."""
        ttl = self.config.hint_ttl_ms
        return [
            instance_load(row, now, instance_ttl_ms=LIVENESS_TTL_MS, hint_ttl_ms=ttl)
            for row in view.rows.values()
        ]

    def _local_rows(self, inflight: list[int]) -> list[InstanceLoad]:
        """Rows from one node's own counters: the coordinator's degraded-mode view."""
        rows = []
        for k, spec in enumerate(self.specs):
            row = InstanceRow(
                id=spec.id,
                spec=spec,
                epoch=1,
                last_seen_ms=0,
                max_slots=spec.max_slots,
                inflight=inflight[k],
                pending_prefill=0,
                active_decode=0,
                prefill_free_at_ms=0,
                earliest_end_at_ms=None,
            )
            rows.append(
                instance_load(
                    row, 0, instance_ttl_ms=LIVENESS_TTL_MS, hint_ttl_ms=0, predicted=False
                )
            )
        return rows

    def _choose(
        self, node: _Node, req: TraceRequest, now: int, expected: int, cached: dict[str, int]
    ) -> int:
        s = self.strategy
        w = self.config.weights
        if s in ("consistent_hash", "sglang_cache_aware", "dynamo_kv"):
            return self._prefix_baseline(req, cached)
        # What a node's Coordinator.reserve ranks with: the request, no cached tokens.
        shape = RequestShape(req.prompt_tokens, expected)
        if s == "random":
            return node.rng.randrange(self.config.instances)
        if s == "round_robin":
            if self._static_rows is None:
                self._static_rows = self._local_rows([0] * len(self.ids))
            ranking = round_robin(self._static_rows, w, node.rr)
        elif s == "local_least_inflight":
            ranking = least_load(
                self._local_rows(node.local), w, node.rr, use_hints=False, use_predicted=False
            )
        elif s in RESERVED:
            if s == "least_load_affinity":
                shape = self._affinity_shape(node, req, now, expected, cached)
            return self._reserve(node, now, shape)
        else:
            return self._oracle(req)
        choice = ranking.choice
        assert choice is not None
        return self.index[choice.id]

    def _rank(
        self, node: _Node, shape: RequestShape, now: int, skip: frozenset[str] = frozenset()
    ) -> Ranking:
        """The node's ranking on its view, without the instances of `skip`."""
        assert node.view is not None
        w = self.config.weights
        rows = self._view_rows(node.view, now)
        if skip:
            rows = [r for r in rows if r.id not in skip]
        if self.strategy == "least_load_instantaneous":
            return least_load(rows, w, node.rr, use_predicted=False)
        if self.strategy == "power_of_two":
            return power_of_two(rows, w, node.rr, node.rng, shape)
        return least_load(rows, w, node.rr, request=shape)

    def _reserve(self, node: _Node, now: int, shape: RequestShape) -> int:
        """Coordinator.reserve on the node's view, then reserve.lua's candidate loop: the
        first candidate within its bounds, a re-rank on the whole state when every
        candidate got busier, the least reserved candidate on the last try."""
        c = self.config
        view = node.view
        assert view is not None
        view.ensure(now)
        for attempt in range(c.reserve_retries + 1):
            ids, ties = self._candidates(node, shape, now)
            assert ids, "every simulated instance stays alive"
            candidates = [view.rows[iid] for iid in ids]
            bounds = guard_bounds(candidates, shape, c.weights, now, ties=ties)
            # The walk: the tied candidates by slot (here: index) from the first after
            # the one the pool's last reservation with ties took, then the rest.
            tied = sorted(range(ties), key=lambda i: self.index[candidates[i].id])
            after = [i for i in tied if self.index[candidates[i].id] > self.tie_last]
            start = tied.index(after[0]) if after else 0
            walk = [*tied[start:], *tied[:start], *range(len(tied), len(candidates))]
            least = min(walk, key=lambda i: self.state.inflight(candidates[i].id))
            if attempt == c.reserve_retries or len(candidates) == 1:
                self.forced += attempt == c.reserve_retries
                return self._taken(candidates[least], ties)
            at = self.state.walk(
                [
                    (
                        candidates[i].id,
                        candidates[i].spec.prefill_ms(shape.uncached_on(candidates[i].id)),
                        *bounds[i],
                    )
                    for i in walk
                ],
                now,
            )
            if at is not None:
                return self._taken(candidates[walk[at]], ties)
            self.stale_retries += 1
            view.read(now)  # a 'stale' reply carries the whole state
        raise AssertionError("unreachable: the last try is forced")

    def _candidates(self, node: _Node, shape: RequestShape, now: int) -> tuple[list[str], int]:
        """Coordinator._candidates: a hot prefix's crowded instances last."""
        crowded: frozenset[str] = getattr(shape.cached_tokens, "crowded", frozenset())
        ids, ties, _ = crowded_last(
            lambda out: self._rank(node, shape, now, out), crowded, self.config.top_k
        )
        return ids, ties

    def _taken(self, chosen: InstanceRow, ties: int) -> int:
        """The instance a reserve took; one taken with ties moves the pool's turn."""
        if ties >= 2:
            self.tie_last = self.index[chosen.id]
        return self.index[chosen.id]

    def _affinity_shape(
        self, node: _Node, req: TraceRequest, now: int, expected: int, cached: dict[str, int]
    ) -> RequestShape:
        """The request as the node ranks it: the hot-spot guard on the looked-up cached
        tokens, from its view (coordinator/prefix.py, Coordinator._guard_hot_spots)."""
        c = self.config
        if cached:
            assert node.view is not None
            node.view.ensure(now)
            rows = self._view_rows(node.view, now)
            backlogs = {r.id: r.predicted_total_backlog_ms for r in rows}
            floor = min((b for b in backlogs.values() if b is not None), default=0)
            room = None
            if getattr(cached, "hot", None):  # as Coordinator._guard_hot_spots
                inflight = {r.id: float(r.inflight or 0) for r in rows}
                started = {iid: row.started for iid, row in node.view.rows.items()}
                recent = node.starts.counts(started, now)
                room = idle_fleet_room(inflight, recent, c.prefix_hot_load_pct)
            cached = guarded_cached_tokens(
                cached,
                backlogs.get,
                floor,
                c.prefix_guard_ms,
                c.prefix_hot_guard_ms,
                room,
                cheap_copy_tokens(c.prefix_cache_tokens),
            )
        return RequestShape(req.prompt_tokens, expected, cached)

    def _prefix_baseline(self, req: TraceRequest, cached: dict[str, int]) -> int:
        c = self.config
        if self.strategy == "consistent_hash":
            if not req.blocks:
                return self.central_rr.take() % c.instances
            return self.index[self.ring.owner(req.blocks[0])]
        if self.strategy == "sglang_cache_aware":
            loads = [row.inflight for row in self.state.rows()]
            sizes = [self.prefix_index.size(iid) for iid in self.ids]
            return sglang_choice(self.ids, loads, cached, req.prompt_tokens, sizes, c.sglang)
        uncached = [req.prompt_tokens - cached.get(iid, 0) for iid in self.ids]
        return dynamo_choice(
            self.queued_prefill,
            uncached,
            self.active_tokens,
            c.block_tokens,
            c.dynamo_overlap_weight,
        )

    def _oracle(self, req: TraceRequest) -> int:
        """Smallest exact TTFT; ties go to the engine holding fewer sequences, then rotate."""
        best: list[tuple[float, int, int]] = []
        for k, eng in enumerate(self.engines):
            pending = self.unprefilled[k]
            current = None
            if eng.num_running > len(eng.running):
                current = self.requests[pending[0]].output_tokens
            ttft = exact_ttft_ms(eng, req.prompt_tokens, req.arrival_ms, current)
            best.append((round(ttft, 6), eng.num_running + eng.num_waiting, k))
        low = min(best)
        tied = [k for ttft, held, k in best if (ttft, held) == low[:2]]
        return tied[self.central_rr.take() % len(tied)]

    # ------------------------------------------------------------------ learning

    def _resolve(self) -> list[InstanceSpec]:
        entries = {s.id: (s, 1) for s in self.configured}
        _, resolved = resolve_pool(self.policy, entries, self.records)
        self._sources = [resolved[s.id][1] for s in self.configured]
        return [resolved[s.id][0] for s in self.configured]

    def _observe_prefill(self, r: int, k: int, at: float) -> None:
        """As Coordinator.observe: a wait-free TTFT, screened once learned."""
        req = self.requests[r]
        source = self.state.row(self.ids[k]).timing
        learned = source is not None and source.prefill == "learned"
        predicted = float(self.specs[k].prefill_ms(req.prompt_tokens)) if learned else None
        node = self.nodes[self.node_of[r]]
        node.observations.prefill(self.ids[k], 1, req.prompt_tokens, at - req.arrival_ms, predicted)

    def _observe_decode(self, r: int, k: int, at: float) -> None:
        req = self.requests[r]
        if req.output_tokens < 2:
            return
        source = self.state.row(self.ids[k]).timing
        learned = source is not None and source.decode == "learned"
        node = self.nodes[self.node_of[r]]
        node.observations.decode(
            self.ids[k],
            1,
            self.batch_of[r],
            (at - self.first_token[r]) / (req.output_tokens - 1),
            self.specs[k].decode_ms_per_token if learned else None,
        )

    def _flush(self, node: _Node, now: int) -> None:
        """merge_timing.lua for one node; every node reads the result at once."""
        node.flushed_ms = now
        p = self.policy
        for name, batch in node.observations.drain().items():
            merged = merge_record(
                self.records.get(name), batch, now, p.half_life_ms, p.floor_weight
            )
            if merged is not None:
                self.records[name] = merged
        old = list(zip(self.specs, self._sources, strict=True))
        self.specs = self._resolve()
        for k, spec in enumerate(self.specs):
            if (spec, self._sources[k]) != old[k]:
                self.state.set_timing(spec.id, spec, self._sources[k])

    # ------------------------------------------------------------------ summary

    def tail(self, share: float = 0.01) -> TailReport:
        """Where the slowest `share` of requests went, and how their instance was predicted."""
        done = [r for r in range(len(self.requests)) if not math.isnan(self.first_token[r])]
        done.sort(key=lambda r: self.first_token[r] - self.requests[r].arrival_ms, reverse=True)
        slowest = done[: max(1, round(share * len(done)))]
        by_speed: dict[float, int] = {}
        ratios: list[float] = []
        sources: dict[str, int] = {}
        for r in slowest:
            k = self.instance_of[r]
            speed = self.config.speed(k)
            by_speed[speed] = by_speed.get(speed, 0) + 1
            seen = self.predicted_with[r]
            if seen is not None and seen[0] is not None:
                ratios.append(seen[0] / self.config.engine_timing(k).prefill_ms_per_token)
                sources[seen[1]] = sources.get(seen[1], 0) + 1
        ratios.sort()
        median = ratios[len(ratios) // 2] if ratios else math.nan
        return TailReport(len(slowest), dict(sorted(by_speed.items())), median, sources)

    def _summary(self) -> StrategyResult:
        timing = self.config.timing
        ttfts: list[float] = []
        e2es: list[float] = []
        waits: list[float] = []
        work = [0.0] * self.config.instances
        assigned = [0] * self.config.instances
        for req in self.requests:
            r = req.index
            k = self.instance_of[r]
            own = self.config.engine_timing(k) if k >= 0 else timing
            if k >= 0:
                assigned[k] += 1
                work[k] += service_ms(own, req.prompt_tokens, req.output_tokens)
            if math.isnan(self.finished[r]):
                continue
            ttft = self.first_token[r] - req.arrival_ms
            ttfts.append(ttft)
            e2es.append(self.finished[r] - req.arrival_ms)
            waits.append(max(0.0, ttft - own.prefill_ms(req.prompt_tokens)))
        samples = tuple(ttfts)
        ttfts.sort()
        e2es.sort()
        mean_work = sum(work) / len(work)
        caches = [e.prefix_cache for e in self.engines if e.prefix_cache is not None]
        queried = sum(cache.queries for cache in caches)
        hit_rate = sum(cache.hits for cache in caches) / queried if queried else math.nan
        return StrategyResult(
            strategy=self.strategy,
            requests=len(self.requests),
            completed=len(ttfts),
            ttft_p50_ms=percentile(ttfts, 50),
            ttft_p90_ms=percentile(ttfts, 90),
            ttft_p99_ms=percentile(ttfts, 99),
            e2e_p50_ms=percentile(e2es, 50),
            e2e_p99_ms=percentile(e2es, 99),
            queue_wait_mean_ms=sum(waits) / len(waits) if waits else math.nan,
            imbalance=max(work) / mean_work if mean_work > 0 else 1.0,
            assigned=tuple(assigned),
            ttft_ms=samples,
            prefix_hit_rate=hit_rate,
            wait_p99_ms=percentile(sorted(waits), 99),
        )


def simulate(
    requests: Sequence[TraceRequest],
    strategy: str,
    config: SimConfig | None = None,
    progress: Progress | None = None,
) -> StrategyResult:
    """Run one strategy over a trace (already scaled) and summarize it."""
    return Simulation(requests, strategy, config, progress).run()


def compare(
    requests: Sequence[TraceRequest],
    strategies: Sequence[str] = STRATEGIES,
    config: SimConfig | None = None,
    progress: Progress | None = None,
) -> list[StrategyResult]:
    """Run several strategies over the same trace, in the order given."""
    return [simulate(requests, s, config, progress) for s in strategies]
