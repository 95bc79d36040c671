"""Request traces for the simulator: parsing, and scaling to a target utilization.

Two formats are read, detected from the first non-blank character:

- CSV in the Azure LLM inference trace layout, `TIMESTAMP,ContextTokens,GeneratedTokens`,
  where TIMESTAMP is a wall-clock `YYYY-MM-DD HH:MM:SS[.fffffff]`;
- JSONL, one object per line with `timestamp` (ms), `input_length`, `output_length`,
  and optionally `hash_ids`: the prompt's prefix blocks in order (Mooncake's format;
  equal ids are the same reusable KV-cache block, of `TRACE_BLOCK_TOKENS` tokens).

Arrival times are relative to the first request, in ms. Rows are sorted by arrival
(stably) so an unordered trace still replays in time order.

Utilization. The offered load of a trace on a fleet is `rate * mean_service / instances`:

- `rate = (n - 1) / span`, the mean arrival rate over the trace's span;
- `service` of one request is the engine time it occupies, from the same
  `EngineTiming` the engines run: its prefill (which blocks the engine) plus its
  share of the decode steps at the nominal batch `B = max_batch // 2`, i.e.
  `prefill_ms(prompt) + (output - 1) * step_ms(B) / B` (the prefill iteration
  already emits the first token, so an output of k tokens needs k - 1 steps);
- the fleet's capacity is one unit of engine time per instance per ms.

`scale_to_utilization` stretches or compresses inter-arrival times (never sizes) so
this offered load equals the target. A busier engine batches more and gets more
throughput per ms than at B, so 1.0 is the nominal, not the absolute, saturation.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from local_fleet.engine_model import EngineTiming

CSV_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
TRACE_BLOCK_TOKENS = 512  # tokens per hash_ids block in the Mooncake traces
JSONL_FIELDS = ("timestamp", "input_length", "output_length")


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: arrival (ms after the first request) and its sizes."""

    index: int
    arrival_ms: float
    prompt_tokens: int
    output_tokens: int
    blocks: tuple[int, ...] = ()  # prefix block ids (hash_ids), empty when unknown


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read a CSV (Azure) or JSONL trace; `limit` keeps the first N requests."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from exc
    return parse_trace(text, source=str(path), limit=limit)


def parse_trace(text: str, source: str = "<trace>", limit: int | None = None) -> list[TraceRequest]:
    """Parse trace text in either format (see the module docstring)."""
    if limit is not None and limit < 1:
        raise TraceError(f"{source}: limit must be >= 1, got {limit}")
    stripped = text.lstrip()
    if not stripped:
        raise TraceError(f"{source}: the trace is empty")
    rows = _jsonl_rows(text, source) if stripped[0] == "{" else _csv_rows(text, source)
    raw: list[tuple[float, int, int, tuple[int, ...]]] = []
    for row in rows:
        raw.append(row)
        if limit is not None and len(raw) >= limit:
            break
    if not raw:
        raise TraceError(f"{source}: the trace has no requests")
    raw.sort(key=lambda r: r[0])
    first = raw[0][0]
    return [TraceRequest(i, t - first, p, o, b) for i, (t, p, o, b) in enumerate(raw)]


def _tokens(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool):
        raise TraceError(f"{where}: {name} must be an integer, got {value!r}")
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise TraceError(f"{where}: {name} must be an integer, got {value!r}") from None
    if isinstance(value, float) and value != number:
        raise TraceError(f"{where}: {name} must be an integer, got {value!r}")
    if number < 0:
        raise TraceError(f"{where}: {name} must be >= 0, got {number}")
    return number


def _output(value: Any, where: str) -> int:
    # A request that generated nothing still ran one forward pass (its first token).
    return max(1, _tokens(value, "output tokens", where))


def _csv_rows(text: str, source: str) -> Iterator[tuple[float, int, int, tuple[int, ...]]]:
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if header is None or tuple(h.strip().lstrip("\ufeff") for h in header[:3]) != CSV_COLUMNS:
        raise TraceError(f"{source}:1: expected the CSV header {','.join(CSV_COLUMNS)}")
    base: datetime | None = None
    for line_no, fields in enumerate(reader, start=2):
        if not fields or all(not f.strip() for f in fields):
            continue
        where = f"{source}:{line_no}"
        if len(fields) < 3:
            raise TraceError(f"{where}: expected 3 columns, got {len(fields)}")
        try:
            stamp = datetime.fromisoformat(fields[0].strip())
        except ValueError:
            raise TraceError(
                f"{where}: TIMESTAMP {fields[0]!r} is not 'YYYY-MM-DD HH:MM:SS[.fff]'"
            ) from None
        if base is None:
            base = stamp
        at_ms = (stamp - base).total_seconds() * 1000.0
        yield (
            at_ms,
            _tokens(fields[1].strip(), "ContextTokens", where),
            _output(fields[2].strip(), where),
            (),
        )


def _jsonl_rows(text: str, source: str) -> Iterator[tuple[float, int, int, tuple[int, ...]]]:
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{source}:{line_no}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not a JSON object: {exc.msg}") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object")
        missing = [name for name in JSONL_FIELDS if name not in obj]
        if missing:
            raise TraceError(f"{where}: missing field(s) {', '.join(missing)}")
        stamp = obj["timestamp"]
        if (
            isinstance(stamp, bool)
            or not isinstance(stamp, int | float)
            or not math.isfinite(stamp)
        ):
            raise TraceError(f"{where}: timestamp must be a number of ms, got {stamp!r}")
        yield (
            float(stamp),
            _tokens(obj["input_length"], "input_length", where),
            _output(obj["output_length"], where),
            _blocks(obj.get("hash_ids", []), where),
        )


def _blocks(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise TraceError(f"{where}: hash_ids must be a list of integers")
    return tuple(value)


def service_ms(timing: EngineTiming, prompt_tokens: int, output_tokens: int) -> float:
    """Engine time one request occupies at the nominal batch (module docstring)."""
    batch = max(1, timing.max_batch // 2)
    share = timing.step_ms(batch) / batch
    return timing.prefill_ms(prompt_tokens) + max(0, output_tokens - 1) * share


def offered_load(requests: Iterable[TraceRequest], timing: EngineTiming, instances: float) -> float:
    """Offered load as a fraction of the fleet's nominal capacity."""
    reqs = list(requests)
    if not instances > 0:
        raise ValueError("instances (capacity in base-speed instances) must be > 0")
    if len(reqs) < 2:
        raise TraceError("a utilization needs at least 2 requests")
    span = reqs[-1].arrival_ms - reqs[0].arrival_ms
    if span <= 0:
        raise TraceError("every request arrives at the same time: the rate is undefined")
    rate = (len(reqs) - 1) / span
    mean = sum(service_ms(timing, r.prompt_tokens, r.output_tokens) for r in reqs) / len(reqs)
    return rate * mean / instances


def scale_to_utilization(
    requests: list[TraceRequest], timing: EngineTiming, instances: float, target: float
) -> list[TraceRequest]:
    """Rescale inter-arrival times so the offered load equals `target`."""
    if not (target > 0 and math.isfinite(target)):
        raise ValueError(f"utilization must be > 0, got {target}")
    factor = offered_load(requests, timing, instances) / target
    first = requests[0].arrival_ms
    return [replace(r, arrival_ms=(r.arrival_ms - first) * factor) for r in requests]
