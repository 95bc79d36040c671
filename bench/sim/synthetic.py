"""The built-in synthetic workload: what `bench sim` and `bench live` run without --trace.

It is generated, not copied from any trace, from a seed, so the same seed gives the
same requests on every machine:

- **Arrivals**: a Poisson process whose rate switches between a calm level and
  bursts at 4x that level: 20 s calm, then 5 s of burst, repeating (an on/off
  modulated Poisson process, drawn by thinning). The calm level is 2 requests/s,
  but only the shape matters: `--utilization` rescales inter-arrival times to the
  offered load asked for (bench/sim/traces.py defines it).
- **Prompt tokens**: log-normal, median 1,024, sigma 1.0 (mean about 1,700), cut to
  16..16,384. The Azure conversation trace has median 1,020.
- **Output tokens**: log-normal, median 128, sigma 1.0 (mean about 210), cut to
  1..2,048. The Azure conversation trace has median 129, mean 211.

Prompt and output sizes are drawn independently of each other and of the arrivals.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

from bench.sim.traces import TraceRequest, load_trace

DEFAULT_REQUESTS = 2000  # requests generated when no --limit is given


@dataclass(frozen=True, slots=True)
class SyntheticWorkload:
    """The generator's parameters (the module docstring explains each)."""

    calm_rps: float = 2.0  # arrival rate between bursts
    burst_factor: float = 4.0  # burst rate / calm rate
    calm_s: float = 20.0  # length of a calm phase
    burst_s: float = 5.0  # length of a burst
    prompt_median: float = 1024.0  # prompt tokens: log-normal median
    prompt_sigma: float = 1.0  # prompt tokens: sigma of the underlying normal
    prompt_range: tuple[int, int] = (16, 16_384)
    output_median: float = 128.0  # output tokens: log-normal median
    output_sigma: float = 1.0  # output tokens: sigma of the underlying normal
    output_range: tuple[int, int] = (1, 2048)

    def rate(self, t_s: float) -> float:
        """Arrival rate (requests/s) at t_s seconds after the start."""
        in_burst = t_s % (self.calm_s + self.burst_s) >= self.calm_s
        return self.calm_rps * (self.burst_factor if in_burst else 1.0)

    def requests(self, count: int, seed: int) -> list[TraceRequest]:
        """`count` requests drawn from `seed` (deterministic)."""
        if count < 1:
            raise ValueError(f"a workload needs at least 1 request, got {count}")
        rng = random.Random(seed)
        peak = self.calm_rps * max(1.0, self.burst_factor)
        out: list[TraceRequest] = []
        t = 0.0
        while len(out) < count:
            t += rng.expovariate(peak)
            if rng.random() * peak >= self.rate(t):
                continue  # thinned: the rate here is below the peak
            out.append(
                TraceRequest(
                    index=len(out),
                    arrival_ms=t * 1000.0,
                    prompt_tokens=_lognormal(
                        rng, self.prompt_median, self.prompt_sigma, self.prompt_range
                    ),
                    output_tokens=_lognormal(
                        rng, self.output_median, self.output_sigma, self.output_range
                    ),
                )
            )
        first = out[0].arrival_ms
        return [
            TraceRequest(r.index, r.arrival_ms - first, r.prompt_tokens, r.output_tokens)
            for r in out
        ]


def _lognormal(rng: random.Random, median: float, sigma: float, bounds: tuple[int, int]) -> int:
    value = rng.lognormvariate(math.log(median), sigma)
    return int(min(bounds[1], max(bounds[0], round(value))))


SYNTHETIC = SyntheticWorkload()
SYNTHETIC_LABEL = "synthetic"  # how reports name the built-in workload


def synthetic_requests(count: int | None, seed: int) -> list[TraceRequest]:
    """The built-in workload: `count` (default DEFAULT_REQUESTS) requests from `seed`."""
    return SYNTHETIC.requests(count or DEFAULT_REQUESTS, seed)


def load_requests(trace: str | Path | None, limit: int | None, seed: int) -> list[TraceRequest]:
    """A trace file's first `limit` requests, or without a file the built-in workload."""
    if trace is None:
        return synthetic_requests(limit, seed)
    return load_trace(trace, limit)


def workload_name(trace: str | Path | None, seed: int) -> str:
    """How a report names what it replayed."""
    if trace is None:
        return f"the built-in synthetic workload (seed {seed})"
    return f"`{Path(trace).name}`"
