"""Herding through the HTTP edge: bursts of simultaneous requests through every node
onto idle mock engines, one burst shortly after another; how evenly they land.

`coordinator bench herding` checks the reserve path alone (node processes calling
`Coordinator.reserve`). This one goes through what users run: `coordinator serve`
nodes in their default configuration, streaming requests, mock engines whose
`/metrics` the nodes scrape into hints, and learned timing. Each trial sends
`--per-node` streaming requests through each of `--nodes` nodes at once onto
`--engines` engines and counts the requests per engine (from `X-Instance-Id`);
spread = the most minus the fewest. A cluster's trial starts at least `--gap-s` after
its previous one ended, so the nodes' last hint scrape may have seen that burst.

The same trials run, alternating, against a cluster whose nodes give engine hints no
weight (the engines' heartbeats and the nodes' scrapes still report them) and one
whose nodes rank on request counts alone (the seed's weights without hints or
backlog), so every configuration sees the same machine. Loopback only; the clusters
stop by themselves.

    python bench/edge_herding.py --trials 20 --write-docs
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp

from bench.docs import add_write_docs, write_section
from bench.herding import spread
from local_fleet.cluster import LocalCluster, free_port_block

CONFIGS = {
    "default": {},
    "engine hints weighted 0": {"COORD_WEIGHTS": "ttft,engine_running=0,engine_waiting=0"},
    "request counts only": {"COORD_WEIGHTS": "seed,engine_running=0,engine_waiting=0,backlog_ms=0"},
}


@dataclass
class Outcome:
    """The spreads of one configuration's trials."""

    spreads: list[int] = field(default_factory=list)
    failed: int = 0

    def line(self, name: str) -> str:
        even = sum(1 for s in self.spreads if s == 0)
        dist = ", ".join(f"{k}: {v}" for k, v in sorted(Counter(self.spreads).items()))
        return (
            f"| {name} | {even}/{len(self.spreads)} | {max(self.spreads)} | {dist} "
            f"| {self.failed} |"
        )


async def burst(session: aiohttp.ClientSession, urls: list[str], per_node: int) -> list[str]:
    """Every node's requests at once; the engine each one went to ('' = failed)."""

    async def one(url: str) -> str:
        body = {
            "model": "mock",
            "messages": [{"role": "user", "content": "hello " * 50}],
            "max_tokens": 64,
            "stream": True,
        }
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            async for _ in resp.content:
                pass
            return resp.headers.get("X-Instance-Id", "") if resp.status == 200 else ""

    return list(await asyncio.gather(*(one(u) for u in urls for _ in range(per_node))))


async def run(args: argparse.Namespace) -> dict[str, Outcome]:
    clusters = {}
    try:
        for name, env in CONFIGS.items():
            c = LocalCluster(
                nodes=args.nodes,
                engines=args.engines,
                base_port=free_port_block(args.nodes, args.engines),
                pool="edge-herding",
                node_env=env,
            )
            c.start(timeout_s=90)
            clusters[name] = c
        out = {name: Outcome() for name in CONFIGS}
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for t in range(args.trials):
                for name, c in clusters.items():
                    where = await burst(session, c.node_urls, args.per_node)
                    out[name].failed += where.count("")
                    engines = [f"engine-{j}" for j in range(args.engines)]
                    out[name].spreads.append(spread(where, engines))
                    print(f"  trial {t + 1}/{args.trials} {name}: spread {out[name].spreads[-1]}",
                          flush=True)  # fmt: skip
                    await asyncio.sleep(args.gap_s / len(clusters))
        return out
    finally:
        for c in clusters.values():
            c.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--engines", type=int, default=16)
    parser.add_argument("--per-node", type=int, default=8, help="simultaneous requests per node")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--gap-s", type=float, default=1.5, help="from one burst's end to the next")
    add_write_docs(parser)
    args = parser.parse_args(argv)
    if min(args.nodes, args.engines, args.per_node, args.trials) < 1 or args.gap_s < 0:
        parser.error("--nodes, --engines, --per-node and --trials must be >= 1, --gap-s >= 0")
    t0 = time.monotonic()
    out = asyncio.run(run(args))
    total = args.nodes * args.per_node
    text = "\n".join(
        [
            "## Herding through the HTTP edge",
            "",
            f"Generated by `python bench/edge_herding.py --trials {args.trials} --write-docs` "
            f"in {time.monotonic() - t0:.0f} s. Each trial: {args.per_node} simultaneous "
            f"streaming requests through each of {args.nodes} `coordinator serve` nodes "
            f"({total} in all) onto {args.engines} idle mock engines, "
            f"at least {args.gap_s:g} s after the same cluster's previous trial ended; "
            "spread = most minus fewest requests per engine. The clusters ran alternately.",
            "",
            "| nodes' configuration | trials with spread 0 | worst spread | spreads (spread: "
            "trials) | failed requests |",
            "|---|---:|---:|---|---:|",
            *(o.line(name) for name, o in out.items()),
            "",
            "An engine's hints (`num_requests_running`, `num_requests_waiting`) count "
            "the fleet's own requests, which the score counts already as reservations; a "
            "report from one burst can still be fresh during the next and make the "
            "instances it saw busy look busy when they are idle: the first two rows "
            "differ by that alone. The third ranks on request counts alone, as "
            "`coordinator bench herding` (above) checks the reserve path: it differs "
            "from the second by the default's TTFT-aware ranking alone. Requests reach "
            "the nodes over tens of milliseconds, so the first ones' prefills may be over "
            "when the last are ranked, and an instance whose prefill is free can then win "
            "a second request over one whose prefill is still busy.",
        ]
    )
    print(text)
    if args.write_docs:
        write_section("edge-herding", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
