"""`coordinator bench live`: replay a trace slice through a real local cluster, next to the sim.

For each strategy a fresh `local_fleet.cluster.LocalCluster` (Redis, proxy nodes and
self-registering mock engines, all real processes on 127.0.0.1) is started with that
strategy; the proxy picks its strategy per process, not per request. The trace slice
is scaled to the target utilization exactly as `coordinator bench sim` scales it, then
replayed `--speed` times faster than recorded: every request goes to the nodes
round-robin as a streaming chat completion whose prompt is `ContextTokens * 4`
characters (the shared chars/4 rule gives the count back), with
`max_tokens = GeneratedTokens` and `X-Mock-Output-Tokens: GeneratedTokens`.

TTFT is measured at the client, from sending the request to the first SSE `data:`
chunk; end-to-end to the end of the stream. Times are reported in engine time (real
time x speed), the simulator's unit, and the sim runs the same slice with the same
fleet. Because the nodes send `max_tokens`, the sim reserves the true output length
(`expected_output="true"`).

The mock engines divide every duration by the speed, so the nodes' time-based knobs
are divided too (through their COORD_* environment), otherwise the live fleet would
see hints that are `speed` times staler and a backlog weight `speed` times smaller
than the fleet the simulator models:

- engine hints are scraped every `SCRAPE_ENGINE_MS` of engine time (the sim's
  `hint_interval_ms`) and expire after `HINT_TTL_ENGINE_MS`;
- least_load's `backlog_ms`, `ttft_ms` and `prefill_ms` weights are multiplied by the
  speed, and the prefix hot-spot guard and hot window divided by it, as the times the
  nodes compute are real ms;
- how old a node's view of the pool may get (`snapshot_max_age_ms`, `live_refresh_ms`),
  how long it holds first-token marks and releases (`carry_ms`) and how often it
  merges learned timing (`timing_flush_ms`) are divided by it (`NODE_TIMES`), and the
  sim's nodes keep their views for the same engine time. A view that is `speed` times
  older in engine time sees `speed` times more of the other nodes' reservations
  late; on Mooncake's long prompts (issue 16) that alone made live TTFT p50 1.43x
  the sim's at speed 1.5.

Prefix caching (`--prefix-cache-tokens`, for traces with `hash_ids`): the mock engines
keep a prefix cache of that many tokens, and each trace block id becomes the same
deterministic text wherever it occurs (`block_text`), so the nodes' and the engines'
block hashing see the trace's sharing; blocks are `TRACE_BLOCK_TOKENS` tokens on both
sides. The live `least_load` (affinity on, the node default) is then compared with
the sim's `least_load_affinity`, and the hit rate read from the engines' vLLM prefix
cache counters with the sim's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import random
import shlex
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from bench.sim.cli import add_heterogeneity_arguments, add_workload_arguments
from bench.sim.report import json_ready
from bench.sim.simulator import SimConfig, StrategyResult, compare
from bench.sim.synthetic import load_requests, workload_name
from bench.sim.traces import (
    TRACE_BLOCK_TOKENS,
    TraceError,
    TraceRequest,
    offered_load,
    scale_to_utilization,
)
from coordinator.settings import DEFAULT_WEIGHTS, STRATEGIES, WEIGHT_PRESETS, Settings, Weights
from coordinator.timing import relative_error
from coordinator.tokens import CHARS_PER_TOKEN
from local_fleet.engine_model import EngineTiming
from local_fleet.pools import delete_pool
from local_fleet.stats import percentile

OUTPUT_TOKENS_HEADER = "X-Mock-Output-Tokens"  # local_fleet.mock_engine honours it
AGREEMENT = 0.20  # live TTFT p50 within this fraction of the sim's counts as agreeing
SCRAPE_ENGINE_MS = 1000.0  # engine-time hint scrape period (the sim's default interval)
HINT_TTL_ENGINE_MS = Settings().hint_ttl_ms  # engine-time hint expiry (the sim's default)
MIN_SCRAPE_S = 0.05  # the nodes never scrape faster than this, whatever the speed
# --speed auto: the fastest replay that keeps the whole Python cluster and the client
# (one 2-core machine, shared) out of the measurement. Measured: beyond ~1,500 streamed
# tokens/s or ~30 requests/s (real) the client's sends run late whenever other processes
# load the machine, and TTFT drifts from the sim (at 50 requests/s: 0.98x to 1.29x).
AUTO_TOKENS_PER_S = 1500.0
AUTO_REQUESTS_PER_S = 30.0
AUTO_MAX_SPEED = 10.0
AUTO_MIN_SPEED = 1.0
START_LEAD_S = 0.25  # the first send is scheduled this long after the replay starts
# Concurrent tiny requests per node before the replay: they open the client's, the
# nodes' and the engines' keep-alive connections and load the Lua scripts, so the
# trace's first burst does not pay one-off start-up costs that the sim does not model.
WARMUP_PER_NODE = 4
# Auto-picked ports stay below Linux's ephemeral range (32768+), where any process's
# outgoing connections could take one between our check and the child's bind.
START_ATTEMPTS = 3  # with auto-picked ports, a start that fails is retried on a new block
PROGRESS_EVERY_S = 2.0  # stderr progress period
PREDICTION_WARMUP = 150  # requests before prediction accuracy is counted (learning first)
FILLER = "lorem ipsum dolor sit amet consectetur adipiscing elit "  # ASCII: 1 char = 1 byte
BLOCK_CHARS = TRACE_BLOCK_TOKENS * CHARS_PER_TOKEN  # one trace block as text (chars/4 rule)

# The nodes' time knobs (ms) that the live bench divides by the speed, their defaults
# in engine time; the sim gets the same engine times (LiveConfig.node_times).
NODE_TIMES = ("snapshot_max_age_ms", "live_refresh_ms", "carry_ms", "timing_flush_ms")
NODE_TIMES_ZERO_OK = ("snapshot_max_age_ms", "carry_ms")  # 0 is valid (the others: >= 1)
MAX_CARRY_MS = 1000  # the most Settings.carry_ms accepts

Progress = Callable[[str], None]


# ---------------------------------------------------------------------------
# Configuration and results.


@dataclass(frozen=True, slots=True)
class LiveConfig:
    """Parameters of the live fleet and the replay."""

    instances: int = 4  # mock engines
    nodes: int = 3  # proxy nodes; requests go to them round-robin
    speed: float | None = None  # engines run this many times faster; None = auto_speed()
    base_port: int | None = None  # LocalCluster base port; None = pick a free block
    redis_url: str | None = None  # None = a private embedded server per cluster
    seed: int = 0  # the sim's seed
    request_timeout_s: float = 120.0  # one request, real seconds (streaming included)
    start_timeout_s: float = 60.0  # cluster start-up, real seconds
    prefix_cache_tokens: int = 0  # each mock engine's prefix cache (and the sim's); 0 = none
    speeds: tuple[float, ...] = ()  # relative engine speeds, cycled (engine j: speed x this)
    registered_timing: str = "exact"  # exact | none | shared (what the engines register)
    max_prompt_tokens: int | None = None  # prompts longer than this are cut to it
    max_output_tokens: int | None = None  # outputs longer than this are cut to it

    def __post_init__(self) -> None:
        if self.instances < 1 or self.nodes < 1:
            raise ValueError("instances and nodes must be >= 1")
        if self.speed is not None and not (math.isfinite(self.speed) and self.speed > 0):
            raise ValueError(f"speed must be a finite number > 0, got {self.speed}")
        if self.request_timeout_s <= 0 or self.start_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")
        if self.prefix_cache_tokens < 0:
            raise ValueError("prefix_cache_tokens must be >= 0")
        if any(not (math.isfinite(v) and v > 0) for v in self.speeds):
            raise ValueError("speeds must be finite and > 0")
        if self.registered_timing not in ("exact", "none", "shared"):
            raise ValueError("registered_timing must be exact, none or shared")
        for cap in (self.max_prompt_tokens, self.max_output_tokens):
            if cap is not None and cap < 1:
                raise ValueError("token caps must be >= 1")

    def relative_speed(self, j: int) -> float:
        """Engine j's speed relative to the fleet's base speed."""
        return self.speeds[j % len(self.speeds)] if self.speeds else 1.0

    @property
    def capacity(self) -> float:
        """The fleet's capacity in base-speed engines (what utilization divides by)."""
        return sum(self.relative_speed(j) for j in range(self.instances))

    def engine_args(self) -> list[list[str]]:
        """Per engine: its --speed and what it registers."""
        out = []
        for j in range(self.instances):
            args = ["--speed", repr(self.rate * self.relative_speed(j))]
            if self.registered_timing == "none":
                args += ["--register-timing", "none"]
            elif self.registered_timing == "shared":
                args += ["--register-speed", repr(self.rate)]
            out.append(args)
        return out

    @property
    def rate(self) -> float:
        """The speed, once resolved (run_live resolves auto before anything starts)."""
        if self.speed is None:
            raise ValueError("speed is auto: resolve it with auto_speed() first")
        return self.speed

    @property
    def scrape_interval_s(self) -> float:
        """Real seconds between the nodes' engine scrapes."""
        return max(MIN_SCRAPE_S, SCRAPE_ENGINE_MS / 1000.0 / self.rate)

    @property
    def hint_ttl_ms(self) -> int:
        """Real ms a hint stays fresh (at least two scrape periods)."""
        return max(
            math.ceil(2000 * self.scrape_interval_s), math.ceil(HINT_TTL_ENGINE_MS / self.rate)
        )

    def weights(self, preset: str = DEFAULT_WEIGHTS) -> Weights:
        """least_load weights for the live nodes: the ms-valued ones per real ms."""
        w = Weights.preset(preset)
        return replace(
            w,
            backlog_ms=w.backlog_ms * self.rate,
            ttft_ms=w.ttft_ms * self.rate,
            prefill_ms=w.prefill_ms * self.rate,
        )

    def node_times(self) -> dict[str, int]:
        """The NODE_TIMES knobs of the live nodes in real ms: their defaults / the speed."""
        s = Settings()
        times = {
            name: max(0 if name in NODE_TIMES_ZERO_OK else 1, round(getattr(s, name) / self.rate))
            for name in NODE_TIMES
        }
        times["carry_ms"] = min(times["carry_ms"], MAX_CARRY_MS)
        return times

    def node_env(self, preset: str = DEFAULT_WEIGHTS) -> dict[str, str]:
        """COORD_* variables that put the nodes' time-based knobs on engine time."""
        weights = ",".join(f"{k}={v!r}" for k, v in self.weights(preset).as_dict().items())
        return {
            **{f"COORD_{name.upper()}": str(ms) for name, ms in self.node_times().items()},
            "COORD_SCRAPE_INTERVAL_S": repr(self.scrape_interval_s),
            "COORD_HINT_TTL_MS": str(self.hint_ttl_ms),
            "COORD_WEIGHTS": weights,
            "COORD_REQUEST_TIMEOUT_S": repr(self.request_timeout_s),
            "COORD_PREFIX_BLOCK_CHARS": str(BLOCK_CHARS),
            "COORD_PREFIX_GUARD_MS": str(round(Settings().prefix_guard_ms / self.rate)),
            "COORD_PREFIX_HOT_GUARD_MS": str(round(Settings().prefix_hot_guard_ms / self.rate)),
            "COORD_PREFIX_HOT_MS": str(round(Settings().prefix_hot_ms / self.rate)),
        }

    def prefix_engine_args(self) -> list[str]:
        """Mock engine flags of every engine: the prefix cache, cut in the nodes' blocks."""
        return [
            "--prefix-cache-tokens",
            str(self.prefix_cache_tokens),
            "--prefix-block-chars",
            str(BLOCK_CHARS),
        ]

    def sim_strategy(self, strategy: str) -> str:
        """The sim's name for what the live nodes run under a strategy name."""
        if strategy == "least_load" and self.prefix_cache_tokens > 0:
            return "least_load_affinity"  # the node default: affinity on
        return strategy

    def sim_config(self, preset: str = DEFAULT_WEIGHTS) -> SimConfig:
        """The simulated fleet that matches this live one, in engine time."""
        times = self.node_times()
        return SimConfig(
            instances=self.instances,
            nodes=self.nodes,
            hint_interval_ms=self.scrape_interval_s * 1000.0 * self.rate,
            hint_ttl_ms=round(self.hint_ttl_ms * self.rate),
            expected_output="true",  # the nodes reserve max_tokens = the true output
            seed=self.seed,
            prefix_cache_tokens=self.prefix_cache_tokens,
            weights=Weights.preset(preset),
            speeds=self.speeds,
            registered_timing=self.registered_timing,
            learn=True,  # the nodes always learn; registered exact timing stays close
            timing_flush_ms=round(times["timing_flush_ms"] * self.rate),
            snapshot_max_age_ms=round(times["snapshot_max_age_ms"] * self.rate),
            live_refresh_ms=round(
                min(times["live_refresh_ms"], Settings().instance_ttl_ms / 4) * self.rate
            ),
        )


def split_variant(name: str) -> tuple[str, str]:
    """`least_load:seed` -> (least_load, seed); a bare strategy uses the default weights."""
    strategy, _, preset = name.partition(":")
    return strategy, preset or DEFAULT_WEIGHTS


def variant_list(text: str) -> list[str]:
    """--strategies: strategies, each optionally with a weights preset (`least_load:seed`)."""
    names = list(STRATEGIES) if text == "all" else [p.strip() for p in text.split(",") if p]
    for name in names:
        strategy, preset = split_variant(name)
        if strategy not in STRATEGIES or preset not in WEIGHT_PRESETS:
            raise argparse.ArgumentTypeError(
                f"bad strategy {name!r}: use one of {', '.join(STRATEGIES)}, optionally "
                f"with :preset from {', '.join(sorted(WEIGHT_PRESETS))}"
            )
    return names


@dataclass(slots=True)
class Outcome:
    """What the client saw of one request (real seconds, loop clock)."""

    index: int
    node: int
    due_s: float  # scheduled send time
    sent_s: float = math.nan  # actual send time
    first_s: float = math.nan  # first SSE data chunk
    end_s: float = math.nan  # end of the stream
    status: int = 0
    instance: str = ""
    error: str = ""
    predicted_ms: float = math.nan  # X-Predicted-TTFT-Ms (real ms), when present

    @property
    def ok(self) -> bool:
        """Completed: 200, a first chunk, and the stream ended with [DONE]."""
        return self.status == 200 and not self.error and not math.isnan(self.end_s)


@dataclass(frozen=True, slots=True)
class LiveResult:
    """One strategy's live run, latencies in engine ms (real ms x speed)."""

    strategy: str
    requests: int
    completed: int
    failed: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float
    assigned: dict[str, int]  # requests per instance id (from X-Instance-Id)
    lateness_p50_ms: float  # real ms: actual send - scheduled send
    lateness_p99_ms: float
    replay_s: float  # real seconds from the first scheduled send to the last stream end
    output_tokens_per_s: float  # real-time streamed-token rate across the fleet
    errors: tuple[str, ...] = ()  # a few distinct failure reasons
    prefix_hit_rate: float = math.nan  # engines' vllm:prefix_cache_hits / queries
    wait_p99_ms: float = math.nan  # engine ms: TTFT minus the request's own prefill
    predicted_share: float = math.nan  # after warm-up: requests with X-Predicted-TTFT-Ms
    prediction_error_p50: float = math.nan  # after warm-up: |observed - predicted| / observed
    prediction_error_p90: float = math.nan
    learned: dict[str, dict[str, Any]] = field(default_factory=dict)  # per instance, at the end

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready view."""
        return {
            "strategy": self.strategy,
            "requests": self.requests,
            "completed": self.completed,
            "failed": self.failed,
            "ttft_p50_ms": self.ttft_p50_ms,
            "ttft_p90_ms": self.ttft_p90_ms,
            "ttft_p99_ms": self.ttft_p99_ms,
            "e2e_p50_ms": self.e2e_p50_ms,
            "e2e_p99_ms": self.e2e_p99_ms,
            "assigned": dict(self.assigned),
            "lateness_p50_ms": self.lateness_p50_ms,
            "lateness_p99_ms": self.lateness_p99_ms,
            "replay_s": self.replay_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "errors": list(self.errors),
            "prefix_hit_rate": self.prefix_hit_rate,
            "wait_p99_ms": self.wait_p99_ms,
            "predicted_share": self.predicted_share,
            "prediction_error_p50": self.prediction_error_p50,
            "prediction_error_p90": self.prediction_error_p90,
            "learned": self.learned,
        }


@dataclass(frozen=True, slots=True)
class Comparison:
    """One strategy, simulated and live, on the same slice."""

    live: LiveResult
    sim: StrategyResult
    speed: float = 1.0  # engine ms per real ms of the live run

    @property
    def ratio(self) -> float:
        """live TTFT p50 / sim TTFT p50."""
        base = self.sim.ttft_p50_ms
        return self.live.ttft_p50_ms / base if base > 0 else math.nan

    @property
    def agree(self) -> bool:
        """Live TTFT p50 within AGREEMENT of the sim's (and every request completed)."""
        return abs(self.ratio - 1.0) <= AGREEMENT and self.live.failed == 0

    def check_line(self) -> str:
        """The agreement check, with its numbers."""
        verdict = "PASS" if self.agree else "FAIL"
        failed = f", {self.live.failed} failed" if self.live.failed else ""
        return (
            f"{verdict} {self.live.strategy}: sim and live agree: live TTFT p50 "
            f"{_ms(self.live.ttft_p50_ms)} ms within {AGREEMENT:.0%} of sim TTFT p50 "
            f"{_ms(self.sim.ttft_p50_ms)} ms (ratio {self.ratio:.2f}{failed}; "
            f"client send lateness p99 {self.live.lateness_p99_ms:.1f} ms real)" + self.client_note
        )

    @property
    def client_note(self) -> str:
        """A warning when the client's own lag is as large as the agreement band."""
        lag_ms = self.live.lateness_p99_ms * self.speed
        band_ms = AGREEMENT * self.sim.ttft_p50_ms
        if not lag_ms > band_ms:
            return ""
        return (
            f" — the client lagged {lag_ms:,.0f} ms of engine time at p99, more than the "
            f"{band_ms:,.0f} ms band: the load generator, not the fleet, is suspect"
        )


@dataclass(frozen=True, slots=True)
class LiveRun:
    """One trace slice, one fleet, several strategies, live and simulated."""

    trace: str | None  # None: the built-in synthetic workload
    offset: int
    limit: int
    utilization: float | None  # None = replayed as recorded
    offered: float
    span_ms: float  # engine-time arrival span after scaling
    output_tokens: int
    config: LiveConfig
    comparisons: list[Comparison]
    runtime_s: float

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready view (NaN becomes null)."""
        c = self.config
        out = {
            "trace": self.trace,
            "offset": self.offset,
            "limit": self.limit,
            "requests": self.comparisons[0].live.requests if self.comparisons else 0,
            "utilization_target": self.utilization,
            "offered_utilization": self.offered,
            "span_ms": self.span_ms,
            "output_tokens": self.output_tokens,
            "config": {
                "instances": c.instances,
                "nodes": c.nodes,
                "speed": c.rate,
                "seed": c.seed,
                "node_env": c.node_env(),
                "sim_hint_interval_ms": c.sim_config().hint_interval_ms,
                "sim_hint_ttl_ms": c.sim_config().hint_ttl_ms,
                "agreement": AGREEMENT,
            },
            "results": [
                {
                    **cmp.live.as_dict(),
                    "sim": cmp.sim.as_dict(),
                    "ttft_p50_ratio": cmp.ratio,
                    "agree": cmp.agree,
                }
                for cmp in self.comparisons
            ],
            "runtime_s": self.runtime_s,
        }
        finite: dict[str, Any] = json_ready(out)
        return finite


# ---------------------------------------------------------------------------
# The trace slice and the requests built from it.


def load_slice(
    path: str | Path | None,
    offset: int,
    limit: int,
    utilization: float | None,
    instances: float,
    timing: EngineTiming | None = None,
    seed: int = 0,
    caps: tuple[int | None, int | None] = (None, None),
) -> list[TraceRequest]:
    """Requests offset..offset+limit of a trace (None: the synthetic workload from
    `seed`), re-based to 0, prompts and outputs cut to `caps`, scaled like the sim does.

    `instances` is the fleet's capacity in base-speed engines (LiveConfig.capacity)."""
    source = path or "the synthetic workload"
    if offset < 0 or limit < 1:
        raise TraceError(f"{source}: need offset >= 0 and limit >= 1")
    rows = load_requests(path, offset + limit, seed)[offset:]
    if not rows:
        raise TraceError(f"{source}: no requests after offset {offset}")
    first = rows[0].arrival_ms
    prompt_cap, output_cap = caps
    rows = [
        replace(
            r,
            index=i,
            arrival_ms=r.arrival_ms - first,
            prompt_tokens=min(r.prompt_tokens, prompt_cap or r.prompt_tokens),
            output_tokens=min(r.output_tokens, output_cap or r.output_tokens),
        )
        for i, r in enumerate(rows)
    ]
    if utilization is not None:
        rows = scale_to_utilization(rows, timing or EngineTiming(), instances, utilization)
    return rows


def auto_speed(requests: Sequence[TraceRequest]) -> float:
    """The largest speed (1..10, one decimal) within the AUTO_* real-time load budgets."""
    span_s = (requests[-1].arrival_ms - requests[0].arrival_ms) / 1000.0
    if len(requests) < 2 or span_s <= 0:
        return AUTO_MIN_SPEED
    tokens_per_s = sum(r.output_tokens for r in requests) / span_s  # engine time
    requests_per_s = (len(requests) - 1) / span_s
    speed = min(
        AUTO_MAX_SPEED,
        AUTO_TOKENS_PER_S / tokens_per_s if tokens_per_s > 0 else AUTO_MAX_SPEED,
        AUTO_REQUESTS_PER_S / requests_per_s,
    )
    return max(AUTO_MIN_SPEED, math.floor(speed * 10) / 10)


@functools.lru_cache(maxsize=65536)
def block_text(block: int) -> str:
    """The deterministic text of one trace block id: `BLOCK_CHARS` ASCII characters."""
    words = FILLER.split()
    rng = random.Random(block)
    text = f"<block {block}> " + " ".join(rng.choice(words) for _ in range(BLOCK_CHARS // 4))
    return text[:BLOCK_CHARS]


def trace_prompt(req: TraceRequest) -> str:
    """A request's prompt: its blocks' texts in order (cut to its length), or filler
    that starts with the request's index, so prompts of a trace without prefix blocks
    share no prefix (one filler for all would look like one giant shared prefix to the
    nodes' prefix index and the engines' caches)."""
    if not req.blocks:
        return prompt_text(req.prompt_tokens, req.index)
    size = req.prompt_tokens * CHARS_PER_TOKEN
    return "".join(block_text(b) for b in req.blocks)[:size]


def prompt_text(tokens: int, request: int | None = None) -> str:
    """Synthetic ASCII text of exactly `tokens * CHARS_PER_TOKEN` characters; with
    `request`, it starts with that number (a prefix no other request shares)."""
    size = tokens * CHARS_PER_TOKEN
    head = "" if request is None else f"<request {request}> "
    return (head + FILLER * (size // len(FILLER) + 1))[:size]


def build_request(req: TraceRequest, model: str = "mock") -> tuple[bytes, dict[str, str]]:
    """The JSON body and headers of one replayed request (streaming chat completion)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": trace_prompt(req)}],
        "max_tokens": req.output_tokens,
        "stream": True,
    }
    headers = {
        "Content-Type": "application/json",
        OUTPUT_TOKENS_HEADER: str(req.output_tokens),
        "X-Request-Id": f"live-{req.index}-{random.getrandbits(32):08x}",
    }
    return json.dumps(body, separators=(",", ":")).encode(), headers


# ---------------------------------------------------------------------------
# The client: a time-scaled open-loop replay.


async def _send(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: dict[str, str],
    out: Outcome,
) -> None:
    loop = asyncio.get_running_loop()
    out.sent_s = loop.time()
    tail = b""
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            out.status = resp.status
            out.instance = resp.headers.get("X-Instance-Id", "")
            with contextlib.suppress(ValueError):
                out.predicted_ms = float(resp.headers.get("X-Predicted-TTFT-Ms", ""))
            if resp.status != 200:
                detail = (await resp.content.read(200)).decode("utf-8", "replace")
                out.error = f"HTTP {resp.status}: {detail}".strip()
                return
            async for chunk in resp.content.iter_any():
                if math.isnan(out.first_s) and b"data:" in chunk:
                    out.first_s = loop.time()
                tail = (tail + chunk)[-32:]
            end = loop.time()
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        out.error = f"{type(exc).__name__}: {exc}".rstrip(": ")
        return
    if math.isnan(out.first_s) or b"[DONE]" not in tail:
        out.error = "stream ended without [DONE]"
        return
    out.end_s = end


async def warm_up(session: aiohttp.ClientSession, urls: Sequence[str], per_node: int) -> int:
    """Send `per_node` one-token requests to every node at once; how many completed."""
    outcomes = [Outcome(-1, k, 0.0) for k in range(len(urls)) for _ in range(per_node)]
    # One build per request: each gets its own X-Request-Id (the nodes' reservation id).
    sends = [
        _send(session, urls[o.node], *build_request(TraceRequest(i, 0.0, 1, 1)), o)
        for i, o in enumerate(outcomes)
    ]
    await asyncio.gather(*sends)
    return sum(1 for o in outcomes if o.ok)


async def replay(
    requests: Sequence[TraceRequest],
    node_urls: Sequence[str],
    speed: float,
    *,
    request_timeout_s: float = 120.0,
    warmup_per_node: int = WARMUP_PER_NODE,
    label: str = "live",
    progress: Progress | None = None,
) -> list[Outcome]:
    """Send every request at its (scaled) arrival time, round-robin over the nodes."""
    prepared = [build_request(r) for r in requests]  # built ahead: the send path stays light
    urls = [f"{u.rstrip('/')}/v1/chat/completions" for u in node_urls]
    loop = asyncio.get_running_loop()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    outcomes: list[Outcome] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if warmup_per_node > 0:
            warm = await warm_up(session, urls, warmup_per_node)
            if progress is not None:
                progress(f"{label}: warm-up {warm}/{warmup_per_node * len(urls)} completed")
        start = loop.time() + START_LEAD_S
        tasks: list[asyncio.Task[None]] = []
        reporter = (
            asyncio.create_task(_report(label, outcomes, len(requests), start, progress))
            if progress is not None
            else None
        )
        try:
            for req, (body, headers) in zip(requests, prepared, strict=True):
                node = req.index % len(urls)
                out = Outcome(req.index, node, start + req.arrival_ms / 1000.0 / speed)
                outcomes.append(out)
                delay = out.due_s - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(_send(session, urls[node], body, headers, out)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if reporter is not None:
                reporter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reporter
    return outcomes


async def _report(
    label: str, outcomes: list[Outcome], total: int, start: float, progress: Progress
) -> None:
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(PROGRESS_EVERY_S)
        sent = sum(1 for o in outcomes if not math.isnan(o.sent_s))
        done = sum(1 for o in outcomes if o.ok)
        failed = sum(1 for o in outcomes if o.error)
        progress(
            f"{label}: sent {sent}/{total}, completed {done}, failed {failed}, "
            f"{loop.time() - start:.1f}s"
        )


def summarize(
    strategy: str,
    requests: Sequence[TraceRequest],
    outcomes: Sequence[Outcome],
    speed: float,
    relative_speeds: dict[str, float] | None = None,
) -> LiveResult:
    """Percentiles in engine ms, per-instance counts, client lateness, token rate, the
    queueing wait (`relative_speeds`: instance id -> speed relative to `speed`) and the
    accuracy of X-Predicted-TTFT-Ms after PREDICTION_WARMUP requests."""
    to_engine_ms = 1000.0 * speed
    ok = [o for o in outcomes if o.ok]
    timing = EngineTiming()
    rel = relative_speeds or {}
    waits = sorted(
        max(
            0.0,
            (o.first_s - o.due_s) * to_engine_ms
            - timing.prefill_ms(requests[o.index].prompt_tokens) / rel.get(o.instance, 1.0),
        )
        for o in ok
    )
    warm = [o for o in ok if o.index >= PREDICTION_WARMUP] or ok
    predicted = [o for o in warm if not math.isnan(o.predicted_ms)]
    errors_rel = sorted(
        relative_error((o.first_s - o.sent_s) * 1000.0, o.predicted_ms) for o in predicted
    )
    # From the scheduled arrival, not the actual send: a client that falls behind must
    # not make the fleet look faster (coordinated omission); lateness is shown apart.
    ttft = sorted((o.first_s - o.due_s) * to_engine_ms for o in ok)
    e2e = sorted((o.end_s - o.due_s) * to_engine_ms for o in ok)
    late = sorted(
        max(0.0, o.sent_s - o.due_s) * 1000.0 for o in outcomes if not math.isnan(o.sent_s)
    )
    assigned = Counter(o.instance for o in outcomes if o.instance)
    ends = [o.end_s for o in ok]
    replay_s = (max(ends) - min(o.due_s for o in outcomes)) if ends else math.nan
    tokens = sum(requests[o.index].output_tokens for o in ok)
    errors = sorted({o.error for o in outcomes if o.error})[:5]
    return LiveResult(
        strategy=strategy,
        requests=len(outcomes),
        completed=len(ok),
        failed=len(outcomes) - len(ok),
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p90_ms=percentile(ttft, 90),
        ttft_p99_ms=percentile(ttft, 99),
        e2e_p50_ms=percentile(e2e, 50),
        e2e_p99_ms=percentile(e2e, 99),
        assigned=dict(sorted(assigned.items(), key=lambda kv: _natural(kv[0]))),
        lateness_p50_ms=percentile(late, 50),
        lateness_p99_ms=percentile(late, 99),
        replay_s=replay_s,
        output_tokens_per_s=tokens / replay_s if replay_s and replay_s > 0 else math.nan,
        errors=tuple(errors),
        wait_p99_ms=percentile(waits, 99),
        predicted_share=len(predicted) / len(warm) if warm else math.nan,
        prediction_error_p50=percentile(errors_rel, 50),
        prediction_error_p90=percentile(errors_rel, 90),
    )


def learned_timing(view: Any) -> dict[str, dict[str, Any]]:
    """Per instance, the timing a node predicted with and where it came from."""
    out: dict[str, dict[str, Any]] = {}
    for row in view.get("instances", []) if isinstance(view, dict) else []:
        timing = row.get("timing") or {}
        out[str(row.get("id"))] = {
            "prefill_ms_per_token": timing.get("prefill_ms_per_token"),
            "decode_ms_per_token": timing.get("decode_ms_per_token"),
            "prefill": timing.get("prefill"),
            "prefill_samples": timing.get("prefill_samples"),
        }
    return out


def _natural(text: str) -> tuple[str, int]:
    head = text.rstrip("0123456789")
    tail = text[len(head) :]
    return (head, int(tail) if tail else -1)


# ---------------------------------------------------------------------------
# Clusters.


async def prefix_hit_rate(engine_urls: Sequence[str]) -> float:
    """Cached / queried prompt tokens over the engines' vLLM prefix cache counters."""
    hits = queries = 0.0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for url in engine_urls:
            async with session.get(f"{url}/metrics") as resp:
                text = await resp.text()
            hits += _counter(text, "vllm:prefix_cache_hits_total")
            queries += _counter(text, "vllm:prefix_cache_queries_total")
    return hits / queries if queries else math.nan


def _counter(text: str, name: str) -> float:
    """The sum of a metric's samples in a Prometheus text exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def run_strategy(
    requests: Sequence[TraceRequest],
    strategy: str,
    config: LiveConfig,
    progress: Progress | None = None,
) -> LiveResult:
    """Start a fresh cluster with `strategy` (`name[:weights preset]`), replay the
    requests, read what the nodes learned, stop it, summarize."""
    from local_fleet.cluster import (  # only the live bench needs them
        LocalCluster,
        free_port_block,
        http_json,
    )

    name, preset = split_variant(strategy)
    tag = strategy.replace("_", "-").replace(":", "-")
    pool = f"live-{tag}-{os.getpid()}-{random.getrandbits(24):06x}"
    learned: dict[str, dict[str, Any]] = {}
    cluster: LocalCluster | None = None
    try:
        for attempt in range(1, START_ATTEMPTS + 1):
            base = config.base_port or free_port_block(config.nodes, config.instances)
            cluster = LocalCluster(
                nodes=config.nodes,
                engines=config.instances,
                base_port=base,
                redis_url=config.redis_url,
                speed=config.rate,
                pool=pool,
                strategy=name,
                node_env=config.node_env(preset),
                engine_args=config.prefix_engine_args(),
                per_engine_args=config.engine_args(),
            )
            if progress is not None:
                progress(
                    f"live: {strategy}: starting redis, {config.nodes} nodes, "
                    f"{config.instances} engines (ports {base}+)"
                )
            try:
                cluster.start(timeout_s=config.start_timeout_s)
                break
            except RuntimeError as exc:  # start() has stopped whatever it had started
                if config.base_port is not None or attempt == START_ATTEMPTS:
                    raise
                if progress is not None:
                    progress(f"live: {strategy}: start failed ({exc}); retrying on other ports")
        assert cluster is not None
        outcomes = asyncio.run(
            replay(
                requests,
                cluster.node_urls,
                config.rate,
                request_timeout_s=config.request_timeout_s,
                label=f"live: {strategy}",
                progress=progress,
            )
        )
        hit_rate = asyncio.run(prefix_hit_rate(cluster.engine_urls))
        views = [http_json(url + "/debug/instance_loads") for url in cluster.control_urls]
        learned = learned_timing(views[0])
        kept = keep_if_piled(cluster, outcomes, views, config.instances)
        if kept and progress is not None:
            progress(f"live: {strategy}: one engine took over {PILED:g}x its share: {kept}")
    finally:
        if cluster is not None:
            cluster.stop()
        if config.redis_url is not None:
            with contextlib.suppress(Exception):  # clean-up only: the run's result stands
                delete_pool(config.redis_url, pool)
    relative = {f"engine-{j}": config.relative_speed(j) for j in range(config.instances)}
    result = replace(
        summarize(strategy, requests, outcomes, config.rate, relative),
        learned=learned,
        prefix_hit_rate=hit_rate,
    )
    for iid, row in learned.items():
        row["true_prefill_ms_per_token"] = EngineTiming().prefill_ms_per_token / (
            config.rate * relative.get(iid, 1.0)
        )
    if progress is not None:
        progress(
            f"live: {strategy}: {result.completed}/{result.requests} completed, "
            f"TTFT p50 {_ms(result.ttft_p50_ms)} ms (engine), "
            f"lateness p99 {result.lateness_p99_ms:.1f} ms (real)"
        )
    return result


# A run whose busiest engine took more than this many times the mean keeps its nodes'
# and engines' logs and every node's /debug/instance_loads for a look afterwards.
PILED = 2.0


def keep_if_piled(
    cluster: Any, outcomes: Sequence[Outcome], views: Sequence[Any], instances: int
) -> str:
    """Where a piled-up run's logs and node views were kept ('' when not piled)."""
    counts = Counter(o.instance for o in outcomes if o.instance)
    if not counts or max(counts.values()) <= PILED * sum(counts.values()) / instances:
        return ""
    into = Path(tempfile.mkdtemp(prefix="coordinator-live-piled-"))
    cluster.keep_logs(into)
    for k, view in enumerate(views):
        (into / f"node-{k}-instance_loads.json").write_text(json.dumps(view, indent=1))
    (into / "requests_per_instance.json").write_text(json.dumps(dict(counts), indent=1))
    return str(into)


def slice_requests(
    trace: str | Path | None,
    offset: int,
    limit: int,
    utilization: float | None,
    config: LiveConfig | None = None,
    progress: Progress | None = None,
) -> tuple[list[TraceRequest], LiveConfig]:
    """The slice's requests as a live run sends them, and `config` with its speed chosen
    (`--speed auto`)."""
    config = config or LiveConfig()
    requests = load_slice(
        trace,
        offset,
        limit,
        utilization,
        config.capacity,
        EngineTiming(),  # what LocalCluster's mock engines and the sim both run
        seed=config.seed,
        caps=(config.max_prompt_tokens, config.max_output_tokens),
    )
    if config.speed is None:
        config = replace(config, speed=auto_speed(requests))
        if progress is not None:
            progress(f"live: --speed auto chose {config.rate:g}")
    return requests, config


def run_live(
    trace: str | Path | None,
    *,
    offset: int = 0,
    limit: int = 400,
    utilization: float | None = 0.8,
    strategies: Sequence[str] = STRATEGIES,
    config: LiveConfig | None = None,
    progress: Progress | None = None,
) -> LiveRun:
    """Simulate, then replay live, every strategy on the same slice."""
    started = time.monotonic()
    requests, config = slice_requests(trace, offset, limit, utilization, config, progress)
    sim_config = config.sim_config()
    offered = (
        offered_load(requests, sim_config.timing, config.capacity)
        if len(requests) > 1
        else math.nan
    )
    sims = []
    for variant in strategies:
        name, preset = split_variant(variant)
        sim = compare(requests, [config.sim_strategy(name)], config.sim_config(preset))[0]
        sims.append(replace(sim, strategy=variant))
    if progress is not None:
        progress(
            "sim: " + ", ".join(f"{s.strategy} TTFT p50 {_ms(s.ttft_p50_ms)} ms" for s in sims)
        )
    comparisons = []
    for strategy, sim in zip(strategies, sims, strict=True):
        live = run_strategy(requests, strategy, config, progress)
        comparisons.append(Comparison(live, sim, config.rate))
    return LiveRun(
        trace=None if trace is None else str(trace),
        offset=offset,
        limit=limit,
        utilization=utilization,
        offered=offered,
        span_ms=requests[-1].arrival_ms - requests[0].arrival_ms,
        output_tokens=sum(r.output_tokens for r in requests),
        config=config,
        comparisons=comparisons,
        runtime_s=time.monotonic() - started,
    )


# ---------------------------------------------------------------------------
# Rendering.


def _ms(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:,.0f}"


def describe(run: LiveRun) -> str:
    """One line of what was replayed."""
    c = run.config
    n = run.comparisons[0].live.requests if run.comparisons else 0
    util = "as recorded" if run.utilization is None else f"{run.utilization:g}"
    return (
        f"{n} requests of {workload_name(run.trace, c.seed)} (from request {run.offset}), "
        f"utilization {util} (offered {run.offered:.3f}, arrivals over "
        f"{run.span_ms / 1000:,.1f} s of engine time), {c.instances} mock engines, "
        f"{c.nodes} proxy nodes, speed {c.rate:g} "
        f"(real time = engine time / {c.rate:g}); hints scraped every "
        f"{c.sim_config().hint_interval_ms:,.0f} ms of engine time in both, node views "
        f"read again once {c.sim_config().snapshot_max_age_ms:,} ms old; "
        f"{run.output_tokens:,} output tokens; total runtime {run.runtime_s:.0f} s"
    )


def live_table(run: LiveRun) -> str:
    """Live latencies (engine ms) per strategy, with the client's health columns."""
    lines = [
        "| strategy | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | e2e p50 ms | e2e p99 ms "
        "| completed | failed | per instance | send lateness p99 (real ms) | tokens/s (real) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for cmp in run.comparisons:
        r = cmp.live
        per = " / ".join(str(v) for v in r.assigned.values()) or "-"
        lines.append(
            f"| {r.strategy} | {_ms(r.ttft_p50_ms)} | {_ms(r.ttft_p90_ms)} "
            f"| {_ms(r.ttft_p99_ms)} | {_ms(r.e2e_p50_ms)} | {_ms(r.e2e_p99_ms)} "
            f"| {r.completed}/{r.requests} | {r.failed} | {per} "
            f"| {r.lateness_p99_ms:.1f} | {r.output_tokens_per_s:,.0f} |"
        )
    return "\n".join(lines)


def prediction_table(run: LiveRun) -> str:
    """Queueing wait and the accuracy of X-Predicted-TTFT-Ms, per strategy."""
    lines = [
        "| strategy | wait p99 ms | TTFT p90 ms | X-Predicted-TTFT-Ms present "
        f"(after {PREDICTION_WARMUP}) | relative error p50 | relative error p90 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for cmp in run.comparisons:
        r = cmp.live
        lines.append(
            f"| {r.strategy} | {_ms(r.wait_p99_ms)} | {_ms(r.ttft_p90_ms)} "
            f"| {r.predicted_share:.1%} | {r.prediction_error_p50:.2f} "
            f"| {r.prediction_error_p90:.2f} |"
        )
    return "\n".join(lines)


def learned_table(run: LiveRun) -> str:
    """What the nodes predicted each engine's prefill with at the end of each run."""
    lines = [
        "| strategy | instance | source | samples | prefill ms/token (real) | true | error |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for cmp in run.comparisons:
        for iid, row in cmp.live.learned.items():
            value, true = row.get("prefill_ms_per_token"), row.get("true_prefill_ms_per_token")
            if not isinstance(value, int | float) or not isinstance(true, int | float):
                continue
            lines.append(
                f"| {cmp.live.strategy} | {iid} | {row.get('prefill')} "
                f"| {row.get('prefill_samples')} | {value:.3f} | {true:.3f} "
                f"| {abs(value - true) / true:.0%} |"
            )
    return "\n".join(lines)


def comparison_table(run: LiveRun) -> str:
    """Sim next to live, TTFT p50 with their ratio, and p99 / e2e for context."""
    lines = [
        "| strategy | sim TTFT p50 ms | live TTFT p50 ms | live / sim | sim TTFT p99 ms "
        "| live TTFT p99 ms | sim e2e p50 ms | live e2e p50 ms | sim per instance |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for cmp in run.comparisons:
        s, r = cmp.sim, cmp.live
        lines.append(
            f"| {r.strategy} | {_ms(s.ttft_p50_ms)} | {_ms(r.ttft_p50_ms)} | {cmp.ratio:.2f} "
            f"| {_ms(s.ttft_p99_ms)} | {_ms(r.ttft_p99_ms)} | {_ms(s.e2e_p50_ms)} "
            f"| {_ms(r.e2e_p50_ms)} | {' / '.join(str(v) for v in s.assigned)} |"
        )
    return "\n".join(lines)


def markdown(run: LiveRun, command: Sequence[str] | None = None) -> str:
    """The full report: what, the live table, sim vs live, the checks, the command."""
    parts = [
        describe(run) + ".",
        "",
        "Live (engine ms = real ms x speed, measured at the client):",
        "",
        live_table(run),
        "",
        "Queueing wait (TTFT minus the request's own prefill, engine ms) and prediction "
        "accuracy (|observed - predicted| / observed, real ms at the client):",
        "",
        prediction_table(run),
        "",
        "Learned timing at the end of each run (node 0's /debug/instance_loads):",
        "",
        learned_table(run),
        "",
        "Simulated vs live, same slice and fleet:",
        "",
        comparison_table(run),
        "",
        *(f"- {cmp.check_line()}" for cmp in run.comparisons),
    ]
    errors = [e for cmp in run.comparisons for e in cmp.live.errors]
    if errors:
        parts += ["", "Failures seen: " + "; ".join(f"`{e}`" for e in errors[:5])]
    if command:
        parts += ["", f"Regenerate: `{shlex.join(command)}`"]
    return "\n".join(parts)


# ---------------------------------------------------------------------------
# Command line.


def _speed(text: str) -> float | None:
    if text == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"speed must be a number > 0 or 'auto', got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `bench live`."""
    d = LiveConfig()
    add_workload_arguments(parser)
    parser.add_argument("--limit", type=int, default=400, help="requests replayed")
    parser.add_argument("--offset", type=int, default=0, help="skip this many requests first")
    parser.add_argument("--instances", type=int, default=d.instances, help="mock engines")
    parser.add_argument("--nodes", type=int, default=d.nodes, help="proxy nodes")
    parser.add_argument(
        "--speed",
        type=_speed,
        default="auto",  # argparse runs string defaults through `type`: None
        metavar="S",
        help="engines and arrivals run S times faster than recorded; auto: "
        f"at most {AUTO_MAX_SPEED:g}, lower when the replay would stream more than "
        f"{AUTO_TOKENS_PER_S:,.0f} tokens/s or {AUTO_REQUESTS_PER_S:g} requests/s in real time",
    )
    parser.add_argument(
        "--strategies",
        type=variant_list,
        default=list(STRATEGIES),
        help=f"comma list from {', '.join(STRATEGIES)} (or 'all'); a weights preset may "
        f"follow a strategy, e.g. least_load:seed (presets: {', '.join(sorted(WEIGHT_PRESETS))};"
        f" default {DEFAULT_WEIGHTS})",
    )
    add_heterogeneity_arguments(parser)
    parser.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="cut longer prompts to this many tokens (the sim gets the same slice)",
    )
    parser.add_argument(
        "--max-output-tokens",
        type=int,
        default=None,
        help="cut longer outputs to this many tokens (max_tokens stays the true output)",
    )
    parser.add_argument(
        "--redis-url",
        default=None,
        help="use this Redis (one fresh pool per strategy, deleted after) "
        "instead of a private embedded server per cluster",
    )
    parser.add_argument(
        "--base-port",
        type=int,
        default=None,
        help="LocalCluster base port (nodes base+2k, engines base+100+j); default: a free block",
    )
    parser.add_argument(
        "--seed", type=int, default=d.seed, help="seed of the sim and of the synthetic workload"
    )
    parser.add_argument(
        "--request-timeout-s",
        type=float,
        default=d.request_timeout_s,
        help="limit of one request in real seconds (bounds the run)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def command(args: argparse.Namespace, speed: float | None = None) -> list[str]:
    """The command line that reproduces a run (defaults left out, the speed pinned)."""
    d = LiveConfig()
    cmd = ["coordinator", "bench", "live"]
    if args.trace is not None:
        cmd += ["--trace", str(args.trace)]
    if args.limit != 400:
        cmd += ["--limit", str(args.limit)]
    if args.offset:
        cmd += ["--offset", str(args.offset)]
    cmd += ["--utilization", f"{args.utilization:g}"]
    if args.instances != d.instances:
        cmd += ["--instances", str(args.instances)]
    if args.nodes != d.nodes:
        cmd += ["--nodes", str(args.nodes)]
    speed = args.speed if speed is None else speed
    if speed is not None:
        cmd += ["--speed", f"{speed:g}"]
    if list(args.strategies) != list(STRATEGIES):
        cmd += ["--strategies", ",".join(args.strategies)]
    if args.seed != d.seed:
        cmd += ["--seed", str(args.seed)]
    if args.speeds:
        cmd += ["--speeds", ",".join(f"{v:g}" for v in args.speeds)]
    if args.registered_timing != "exact":
        cmd += ["--registered-timing", args.registered_timing]
    if args.max_prompt_tokens is not None:
        cmd += ["--max-prompt-tokens", str(args.max_prompt_tokens)]
    if args.max_output_tokens is not None:
        cmd += ["--max-output-tokens", str(args.max_output_tokens)]
    return cmd


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """Run the comparison; exit 0 when it ran (agreement is reported, not enforced)."""
    try:
        config = LiveConfig(
            instances=args.instances,
            nodes=args.nodes,
            speed=args.speed,
            base_port=args.base_port,
            redis_url=args.redis_url,
            seed=args.seed,
            request_timeout_s=args.request_timeout_s,
            speeds=args.speeds,
            registered_timing=args.registered_timing,
            max_prompt_tokens=args.max_prompt_tokens,
            max_output_tokens=args.max_output_tokens,
        )
        result = run_live(
            args.trace,
            offset=args.offset,
            limit=args.limit,
            utilization=args.utilization or None,
            strategies=args.strategies,
            config=config,
            progress=None if args.quiet else _stderr,
        )
    except (TraceError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.as_dict(), indent=2, allow_nan=False))
    else:
        print(markdown(result, command(args, result.config.rate)))
    return 0


__all__ = [
    "AGREEMENT",
    "Comparison",
    "LiveConfig",
    "LiveResult",
    "LiveRun",
    "Outcome",
    "build_request",
    "load_slice",
    "markdown",
    "prompt_text",
    "replay",
    "run_live",
    "run_strategy",
    "summarize",
]
