"""Gray failure: one engine fails a share of its requests, never many in a row. How
much of the traffic it still gets, and what clients see, with passive health's
failure-share rule (`--eject-failure-percent`) off and on.

Each round starts two fresh `coordinator cluster`-style fleets (`--nodes` nodes,
`--engines` mock engines; engine-0 answers `--fail-share` of its requests with a 500,
or cuts that share of its streams mid-way) whose nodes differ only in
COORD_EJECT_FAILURE_PERCENT (0, and the default), and sends both the same streaming
requests at `--rate` per second, one fleet after the other. The consecutive-failure
rule (5 in a row) is on in both. Attempts on the failing engine = the requests it
served plus the failures the nodes counted (`proxy_upstream_failures_total`: only
engine-0 fails). A client failure is a non-200 answer or a stream without its
`[DONE]`. Medians over `--rounds`. Loopback only; every fleet stops by itself.

    python bench/gray_failure.py --rounds 3 --write-docs
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass

import aiohttp

from bench.docs import add_write_docs, write_section
from coordinator.outliers import OutlierPolicy
from local_fleet.cluster import LocalCluster, free_port_block

FAULTS = {"500": "--error-rate", "cut stream": "--crash-rate"}
RULES = {"off": "0", "on": f"{OutlierPolicy().failure_percent:g}"}


@dataclass(frozen=True)
class Round:
    """One fleet's run."""

    served: dict[str, int]  # completed requests per engine
    node_failures: int  # failed exchanges the nodes counted
    client_failures: int
    requests: int

    @property
    def attempts_on_failing(self) -> int:
        return self.served.get("engine-0", 0) + self.node_failures


async def drive(c: LocalCluster, requests: int, rate: float) -> Round:
    served: dict[str, int] = {}
    failed = 0

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal failed
        body = {
            "model": "mock",
            "messages": [{"role": "user", "content": f"question {i} " * 60}],
            "max_tokens": 40,
            "stream": True,
        }
        try:
            url = c.node_urls[i % len(c.node_urls)] + "/v1/chat/completions"
            async with session.post(url, json=body) as resp:
                data = await resp.read()
                if resp.status == 200 and data.rstrip().endswith(b"data: [DONE]"):
                    engine = resp.headers.get("X-Instance-Id", "")
                    served[engine] = served.get(engine, 0) + 1
                    return
        except aiohttp.ClientError:
            pass
        failed += 1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        tasks = []
        for i in range(requests):
            tasks.append(asyncio.create_task(one(session, i)))
            await asyncio.sleep(1 / rate)
        await asyncio.gather(*tasks)
        counted = 0
        for url in c.control_urls:
            async with session.get(url + "/metrics") as resp:
                for line in (await resp.text()).splitlines():
                    if line.startswith("proxy_upstream_failures_total{"):
                        counted += int(float(line.rsplit(" ", 1)[1]))
    return Round(served, counted, failed, requests)


async def run(args: argparse.Namespace) -> dict[tuple[str, str], list[Round]]:
    out: dict[tuple[str, str], list[Round]] = {}
    for r in range(args.rounds):
        for fault, flag in FAULTS.items():
            for rule, percent in RULES.items():
                c = LocalCluster(
                    nodes=args.nodes,
                    engines=args.engines,
                    base_port=free_port_block(args.nodes, args.engines),
                    speed=args.speed,
                    pool="gray-failure",
                    per_engine_args=[[flag, str(args.fail_share)]] + [[]] * (args.engines - 1),
                    node_env={"COORD_EJECT_FAILURE_PERCENT": percent},
                )
                c.start(timeout_s=90)
                try:
                    result = await drive(c, args.requests, args.rate)
                finally:
                    c.stop()
                out.setdefault((fault, rule), []).append(result)
                print(
                    f"  round {r + 1}/{args.rounds} {fault}, rule {rule}: failing engine "
                    f"{result.attempts_on_failing} attempts, {result.client_failures} client "
                    "failures",
                    flush=True,
                )
    return out


def table(out: dict[tuple[str, str], list[Round]], engines: int) -> list[str]:
    lines = [
        "| engine-0 fails | failure-share rule | attempts on engine-0 (its share: "
        f"1/{engines}) | served by engine-0 | client failures | requests |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for (fault, rule), rounds in out.items():
        attempts = statistics.median(r.attempts_on_failing for r in rounds)
        served = statistics.median(r.served.get("engine-0", 0) for r in rounds)
        failures = statistics.median(r.client_failures for r in rounds)
        lines.append(
            f"| {fault} | {rule} | {attempts:.0f} | {served:.0f} | {failures:.0f} "
            f"| {rounds[0].requests} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--fail-share", type=float, default=0.25, help="of engine-0's requests")
    parser.add_argument("--requests", type=int, default=600, help="per fleet and round")
    parser.add_argument("--rate", type=float, default=50.0, help="requests per second")
    parser.add_argument("--speed", type=float, default=4.0, help="mock engines run S times faster")
    parser.add_argument("--rounds", type=int, default=3)
    add_write_docs(parser)
    args = parser.parse_args(argv)
    if min(args.nodes, args.requests, args.rounds) < 1 or args.engines < 2:
        parser.error("--nodes, --requests and --rounds must be >= 1, --engines >= 2")
    if not 0 < args.fail_share <= 1 or args.rate <= 0 or args.speed <= 0:
        parser.error("--fail-share must be in (0, 1], --rate and --speed > 0")
    t0 = time.monotonic()
    out = asyncio.run(run(args))
    policy = OutlierPolicy()
    text = "\n".join(
        [
            "## Gray failure: an engine that fails often, never many times in a row",
            "",
            f"Generated by `python bench/gray_failure.py --rounds {args.rounds} --write-docs` "
            f"in {time.monotonic() - t0:.0f} s. {args.nodes} nodes, {args.engines} mock "
            f"engines at speed {args.speed:g}; engine-0 fails {args.fail_share:.0%} of its "
            f"requests (a 500, or a stream cut mid-way); {args.requests} streaming "
            f"requests at {args.rate:g}/s through the nodes in turn, per fleet and round; "
            f"medians of {args.rounds} rounds, each on fresh fleets, the two rules one "
            "after the other. The failure-share rule ejects an instance once "
            f"{policy.failure_percent:g}% of a node's last {policy.failure_volume} "
            "exchanges with it failed (`--eject-failure-percent`, "
            "`--eject-failure-volume`); the consecutive rule "
            f"({policy.consecutive_failures} in a row) is on in both.",
            "",
            *table(out, args.engines),
            "",
            "A 500 comes before any byte reached the client, so the node retries it on "
            "another engine: clients see no failure either way, but each attempt on the "
            "failing engine costs its client that engine's time first. A cut stream "
            "cannot be retried: it reaches the client. Each node judges its own "
            "exchanges, so the rule acts once one node has sent the failing engine "
            f"{policy.failure_volume} requests.",
        ]
    )
    print(text)
    if args.write_docs:
        write_section("gray-failure", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
