"""One request's cost, this checkout against another commit, side by side: a node's
decision p50 over the PING p50 (bench/decision_overhead.py `run_case`) and the Redis
server's CPU per request cycle, from the node's own run and replayed as a busy shard
(bench/scaling.py `_cycles`), each tree running its own code on one private server,
the two trees alternating round after round; medians reported.

    python bench/request_ab.py --against REF [--rounds 5] [--instances 64]

The ratio p50 / PING is issue 12's "decision p50 in Redis round trips". Alternating the
trees puts this shared machine's slow and fast spells on both alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.against import add_against, resolve_against, tree_of  # noqa: E402
from local_fleet.embedded import EmbeddedRedis  # noqa: E402

# Runs in a child whose code is one tree (argv[1]).
RUNNER = """
import asyncio, inspect, json, sys
sys.path.insert(0, sys.argv[1])
from bench.decision_overhead import run_case
from bench.scaling import PREFIX, _cycles, register_pool
from local_fleet.pools import delete_pool
url, n, decisions, cycles = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
out = run_case(url, n, 1, decisions, 500)
pool = f"ab-{n}"
register_pool(url, pool, n)
# The load in flight that trees from before it was a parameter kept for one node: 8.
light = {"in_flight": 8} if "in_flight" in inspect.signature(_cycles).parameters else {}
got = asyncio.run(_cycles(url, pool, 1, cycles, **light))
if isinstance(got, tuple):  # the run and its recording, replayed here
    got, recording = got
    got.update(recording.replay(url))
    recording.close()
out.update(got)
delete_pool(url, pool, PREFIX)
print(json.dumps(out))
"""

Run = dict[str, float]
COLUMNS: tuple[tuple[str, Callable[[Run], float], str], ...] = (  # label, value, format
    ("decision p50 µs", lambda x: x["p50"], "{:.0f}"),
    ("PING p50 µs", lambda x: x["ping"], "{:.0f}"),
    ("p50 / PING", lambda x: x["p50"] / x["ping"], "{:.2f}"),
    ("server CPU µs/request", lambda x: x["cpu_us_per_req"], "{:.0f}"),
    ("replayed: CPU µs/request", lambda x: x["busy_cpu_us_per_req"], "{:.0f}"),
    ("commands/request", lambda x: x["commands_per_req"], "{:.1f}"),
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_against(parser)
    parser.add_argument("--rounds", type=int, default=5, help="runs of each, alternating")
    parser.add_argument("--instances", type=int, default=64)
    parser.add_argument("--decisions", type=int, default=1500, help="timed decisions per run")
    parser.add_argument("--cycles", type=int, default=3000, help="request cycles per run")
    args = parser.parse_args(argv)
    if min(args.rounds, args.instances, args.decisions, args.cycles) < 1:
        parser.error("--rounds, --instances, --decisions and --cycles must be >= 1")
    ref = resolve_against(parser, args.against)
    runs: dict[str, list[Run]] = {}
    with tree_of(ref) as other:
        trees = {ref[:10]: other, "this": str(ROOT)}
        server = EmbeddedRedis().start()
        try:
            for r in range(args.rounds):
                for label, tree in trees.items():
                    child = subprocess.run(
                        [sys.executable, "-c", RUNNER, tree, server.url, str(args.instances),
                         str(args.decisions), str(args.cycles)],
                        capture_output=True, text=True, cwd=tree,
                    )  # fmt: skip
                    if child.returncode:
                        sys.exit(f"{label} failed:\n{child.stderr}")
                    run = json.loads(child.stdout.strip().splitlines()[-1])
                    runs.setdefault(label, []).append(run)
                    shown = ", ".join(
                        f"{name} {fmt.format(value(run))}" for name, value, fmt in COLUMNS
                    )
                    print(f"round {r + 1}/{args.rounds} {label}: {shown}", file=sys.stderr)
        finally:
            server.stop()
    print(f"{args.instances} instances, 1 node; {args.decisions} decisions and "
          f"{args.cycles} request cycles per run; median of {args.rounds} alternating runs")  # fmt: skip
    print("| code | " + " | ".join(name for name, _, _ in COLUMNS) + " | p50 / PING, each run |")
    print("|---|" + "---:|" * len(COLUMNS) + "---|")
    for label, rows in runs.items():
        cells = [fmt.format(statistics.median(value(x) for x in rows)) for _, value, fmt in COLUMNS]
        each = ", ".join(f"{x['p50'] / x['ping']:.2f}" for x in rows)
        print(f"| {label} | " + " | ".join(cells) + f" | {each} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
