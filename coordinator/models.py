"""Plain data types shared by the coordinator, the strategies and the proxy node."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from coordinator.errors import InvalidArgumentError
from coordinator.keys import ID_RE

if TYPE_CHECKING:
    from coordinator.timing import TimingSource

ROLES = ("mixed", "prefill", "decode")
HINT_NAMES = ("engine_running", "engine_waiting", "queue_depth")
# Predictions are clamped to one day (ms): the scripts refuse longer ones
# (MAX_PREDICTED_MS in lua/_lib.lua), and no valid request may hit that refusal.
MAX_PREDICTED_MS = 86_400_000
# Sane ranges of the timing model and capacity (checked at registration, 422).
MAX_MS_PER_TOKEN = 60_000.0  # a minute per token is already no engine
MAX_OVERHEAD_MS = float(MAX_PREDICTED_MS)
MAX_WEIGHT = 1e6
MAX_SLOTS = 1_000_000  # the register script's limit
MAX_PREFIX_CACHE_TOKENS = 10**9  # beyond any engine's KV cache


def _number(
    name: str,
    value: Any,
    *,
    minimum: float = 0.0,
    maximum: float = float("inf"),
    optional: bool = False,
) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgumentError(f"{name} must be a number, got {value!r}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int beyond float range
        finite = False
    if not finite or value < minimum or value > maximum:
        raise InvalidArgumentError(
            f"{name} must be finite and in {minimum:g}..{maximum:g}, got {value}"
        )


def clamp_ms(value: float) -> int:
    """A predicted duration in whole ms, clamped to 0..MAX_PREDICTED_MS."""
    if not value > 0:  # also NaN
        return 0
    if value >= MAX_PREDICTED_MS:
        return MAX_PREDICTED_MS
    return math.ceil(value)


def _utf8(value: Any) -> bool:
    """A str that UTF-8 can carry (JSON decoding lets lone surrogates through)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """What an engine instance declares when it registers."""

    id: str
    url: str
    role: str = "mixed"
    max_slots: int = 0  # 0 = unlimited
    weight: float = 1.0  # relative capacity; scores are divided by it
    prefill_ms_per_token: float | None = None
    prefill_overhead_ms: float | None = None
    decode_ms_per_token: float | None = None
    epoch: int = 0  # 0 = keep the stored epoch (or 1 for a new instance)
    model: str | None = None
    tags: tuple[str, ...] = ()
    # Prefix KV cache the engine keeps, in tokens: bounds the instance's entries in
    # the prefix index (None = the node's Settings.prefix_cache_tokens; 0 = none).
    prefix_cache_tokens: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not ID_RE.fullmatch(self.id):
            raise InvalidArgumentError(
                f"instance id {self.id!r} must match {ID_RE.pattern} (no '|', braces or spaces)"
            )
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
            raise InvalidArgumentError(f"url must be an http(s) URL, got {self.url!r}")
        if self.role not in ROLES:
            raise InvalidArgumentError(f"role must be one of {ROLES}, got {self.role!r}")
        if isinstance(self.max_slots, bool) or not isinstance(self.max_slots, int):
            raise InvalidArgumentError(f"max_slots must be an integer, got {self.max_slots!r}")
        _number("max_slots", self.max_slots, maximum=MAX_SLOTS)
        _number("weight", self.weight, minimum=1e-6, maximum=MAX_WEIGHT)
        for name in ("prefill_ms_per_token", "decode_ms_per_token"):
            _number(name, getattr(self, name), maximum=MAX_MS_PER_TOKEN, optional=True)
        _number(
            "prefill_overhead_ms", self.prefill_overhead_ms, maximum=MAX_OVERHEAD_MS, optional=True
        )
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 0:
            raise InvalidArgumentError(f"epoch must be a non-negative integer, got {self.epoch!r}")
        if self.prefix_cache_tokens is not None and (
            isinstance(self.prefix_cache_tokens, bool)
            or not isinstance(self.prefix_cache_tokens, int)
            or not 0 <= self.prefix_cache_tokens <= MAX_PREFIX_CACHE_TOKENS
        ):
            raise InvalidArgumentError(
                f"prefix_cache_tokens must be an integer in 0..{MAX_PREFIX_CACHE_TOKENS}, "
                f"got {self.prefix_cache_tokens!r}"
            )
        if self.model is not None and not _utf8(self.model):
            raise InvalidArgumentError("model must be a valid UTF-8 string")
        if not all(_utf8(t) for t in self.tags):
            raise InvalidArgumentError("tags must be valid UTF-8 strings")

    @property
    def has_timing(self) -> bool:
        """Whether the timing model needed for predicted pressure is known."""
        return self.prefill_ms_per_token is not None and self.decode_ms_per_token is not None

    def prefill_ms(self, prompt_tokens: int) -> int:
        """Predicted prefill time of a prompt on this instance, in whole ms (clamped)."""
        if not self.has_timing:
            return 0
        per_token = self.prefill_ms_per_token or 0.0
        return clamp_ms((self.prefill_overhead_ms or 0.0) + per_token * prompt_tokens)

    def decode_ms(self, output_tokens: int) -> int:
        """Predicted decode time of an output on this instance, in whole ms (clamped)."""
        if not self.has_timing:
            return 0
        return clamp_ms((self.decode_ms_per_token or 0.0) * output_tokens)

    def to_json(self) -> str:
        """The stored form (epoch lives in its own column)."""
        data = asdict(self)
        data.pop("epoch")
        data["tags"] = list(self.tags)
        if self.prefix_cache_tokens is None:
            del data["prefix_cache_tokens"]  # stored specs stay as they were without it
        return json.dumps(data, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Any) -> InstanceSpec:
        """Build and validate a spec from decoded JSON; raises InvalidArgumentError."""
        if not isinstance(data, dict):
            raise InvalidArgumentError("an instance spec must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise InvalidArgumentError(f"unknown instance fields: {sorted(unknown)}")
        for required in ("id", "url"):
            if required not in data:
                raise InvalidArgumentError(f"missing instance field {required!r}")
        values = dict(data)
        if "tags" in values:
            if not isinstance(values["tags"], list | tuple):
                raise InvalidArgumentError("tags must be a list of strings")
            values["tags"] = tuple(values["tags"])
        return cls(**values)


@dataclass(frozen=True, slots=True)
class RequestShape:
    """What ranking knows of one request: its size, and its prefix already cached where.

    `cached_tokens` maps an instance id to the prompt tokens expected to be in that
    instance's prefix cache; an instance not named has none cached.
    """

    prompt_tokens: int
    expected_output_tokens: int
    cached_tokens: Mapping[str, int] = field(default_factory=dict)

    def cached_on(self, instance_id: str) -> int:
        """Prompt tokens expected cached on an instance (0..prompt_tokens)."""
        return min(max(0, self.cached_tokens.get(instance_id, 0)), self.prompt_tokens)

    def uncached_on(self, instance_id: str) -> int:
        """Prompt tokens the instance would have to prefill."""
        return self.prompt_tokens - self.cached_on(instance_id)


@dataclass(frozen=True, slots=True)
class Hint:
    """One engine hint and the Redis time it was reported at."""

    value: float
    at_ms: int


@dataclass(slots=True)
class InstanceRow:
    """One instance's raw state as stored in Redis (absolute Redis times)."""

    id: str
    spec: InstanceSpec
    epoch: int
    last_seen_ms: int
    max_slots: int
    inflight: int
    pending_prefill: int
    active_decode: int
    prefill_free_at_ms: int
    earliest_end_at_ms: int | None
    hints: dict[str, Hint] = field(default_factory=dict)
    # Set when `spec` carries resolved timing (configured, learned, pool or default).
    timing: TimingSource | None = None
    # Reservations ever placed on the instance's slot, modulo packed.STARTED_WRAP.
    started: int = 0


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """Pressure of one instance at the snapshot's Redis time; None means unknown."""

    id: str
    url: str
    role: str
    weight: float
    epoch: int
    alive: bool
    last_seen_age_ms: int
    max_slots: int
    inflight: int | None
    pending_prefill_count: int | None
    active_decode_count: int | None
    next_slot_ready_in_ms: int | None
    prefill_free_in_ms: int | None
    predicted_total_backlog_ms: int | None
    engine_running: float | None
    engine_waiting: float | None
    queue_depth: float | None
    hint_ages_ms: dict[str, int]
    spec: InstanceSpec
    timing: TimingSource | None = None  # where spec's timing came from, when resolved

    def predicted_ttft_ms(self, prompt_tokens: int) -> int | None:
        """Backlog plus this request's own prefill estimate; None without a timing model."""
        if self.predicted_total_backlog_ms is None:
            return None
        return self.predicted_total_backlog_ms + self.spec.prefill_ms(prompt_tokens)

    def _timing_view(self) -> dict[str, Any]:
        assert self.timing is not None
        return {
            "prefill_ms_per_token": self.spec.prefill_ms_per_token,
            "prefill_overhead_ms": self.spec.prefill_overhead_ms,
            "decode_ms_per_token": self.spec.decode_ms_per_token,
            **self.timing.as_dict(),
        }

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready view (numbers and names only; no payloads)."""
        data = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "spec"}
        data["model"] = self.spec.model
        data["has_timing_model"] = self.spec.has_timing
        data["timing"] = None if self.timing is None else self._timing_view()
        return data


@dataclass(frozen=True, slots=True)
class Reservation:
    """One request's claim on one instance."""

    rid: str
    instance_id: str
    url: str
    epoch: int
    predicted_ttft_ms: int | None
    prefill_ms: int
    decode_ms: int
    prompt_tokens: int
    expected_output_tokens: int
    degraded: bool = False
    # The ranking's scores (coordinator/strategies.py Score by instance id): `score` reads
    # the chosen instance's, which a lazy ranking builds only then.
    scores: Mapping[str, Any] | None = None
    cached_tokens: int = 0  # prompt tokens expected in the chosen instance's prefix cache
    # No other prefill was pending on the instance when it was reserved: the request's
    # TTFT is its own prefill (a learning sample), not a wait behind others.
    prefill_alone: bool = False
    batch: int = 0  # the instance's live reservations, this one included, when reserved

    @property
    def score(self) -> Any:
        """The strategy's Score for the chosen instance (explainability), or None."""
        return None if self.scores is None else self.scores.get(self.instance_id)
