"""Quantiles for the reports the demo and the benchmarks print."""

from __future__ import annotations

import math
from collections.abc import Sequence


def nearest_rank(values: Sequence[float], q: float) -> float:
    """Nearest-rank q-quantile (q in 0..1) of unsorted values; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of already sorted values."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)
