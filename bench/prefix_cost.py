"""Redis cost of the prefix index per request, this checkout against another commit
(by default the one where this branch left `main`; on main itself, name one with
--against), side by side: both run on one private server, alternating, each with its
own code (node and scripts), medians reported.

    python bench/prefix_cost.py [--against REF] [--rounds 3] [--instances 64 1024]

The workload and the figures are bench/prefix_report.py's cost table
(bench/prefix_live.redis_cost, taken from this checkout for both), plus the server's
main-thread CPU per request (lookup and record, network included), which a busy
machine's preemption does not inflate as it does the wall-clock usec_per_call.
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

# Runs in a child whose code is one tree (argv[1]); the workload is this checkout's.
RUNNER = """
import asyncio, dataclasses, importlib.util, json, sys
tree, workload, url, n, requests, capacity, seed = sys.argv[1:8]
sys.path.insert(0, tree)
spec = importlib.util.spec_from_file_location("prefix_live", workload)
live = importlib.util.module_from_spec(spec)
sys.modules["prefix_live"] = live  # dataclasses look their module up
spec.loader.exec_module(live)
results = asyncio.run(live.redis_cost(
    url, int(n), requests=int(requests), capacity_tokens=int(capacity), seed=int(seed)))
print(json.dumps([dataclasses.asdict(r) for r in results]))
"""


def main(argv: Sequence[str] | None = None) -> int:
    from bench.prefix_report import COST_CAPACITY

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_against(parser)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each, alternating")
    parser.add_argument("--instances", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--requests", type=int, default=1000, help="per case and run")
    args = parser.parse_args(argv)
    ref = resolve_against(parser, args.against)
    name = ref[:10]
    runs: dict[tuple[str, int, str], list[dict[str, float]]] = {}
    with tree_of(ref) as other:
        trees = {name: other, "this": str(ROOT)}
        server = EmbeddedRedis().start()
        try:
            for r in range(args.rounds):
                for n in args.instances:
                    for label, tree in trees.items():
                        child = subprocess.run(
                            [sys.executable, "-c", RUNNER, tree,
                             str(ROOT / "bench" / "prefix_live.py"), server.url, str(n),
                             str(args.requests), str(COST_CAPACITY), str(r)],
                            capture_output=True, text=True, cwd=tree,
                        )  # fmt: skip
                        if child.returncode:
                            sys.exit(f"{label} failed:\n{child.stderr}")
                        for res in json.loads(child.stdout):
                            runs.setdefault((label, n, res["case"]), []).append(res)
        finally:
            server.stop()
    print(f"median of {args.rounds} runs, {args.requests} requests per case and run")
    print("| code | instances | requests | lookup µs | record µs | records per "
          "request | total µs per request | server CPU µs per request |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for (label, n, case), rs in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        lookup = statistics.median(x["lookup_us"] for x in rs)
        record = statistics.median(x["record_us"] for x in rs)
        per = statistics.median(x["records_per_request"] for x in rs)
        total = statistics.median(x["lookup_us"] + x["record_us"] * x["records_per_request"]
                                  for x in rs)  # fmt: skip
        cpu = statistics.median(x.get("cpu_us", float("nan")) for x in rs)
        print(f"| {label} | {n:,} | {case} | {lookup:.1f} | {record:.1f} | {per:.2f} "
              f"| {total:.1f} | {cpu:.1f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
