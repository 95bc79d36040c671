"""Settings: one frozen dataclass, every knob with a default, validated at start-up."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from coordinator.errors import InvalidArgumentError
from coordinator.keys import POOL_NAME_RE

STRATEGIES = ("least_load", "round_robin", "power_of_two")
FULL_POLICIES = ("reject", "queue")


@dataclass(frozen=True, slots=True)
class Weights:
    """least_load weights; the field defaults are the seed's (DESIGN.md §3): preset `seed`."""

    inflight: float = 1.0  # lifecycle layer
    engine_running: float = 1.0  # instantaneous layer
    engine_waiting: float = 0.25
    queue_depth: float = 0.25
    pending_prefill: float = 1.0  # predicted layer
    active_decode: float = 0.5
    backlog_ms: float = 0.001
    ttft_ms: float = 0.0  # request-aware: backlog + own uncached prefill (needs the request)
    prefill_ms: float = 0.0  # request-aware: own uncached prefill, the work it adds (ditto)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidArgumentError(f"weight {f.name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise InvalidArgumentError(f"weight {f.name} must be finite and >= 0, got {value}")

    @classmethod
    def preset(cls, name: str) -> Weights:
        """Named weights (WEIGHT_PRESETS)."""
        if name not in WEIGHT_PRESETS:
            raise InvalidArgumentError(
                f"unknown weights preset {name!r}; choose from {sorted(WEIGHT_PRESETS)}"
            )
        return WEIGHT_PRESETS[name]

    @classmethod
    def parse(cls, text: str) -> Weights:
        """Parse `[preset,]name=value,...`; unnamed weights keep the preset's (default: seed)."""
        values: dict[str, float] = {}
        known = {f.name for f in fields(cls)}
        items = [part.strip() for part in text.split(",") if part.strip()]
        base = cls()
        if items and "=" not in items[0]:
            base = cls.preset(items.pop(0))
        for item in items:
            name, sep, raw = item.partition("=")
            if not sep or name.strip() not in known:
                raise InvalidArgumentError(
                    f"bad weight {item!r}; expected name=value with name in {sorted(known)}"
                )
            try:
                values[name.strip()] = float(raw)
            except ValueError:
                raise InvalidArgumentError(f"weight {name} is not a number: {raw!r}") from None
        return replace(base, **values)

    def as_dict(self) -> dict[str, float]:
        """The weights as a plain dict (for debug output)."""
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}


# Named weights. `seed`: the seed's formula exactly (DESIGN.md §3). `ttft`: the same
# layers, with the predicted wait counted as this request's predicted TTFT on each
# candidate (backlog + own uncached prefill, ms) at 0.2 per ms: 5 ms of predicted TTFT
# weigh one request, so a prefill of seconds ahead outweighs any queue of short ones
# (docs/benchmarks.md measures both). Its own uncached prefill counts once more, at
# the same 0.2 per ms (`prefill_ms`): that is engine time every later request on the
# instance waits behind, so a cache that saves it is worth more than the wait it
# saves this request. Equal on every candidate without a cache credit (same timing),
# it changes nothing there.
WEIGHT_PRESETS: dict[str, Weights] = {
    "seed": Weights(),
    "ttft": Weights(backlog_ms=0.0, ttft_ms=0.2, prefill_ms=0.2),
}
DEFAULT_WEIGHTS = "ttft"  # what Settings (and so `coordinator serve`) uses by default


@dataclass(frozen=True, slots=True)
class Settings:
    """Coordinator settings. `from_env()` reads COORD_<NAME> variables."""

    key_prefix: str = "lc"  # first part of every key; ACLs match `~lc:*`
    instance_ttl_ms: int = 10_000  # an instance is alive while now - last_seen <= ttl
    heartbeat_interval_ms: int = 3_000  # what registration answers tell engines to use
    hint_ttl_ms: int = 5_000  # an engine hint older than this counts as missing
    lease_ms: int = 10_000  # node lease; renewed every lease/3, reaped after expiry
    top_k: int = 8  # ranked candidates sent to the reserve script (fewer retries than 4)
    reserve_retries: int = 3  # re-scores after all candidates changed; then forced
    enforce_max_slots: bool = False  # refuse to exceed an instance's max_slots
    full_policy: str = "reject"  # when all are full: reject (429) or queue
    queue_timeout_ms: int = 5_000  # longest wait for a slot under the queue policy
    redis_timeout_ms: int = 100  # socket timeout of every Redis call
    recovery_interval_ms: int = 500  # how often a degraded node probes Redis
    # Replies keep a node's view current while only it changes the pool; with peers
    # it falls behind until a stale answer or this age brings the whole state.
    # reserve re-checks the candidates' load, so an old view can cost a retry but
    # never herding.
    snapshot_max_age_ms: int = 500  # 0 = read the pool state before every decision
    # Beyond this many live nodes each node re-reads the whole state proportionally less
    # often (by age; a stale answer still brings it at once), so the pool serves about
    # as many whole reads per second with 64 nodes as with this many.
    snapshot_nodes: int = 8
    # A view that missed at least one change per instance no longer tells which are
    # least busy, and every node's stale view points at the same ones: least_load then
    # ranks a random sample of this many eligible instances (power of d choices), so
    # concurrent nodes' candidates differ. 0 = always rank every instance.
    stale_sample: int = 16
    live_refresh_ms: int = 2_000  # liveness and hints are re-read this often (<= ttl/4)
    # first_token_soon/release_soon (the proxy's) ride on the node's next reserve, or
    # go in one call after this long: one Redis call per request instead of three.
    carry_ms: int = 20  # 0 = send each at once
    # The fleet checks the pool's bookkeeping against itself at most this often (one
    # bounded step, in a lease renewal), and rebuilds the pool from the nodes when a
    # key was lost or edited outside the scripts (docs/reliability.md). 0 = never.
    audit_interval_ms: int = 5_000
    strategy: str = "least_load"  # default selection strategy
    weights: Weights = field(default_factory=lambda: Weights.preset(DEFAULT_WEIGHTS))
    # Prefix-cache affinity (coordinator/prefix.py, docs/security.md).
    prefix_affinity: bool = True  # look up and record prompt prefix blocks
    prefix_salt: str = ""  # deployment secret mixed into block hashes; set it in production
    prefix_block_chars: int = 1024  # characters per block (~256 tokens at chars/4)
    prefix_max_blocks: int = 128  # blocks hashed, looked up and recorded per request
    prefix_cache_tokens: int = 400_000  # index capacity of an instance whose spec has none
    prefix_max_owners: int = 8  # instances remembered per block (most recent)
    prefix_record_stride: int = 8  # index every Nth block of a prompt and its last; 1 = all
    prefix_guard_ms: int = 10_000  # cache credit fades over this much extra backlog; 0 = off
    prefix_hot_guard_ms: int = 3_000  # the same for a hot prefix (0: prefix_guard_ms)
    prefix_hot_ms: int = 3_000  # routed this recently under another prompt: hot; 0 = none
    # A short or popular hot prefix goes first to instances within this percentage of
    # their share of requests (bounded loads, coordinator/prefix.py idle_fleet_room:
    # of the pool's in flight and the fleet's recent ones while an instance is idle,
    # else to holders within their share of the fleet's recent ones); 0 = off.
    prefix_hot_load_pct: int = 125
    # Learned timing (coordinator/timing.py; README "Prediction sources").
    timing_flush_ms: int = 2_000  # how often a node merges its samples and reads the pool's
    timing_flush_nodes: int = 8  # beyond this many live nodes each merges less often
    timing_min_samples: int = 8  # learned timing replaces configured from this many samples
    timing_half_life_ms: int = 10_000  # learned statistics lose half their weight this often
    timing_pinned: bool = False  # configured timing always wins over learned

    def __post_init__(self) -> None:
        if not self.key_prefix or not POOL_NAME_RE.fullmatch(self.key_prefix):
            raise InvalidArgumentError(f"key_prefix {self.key_prefix!r} is not a plain name")
        for name in (
            "instance_ttl_ms",
            "heartbeat_interval_ms",
            "hint_ttl_ms",
            "lease_ms",
            "queue_timeout_ms",
            "redis_timeout_ms",
            "recovery_interval_ms",
            "live_refresh_ms",
            "timing_flush_ms",
            "timing_flush_nodes",
            "timing_min_samples",
            "timing_half_life_ms",
            "snapshot_nodes",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}")
        if self.snapshot_max_age_ms < 0:
            raise InvalidArgumentError("snapshot_max_age_ms must be >= 0")
        if (
            isinstance(self.carry_ms, bool)
            or not isinstance(self.carry_ms, int)
            or not (0 <= self.carry_ms <= 1_000)
        ):
            raise InvalidArgumentError(
                f"carry_ms must be an integer in 0..1000, got {self.carry_ms!r}"
            )
        if not 1 <= self.top_k <= 64:
            raise InvalidArgumentError(f"top_k must be in 1..64, got {self.top_k}")
        if self.stale_sample != 0 and not self.top_k <= self.stale_sample <= 100_000:
            raise InvalidArgumentError(
                f"stale_sample must be 0 or in top_k..100000, got {self.stale_sample}"
            )
        if not 0 <= self.reserve_retries <= 16:
            raise InvalidArgumentError(
                f"reserve_retries must be in 0..16, got {self.reserve_retries}"
            )
        if self.full_policy not in FULL_POLICIES:
            raise InvalidArgumentError(f"full_policy must be one of {FULL_POLICIES}")
        if self.strategy not in STRATEGIES:
            raise InvalidArgumentError(f"strategy must be one of {STRATEGIES}")
        for name, low, high in (
            ("audit_interval_ms", 0, 86_400_000),
            ("prefix_block_chars", 16, 1 << 20),
            ("prefix_max_blocks", 1, 512),
            ("prefix_cache_tokens", 0, 10**9),
            ("prefix_max_owners", 1, 64),
            ("prefix_record_stride", 1, 512),
            ("prefix_guard_ms", 0, 86_400_000),
            ("prefix_hot_guard_ms", 0, 86_400_000),
            ("prefix_hot_ms", 0, 86_400_000),
            ("prefix_hot_load_pct", 0, 1_000),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise InvalidArgumentError(f"{name} must be an integer in {low}..{high}")
        if 0 < self.prefix_hot_load_pct < 100:
            raise InvalidArgumentError("prefix_hot_load_pct must be 0 (off) or in 100..1000")
        if self.heartbeat_interval_ms >= self.instance_ttl_ms:
            raise InvalidArgumentError("heartbeat_interval_ms must be below instance_ttl_ms")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Build settings from COORD_* variables, then apply explicit overrides."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(f"COORD_{f.name.upper()}")
            if raw is None:
                continue
            values[f.name] = _parse_field(f.name, f.type, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def with_(self, **changes: Any) -> Settings:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


def _parse_field(name: str, type_name: Any, raw: str) -> Any:
    if name == "weights":
        return Weights.parse(raw)
    if type_name in ("bool", bool):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise InvalidArgumentError(f"COORD_{name.upper()} must be a boolean, got {raw!r}")
    if type_name in ("int", int):
        try:
            return int(raw)
        except ValueError:
            raise InvalidArgumentError(f"COORD_{name.upper()} must be an integer") from None
    return raw
