"""Decision cost of this checkout against another commit, side by side: one node's
decision p50 and PING p50 (bench/decision_overhead.py `run_case`, each tree's own code)
on one private server, the two trees alternating round after round, medians reported.

    python bench/decision_ab.py --against REF [--rounds 5] [--instances 64]

The ratio p50 / PING is issue 12's "decision p50 in Redis round trips"; alternating the
trees puts this shared machine's slow and fast spells on both alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.against import add_against, resolve_against, tree_of  # noqa: E402
from local_fleet.embedded import EmbeddedRedis  # noqa: E402

# Runs in a child whose code is one tree (argv[1]).
RUNNER = """
import json, sys
sys.path.insert(0, sys.argv[1])
from bench.decision_overhead import run_case
print(json.dumps(run_case(sys.argv[2], int(sys.argv[3]), 1, int(sys.argv[4]), 500)))
"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_against(parser)
    parser.add_argument("--rounds", type=int, default=5, help="runs of each, alternating")
    parser.add_argument("--instances", type=int, default=64)
    parser.add_argument("--decisions", type=int, default=1500, help="per run")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.instances < 1 or args.decisions < 1:
        parser.error("--rounds, --instances and --decisions must be >= 1")
    ref = resolve_against(parser, args.against)
    runs: dict[str, list[dict[str, float]]] = {}
    with tree_of(ref) as other:
        trees = {ref[:10]: other, "this": str(ROOT)}
        server = EmbeddedRedis().start()
        try:
            for r in range(args.rounds):
                for label, tree in trees.items():
                    child = subprocess.run(
                        [sys.executable, "-c", RUNNER, tree, server.url,
                         str(args.instances), str(args.decisions)],
                        capture_output=True, text=True, cwd=tree,
                    )  # fmt: skip
                    if child.returncode:
                        sys.exit(f"{label} failed:\n{child.stderr}")
                    row = json.loads(child.stdout.strip().splitlines()[-1])
                    runs.setdefault(label, []).append(row)
                    print(
                        f"round {r + 1}/{args.rounds} {label}: p50 {row['p50']:.0f} us, "
                        f"PING {row['ping']:.0f} us, ratio {row['p50'] / row['ping']:.2f}",
                        file=sys.stderr,
                    )
        finally:
            server.stop()
    print(f"{args.instances} instances, 1 node, {args.decisions} decisions per run, "
          f"median of {args.rounds} alternating runs")  # fmt: skip
    print("| code | decision p50 µs | PING p50 µs | p50 / PING (median of runs) | each run |")
    print("|---|---:|---:|---:|---|")
    for label, rows in runs.items():
        ratios = [x["p50"] / x["ping"] for x in rows]
        print(
            f"| {label} | {statistics.median(x['p50'] for x in rows):.0f} "
            f"| {statistics.median(x['ping'] for x in rows):.0f} "
            f"| {statistics.median(ratios):.2f} | {', '.join(f'{v:.2f}' for v in ratios)} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
