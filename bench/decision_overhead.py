"""Decision cost (snapshot + score + reserve) against instance and node count.

The benchmark lives in coordinator/benchmarks_overhead.py (also `coordinator bench
overhead`); this script keeps the original entry point, flags and output.

    python bench/decision_overhead.py            # private embedded server
    python bench/decision_overhead.py --quick    # fewer decisions, for a smoke run
"""

from __future__ import annotations

import sys

from coordinator.benchmarks_overhead import main

if __name__ == "__main__":
    sys.exit(main())
