"""Herding: K nodes fire simultaneous bursts at idle, identical instances.

The benchmark lives in coordinator/benchmarks_herding.py (also `coordinator bench
herding`); this script keeps the original entry point, flags and output.

    python bench/herding.py                 # 4 nodes x 8 requests onto 16 instances
    python bench/herding.py --trials 50 --nodes 8 --burst 16 --instances 32
"""

from __future__ import annotations

import sys

from coordinator.benchmarks_herding import main

if __name__ == "__main__":
    sys.exit(main())
