"""Learned timing: per-instance prefill and decode speed, and output length per model.

Every node observes its own requests (`Observations`) and every few seconds merges
them into the pool's `timing` hash with one script (lua/merge_timing.lua), which
holds time-decayed sufficient statistics of two weighted line fits per instance:

- prefill: TTFT of a request that found no other prefill ahead of it, against its
  uncached prompt tokens -> `prefill_overhead_ms + prefill_ms_per_token * tokens`;
- decode: ms per output token after the first, against the instance's running
  batch -> `decode_base_ms + decode_ms_per_seq * batch`;

and, per model, the mean output length. `merge_record` here is the same merge in
Python (the simulator uses it; the tests hold the script to it).

A record is `[epoch, at_ms, *group, ...]`, a group `[n, w, sx, sy, sxx, sxy]`: `n`
samples ever merged (never decayed), the rest decayed by half every
`half_life_ms`, but never below `floor_weight` (an idle instance keeps its estimate
and still moves quickly once traffic returns). A batch of a newer epoch restarts
the record; one of an older epoch is dropped.

`TimingPolicy.resolve` turns a spec and its record into the timing that predicts:
configured values are pinned (`pinned=True`) or else a prior that `min_samples`
learned samples replace; an instance with neither uses the pool's learned average
(`pool`), and an empty pool the documented defaults (`default`). With 1 to
`min_samples - 1` samples of its own (too few to fit a line), the instance is
`scaled`: that prior's line times the speed ratio its own samples show, shrunk
towards 1 by `prior_weight` pseudo-samples. The prior alone is not that instance's
speed: on a mixed fleet the fast instances learn first (they are idle more often,
and only wait-free requests teach prefill), so a slow instance predicted with the
pool's average (or one shared configured timing) looks fast and is overloaded for
as long as it stays unlearned, which under load is long.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack

from coordinator.models import InstanceSpec

GROUP = 6  # n, w, sx, sy, sxx, sxy
PREFILL, DECODE = 0, 1  # group positions in an instance record
OUTPUT_FIELD = "|output|"  # + model name: never an instance id (ids have no '|')
# Defaults before anything is configured or learned: a 7-8B model on one modern GPU
# (local_fleet/engine_model.py's EngineTiming at speed 1).
DEFAULT_PREFILL_MS_PER_TOKEN = 0.08
DEFAULT_PREFILL_OVERHEAD_MS = 10.0
DEFAULT_DECODE_MS_PER_TOKEN = 16.0
DEFAULT_OUTPUT_TOKENS = 256
# A sample this many times off the prediction is dropped (a stall, a cold start);
# within it, a sample moves the fit at most CLIP times the prediction either way.
REJECT = 8.0
CLIP = 3.0
SOURCES = ("configured", "learned", "scaled", "pool", "default")


def empty_record(epoch: int, groups: int, at_ms: int = 0) -> list[float]:
    """A record with no samples."""
    return [epoch, at_ms, *([0.0] * (GROUP * groups))]


def add_sample(record: list[float], group: int, x: float, y: float, weight: float = 1.0) -> None:
    """Fold one (x, y) sample into a group of a record, in place."""
    g = 2 + GROUP * group
    record[g] += 1
    record[g + 1] += weight
    record[g + 2] += weight * x
    record[g + 3] += weight * y
    record[g + 4] += weight * x * x
    record[g + 5] += weight * x * y


def merge_record(
    stored: list[float] | None,
    batch: list[float],
    now_ms: int,
    half_life_ms: float,
    floor_weight: float,
) -> list[float] | None:
    """The merged record (lua/merge_timing.lua, operation by operation); None: unchanged."""
    if stored is None or len(stored) != len(batch) or batch[0] > stored[0]:
        stored = empty_record(int(batch[0]), (len(batch) - 2) // GROUP, now_ms)
    elif batch[0] < stored[0]:
        return None
    out = list(stored)
    decay = 1.0
    if now_ms > out[1]:
        decay = 2.0 ** (-(now_ms - out[1]) / half_life_ms)
    for g in range(2, len(out), GROUP):
        w = out[g + 1]
        f = decay
        if w * f < floor_weight:
            f = floor_weight / w if w > floor_weight else 1.0
        out[g] = out[g] + batch[g]
        for j in range(1, GROUP):
            out[g + j] = out[g + j] * f + batch[g + j]
    out[1] = now_ms
    return out


def flush_interval_ms(flush_ms: int, flush_nodes: int, half_life_ms: int, live_nodes: int) -> float:
    """How long a node waits between merges (Settings.timing_flush_ms and
    timing_flush_nodes): `flush_ms` while the pool has at most `flush_nodes` live nodes,
    proportionally longer beyond, so the pool takes at most `flush_nodes` merges per
    `flush_ms`; but never longer than the half-life (nor below `flush_ms`), since a
    merge stamps its samples with the time it runs and older ones would pass for fresh."""
    stretched = flush_ms * max(1.0, live_nodes / flush_nodes)
    return max(float(flush_ms), min(stretched, float(half_life_ms)))


def pack(record: list[float]) -> str:
    """A record as the hex of its msgpack (what the script stores and returns)."""
    data = msgpack.packb([float(v) if k >= 2 else int(v) for k, v in enumerate(record)])
    return bytes(data).hex()


def unpack(raw: str | bytes) -> list[float] | None:
    """A stored record, or None when it is not one."""
    try:
        text = raw.decode() if isinstance(raw, bytes) else raw
        value = msgpack.unpackb(bytes.fromhex(text))
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        return None
    if (
        not isinstance(value, list)
        or len(value) < 2 + GROUP
        or (len(value) - 2) % GROUP
        or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
        or not all(math.isfinite(v) for v in value)
    ):
        return None
    return [float(v) for v in value]


@dataclass(frozen=True, slots=True)
class Line:
    """A fitted `intercept + slope * x`, from `samples` samples."""

    intercept: float
    slope: float
    samples: int
    mean_x: float

    def at(self, x: float) -> float:
        """The fitted value at x."""
        return self.intercept + self.slope * x


def fit(record: list[float], group: int, prior_intercept: float) -> Line | None:
    """Weighted least squares of a group, slope and intercept kept >= 0; None if empty.

    Without spread in x the slope is not identified: the prior intercept is kept
    and the slope explains the mean.
    """
    g = 2 + GROUP * group
    n, w, sx, sy, sxx, sxy = record[g : g + GROUP]
    if n < 1 or w <= 0:
        return None
    mx, my = sx / w, sy / w
    vxx = sxx / w - mx * mx
    if vxx > 1e-9 * (1.0 + mx * mx):
        slope = (sxy / w - mx * my) / vxx
        intercept = my - slope * mx
    else:
        intercept = min(prior_intercept, my)
        slope = (my - intercept) / mx if mx > 0 else 0.0
    if slope < 0:
        slope, intercept = 0.0, my
    if intercept < 0:
        intercept, slope = 0.0, (sxy / sxx if sxx > 0 else 0.0)
    return Line(intercept, max(0.0, slope), int(n), mx)


def screened(sample: float, predicted: float | None) -> float | None:
    """Outlier rejection and bounded movement: None drops the sample, else its clipped value."""
    if predicted is None or predicted <= 0:
        return sample
    if sample > REJECT * predicted or sample * REJECT < predicted:
        return None
    return min(max(sample, predicted / CLIP), predicted * CLIP)


def own_ratio(
    record: list[float] | None, group: int, overhead: float, per_x: float, prior_weight: float
) -> float | None:
    """Observed / predicted by the line `overhead + per_x * x` over a group's samples,
    shrunk towards 1 by `prior_weight` pseudo-samples and bounded to [1/REJECT, REJECT];
    None without samples or without a positive prediction."""
    if record is None:
        return None
    g = 2 + GROUP * group
    n, w, sx, sy = record[g : g + 4]
    predicted = overhead * w + per_x * sx  # the line summed over the (weighted) samples
    if n < 1 or w <= 0 or predicted <= 0:
        return None
    ratio = (sy / (predicted / w) + prior_weight) / (w + prior_weight)
    return min(max(ratio, 1.0 / REJECT), REJECT)


@dataclass(frozen=True, slots=True)
class TimingSource:
    """Where an instance's predicting timing comes from, for operators."""

    prefill: str  # configured | learned | scaled | pool | default
    decode: str
    prefill_samples: int
    decode_samples: int
    decode_ms_per_seq: float | None  # learned batch slope, when learned

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready view."""
        return {
            "prefill": self.prefill,
            "decode": self.decode,
            "prefill_samples": self.prefill_samples,
            "decode_samples": self.decode_samples,
            "decode_ms_per_seq": self.decode_ms_per_seq,
        }


@dataclass(frozen=True, slots=True)
class TimingPolicy:
    """How configured, learned and default timing combine (Settings timing_* knobs)."""

    min_samples: int = 8  # learned values replace configured ones from this many samples
    pinned: bool = False  # configured values always win over learned ones
    half_life_ms: int = 10_000  # learned statistics lose half their weight this often
    floor_weight: float = 4.0  # decay stops at this many samples' weight
    prior_weight: float = 2.0  # pseudo-samples of the prior in a `scaled` estimate

    def resolve(
        self,
        spec: InstanceSpec,
        epoch: int,
        record: list[float] | None,
        pool: InstanceSpec | None,
    ) -> tuple[InstanceSpec, TimingSource]:
        """The spec with the timing that predicts, and where each part came from."""
        if record is not None and int(record[0]) != epoch:
            record = None  # another epoch's speed: start over from the prior
        pre = fit(record, PREFILL, spec.prefill_overhead_ms or 0.0) if record else None
        dec = fit(record, DECODE, 0.0) if record else None
        configured_prefill = spec.prefill_ms_per_token is not None
        configured_decode = spec.decode_ms_per_token is not None
        values: dict[str, float | None] = {}
        if configured_prefill and self.pinned:
            prefill_source = "configured"
            values["prefill_overhead_ms"] = spec.prefill_overhead_ms or 0.0
        elif pre is not None and pre.samples >= self.min_samples:
            prefill_source = "learned"
            values["prefill_ms_per_token"] = pre.slope
            values["prefill_overhead_ms"] = pre.intercept
        else:
            if configured_prefill:
                prefill_source = "configured"
                per_token = spec.prefill_ms_per_token or 0.0
                overhead = spec.prefill_overhead_ms or 0.0
            elif pool is not None and pool.prefill_ms_per_token is not None:
                prefill_source = "pool"
                per_token = pool.prefill_ms_per_token
                overhead = pool.prefill_overhead_ms or 0.0
            else:
                prefill_source = "default"
                per_token, overhead = DEFAULT_PREFILL_MS_PER_TOKEN, DEFAULT_PREFILL_OVERHEAD_MS
            ratio = own_ratio(record, PREFILL, overhead, per_token, self.prior_weight)
            if ratio is not None:
                prefill_source = "scaled"
                per_token, overhead = per_token * ratio, overhead * ratio
            values["prefill_ms_per_token"] = per_token
            values["prefill_overhead_ms"] = overhead
        if configured_decode and self.pinned:
            decode_source = "configured"
        elif dec is not None and dec.samples >= self.min_samples:
            decode_source = "learned"
            # At the batch this instance has been running: what a new request shares.
            values["decode_ms_per_token"] = dec.at(dec.mean_x)
        else:
            if configured_decode:
                decode_source, per_token = "configured", spec.decode_ms_per_token or 0.0
            elif pool is not None and pool.decode_ms_per_token is not None:
                decode_source, per_token = "pool", pool.decode_ms_per_token
            else:
                decode_source, per_token = "default", DEFAULT_DECODE_MS_PER_TOKEN
            ratio = own_ratio(record, DECODE, per_token, 0.0, self.prior_weight)
            if ratio is not None:
                decode_source, per_token = "scaled", per_token * ratio
            values["decode_ms_per_token"] = per_token
        source = TimingSource(
            prefill_source,
            decode_source,
            pre.samples if pre else 0,
            dec.samples if dec else 0,
            dec.slope if dec is not None and decode_source == "learned" else None,
        )
        return replace(spec, **values), source  # type: ignore[arg-type]


def pool_prior(learned: Iterable[InstanceSpec]) -> InstanceSpec | None:
    """The mean learned timing of a pool's instances (what a new epoch starts from)."""
    specs = list(learned)
    if not specs:
        return None
    n = len(specs)
    return InstanceSpec(
        id="pool",
        url="http://pool",
        prefill_ms_per_token=sum(s.prefill_ms_per_token or 0.0 for s in specs) / n,
        prefill_overhead_ms=sum(s.prefill_overhead_ms or 0.0 for s in specs) / n,
        decode_ms_per_token=sum(s.decode_ms_per_token or 0.0 for s in specs) / n,
    )


# Each instance's configured spec and epoch, by id: what resolve_pool resolves.
TimingInputs = Mapping[str, tuple[InstanceSpec, int]]
# resolve_pool's answer with the inputs it was given (PoolCache.apply_learned).
ResolvedPool = tuple[
    TimingInputs, InstanceSpec | None, dict[str, tuple[InstanceSpec, TimingSource]]
]


def resolve_pool(
    policy: TimingPolicy,
    entries: TimingInputs,
    records: Mapping[str, list[float]],
) -> tuple[InstanceSpec | None, dict[str, tuple[InstanceSpec, TimingSource]]]:
    """Every instance's resolved timing, and the pool prior they were resolved with.

    `entries` maps instance ids to their configured spec and current epoch. Only an
    instance with a record can be learned, so only those make the prior.
    """
    own = [
        policy.resolve(spec, epoch, records[iid], None)
        for iid, (spec, epoch) in entries.items()
        if iid in records
    ]
    prior = pool_prior(spec for spec, src in own if src.prefill == src.decode == "learned")
    resolved = {
        iid: policy.resolve(spec, epoch, records.get(iid), prior)
        for iid, (spec, epoch) in entries.items()
    }
    return prior, resolved


@dataclass(slots=True)
class Observations:
    """One node's samples since its last merge, by record field."""

    batches: dict[str, list[float]] = field(default_factory=dict)
    rejected: int = 0  # samples dropped as outliers (a node metric)

    def _batch(self, name: str, epoch: int, groups: int) -> list[float] | None:
        """The batch collecting a field's samples of this epoch (None: an older epoch's)."""
        batch = self.batches.get(name)
        if batch is not None and int(batch[0]) > epoch:
            return None
        if batch is None or int(batch[0]) < epoch:
            batch = self.batches[name] = empty_record(epoch, groups)
        return batch

    def prefill(
        self, instance_id: str, epoch: int, tokens: int, ttft_ms: float, predicted: float | None
    ) -> bool:
        """A wait-free request's TTFT; `predicted` (None while unlearned) screens it."""
        return self._add(instance_id, epoch, PREFILL, tokens, screened(ttft_ms, predicted))

    def decode(
        self, instance_id: str, epoch: int, batch: int, ms_per_token: float, predicted: float | None
    ) -> bool:
        """Decode time per output token after the first, at a running batch size."""
        return self._add(instance_id, epoch, DECODE, batch, screened(ms_per_token, predicted))

    def _add(self, name: str, epoch: int, group: int, x: float, value: float | None) -> bool:
        if value is None:
            self.rejected += 1
            return False
        batch = self._batch(name, epoch, 2)
        if batch is None:
            return False
        add_sample(batch, group, x, value)
        return True

    def output(self, model: str, tokens: int) -> None:
        """One completion's output length (usage field, else counted chunks)."""
        batch = self._batch(OUTPUT_FIELD + model, 0, 1)
        assert batch is not None  # output records have no epochs
        add_sample(batch, 0, 0.0, float(tokens))

    def drain(self) -> dict[str, list[float]]:
        """The batches to merge; the node starts collecting anew."""
        out, self.batches = self.batches, {}
        return out


def expected_output(records: Mapping[str, list[float]], model: str) -> float | None:
    """The pool's learned mean output length of a model, or None before any sample."""
    record = records.get(OUTPUT_FIELD + model)
    if record is None or record[2] < 1 or record[3] <= 0:
        return None
    return record[5] / record[3]


def relative_error(observed_ms: float, predicted_ms: float) -> float:
    """|observed - predicted| / max(observed, 1 ms): what the accuracy histogram holds."""
    return abs(observed_ms - predicted_ms) / max(observed_ms, 1.0)
