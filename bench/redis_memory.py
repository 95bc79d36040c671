"""Redis memory per registered instance and per live reservation, for sizing a shard.

On a private server (or `--redis-url`, whose other tenants then blur the numbers),
one pool is warmed up with one instance and one reserve/release (the scripts get
loaded), then instances are registered and reservations made in steps; the table
gives the growth of INFO `used_memory` (client buffers left out) per item, and what a pool of
`--project-instances` instances with `--project-streams` streams in flight would take.

    python bench/redis_memory.py
    python bench/redis_memory.py --instances 1000 --reservations 20000
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from collections.abc import Sequence

from bench.pool import register_idle_pool
from coordinator import Coordinator, Settings
from local_fleet.embedded import EmbeddedRedis
from local_fleet.pools import delete_pool

SETTINGS = Settings(instance_ttl_ms=3_600_000, lease_ms=3_600_000, redis_timeout_ms=5_000)
BATCH = 16  # reservations made concurrently (few connections: they use memory too)
PROMPT_TOKENS, OUTPUT_TOKENS = 512, 256


async def used_memory(c: Coordinator) -> int:
    """The server's `used_memory` without its client buffers, bytes."""
    info = await c.redis.info("memory")
    return int(info["used_memory"]) - int(info.get("mem_clients_normal", 0))


async def warm_up(url: str) -> None:
    """Load the scripts with one reserve/release on a pool of one, then delete that pool."""
    pool = f"mem-warm-{uuid.uuid4().hex[:8]}"
    await register_idle_pool(url, pool, 1, SETTINGS)
    c = await Coordinator.connect(url, pool=pool, settings=SETTINGS, background=False)
    try:
        await c.release((await c.reserve(PROMPT_TOKENS, OUTPUT_TOKENS)).rid)
    finally:
        await c.close()
        await asyncio.to_thread(delete_pool, url, pool, SETTINGS.key_prefix)


async def measure(url: str, instances: int, reservations: int) -> dict[str, float]:
    """Bytes per instance and per reservation, and what releasing all of them left."""
    await warm_up(url)
    pool = f"mem-{uuid.uuid4().hex[:8]}"
    c = await Coordinator.connect(url, pool=pool, settings=SETTINGS, background=False)
    try:
        base = await used_memory(c)
        await register_idle_pool(url, pool, instances, SETTINGS)
        registered = await used_memory(c)
        rids: list[str] = []
        for start in range(0, reservations, BATCH):
            count = min(BATCH, reservations - start)
            made = await asyncio.gather(
                *(c.reserve(PROMPT_TOKENS, OUTPUT_TOKENS) for _ in range(count))
            )
            rids += [r.rid for r in made]
        reserved = await used_memory(c)
        for start in range(0, len(rids), BATCH):
            await asyncio.gather(*(c.release(rid) for rid in rids[start : start + BATCH]))
        released = await used_memory(c)
    finally:
        await c.close()
        await asyncio.to_thread(delete_pool, url, pool, SETTINGS.key_prefix)
    return {
        "instances": instances,
        "reservations": reservations,
        "per_instance": (registered - base) / instances,
        "per_reservation": (reserved - registered) / reservations,
        "left_after_release": released - registered,
    }


def render(rows: list[dict[str, float]], server: str, streams: int, fleet: int) -> str:
    """The table, and the projection from its last row."""
    lines = [
        f"Server: {server}. Growth of INFO used_memory minus mem_clients_normal (bytes).",
        "",
        "| instances | reservations | bytes/instance | bytes/reservation "
        "| after releasing all, vs before reserving |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['instances']:,.0f} | {r['reservations']:,.0f} | {r['per_instance']:,.0f} "
            f"| {r['per_reservation']:,.0f} | {r['left_after_release']:,.0f} |"
        )
    last = rows[-1]
    total = last["per_instance"] * fleet + last["per_reservation"] * streams
    lines += [
        "",
        f"Projected for {fleet:,} instances and {streams:,} streams in flight: "
        f"{total / 1e6:,.0f} MB (from the last row).",
    ]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the script."""
    parser.add_argument("--redis-url", help="use this server (default: a private embedded server)")
    parser.add_argument(
        "--instances",
        type=int,
        nargs="+",
        default=[100, 1000, 10000],
        help="pool sizes to measure (default: %(default)s)",
    )
    parser.add_argument(
        "--reservations",
        type=int,
        default=10_000,
        help="live reservations made on each pool (default: %(default)s)",
    )
    parser.add_argument(
        "--project-instances",
        type=int,
        default=10_000,
        help="instances of the projected fleet (default: %(default)s)",
    )
    parser.add_argument(
        "--project-streams",
        type=int,
        default=100_000,
        help="streams in flight in the projected fleet (default: %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    """Measure every pool size, print the table."""
    if min(*args.instances, args.reservations) < 1:
        print("error: --instances and --reservations must be >= 1", file=sys.stderr)
        return 2
    server = None if args.redis_url else EmbeddedRedis().start()
    url: str = args.redis_url if server is None else server.url
    try:
        rows = [asyncio.run(measure(url, n, args.reservations)) for n in args.instances]
        name = server.version_line if server is not None else url.split("@")[-1]
    finally:
        if server is not None:
            server.stop()
    print(render(rows, name, args.project_streams, args.project_instances))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The standalone script."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
