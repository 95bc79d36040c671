"""`coordinator cordon`: take an engine instance out of rotation for maintenance.

No node sends a cordoned instance new requests; the ones in flight finish. With
`--wait` the command then waits until the instance holds none (a drain), printing its
requests in flight as they go down, so that a script can stop or upgrade the engine
next. `--lift` puts it back. The cordon is fleet-wide (lua/record_outcome.lua) and
holds until lifted, or until the engine registers again under a new epoch (a restarted
engine comes back in rotation). Like `coordinator inspect`, the command talks to Redis
directly and takes no node lease.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time

from coordinator.connection import redact
from coordinator.coordinator import Coordinator
from coordinator.errors import CoordinatorError, InvalidArgumentError, UnknownInstanceError
from coordinator.keys import POOL_NAME_RE
from coordinator.settings import Settings
from proxy_node.health import REFRESH_S
from proxy_node.pool_access import add_pool_arguments, leaseless_coordinator

NODE_ID = "cordon"  # the id the command's Coordinator is built with (it takes no lease)
WAIT_DEFAULT_S = 600.0
POLL_S = 0.5  # how often --wait reads the instance's requests in flight
# A node learns of a cordon within REFRESH_S and may reserve on the instance until
# then: no drain is declared before twice that has passed.
SETTLE_S = 2 * REFRESH_S


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `coordinator cordon`."""
    parser.add_argument("instance_id", metavar="INSTANCE_ID", help="the instance to cordon")
    add_pool_arguments(parser, "pool")
    parser.add_argument("--reason", default="", help="why, for other operators (shown by views)")
    parser.add_argument(
        "--lift", action="store_true", help="put the instance back in rotation instead"
    )
    parser.add_argument(
        "--wait",
        nargs="?",
        const=WAIT_DEFAULT_S,
        default=None,
        type=_seconds,
        metavar="SECONDS",
        help="then wait until the instance holds no request (at most SECONDS, default "
        f"{WAIT_DEFAULT_S:g}); exit 1 if some are still in flight then",
    )


def _seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {raw!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {raw}")
    return value


def run(args: argparse.Namespace) -> int:
    """Cordon (or lift); 0 when done (and drained, with --wait), 1 otherwise, 2 on bad use
    (a bad pool name or reason, --wait with --lift)."""
    if not POOL_NAME_RE.fullmatch(args.pool):
        return _fail(f"pool name {args.pool!r} must match {POOL_NAME_RE.pattern}", 2)
    if args.lift and args.wait is not None:
        return _fail("--wait waits for a cordoned instance to drain; it does not go with --lift", 2)
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    coordinator = leaseless_coordinator(args.redis_url, args.pool, NODE_ID, Settings())
    iid = args.instance_id
    try:
        try:
            await coordinator.cordon(iid, args.reason, lift=args.lift)
        except UnknownInstanceError:
            return _fail(f"no instance {iid!r} is registered in pool {args.pool!r}", 1)
        except InvalidArgumentError as exc:
            return _fail(str(exc), 2)
        except CoordinatorError as exc:
            return _fail(f"{redact(args.redis_url)}: {exc}", 1)
        if args.lift:
            print(f"{iid}: back in rotation")
            return 0
        print(f"{iid}: cordoned; nodes stop sending it requests within a second")
        if args.wait is None:
            return 0
        return await _wait_drained(coordinator, iid, args.wait)
    finally:
        await coordinator.close()


async def _wait_drained(coordinator: Coordinator, iid: str, limit_s: float) -> int:
    """Poll the instance's requests in flight until none are left (and every node has
    had time to learn of the cordon) or `limit_s` passed."""
    start = time.monotonic()
    limit_s = max(limit_s, SETTLE_S)
    deadline = start + limit_s
    last: int | None = None
    while True:
        try:
            snapshot = await coordinator.snapshot()
        except CoordinatorError as exc:
            return _fail(f"reading the pool failed: {exc}", 1)
        inflight = snapshot.inflight_of(iid)  # None without Redis: never a drain then
        if inflight != last:
            if inflight is None:
                print(f"{iid}: requests in flight unknown (Redis unreachable)", flush=True)
            else:
                print(f"{iid}: {inflight} request(s) in flight", flush=True)
            last = inflight
        if inflight == 0 and time.monotonic() - start >= SETTLE_S:
            print(f"{iid}: drained")
            return 0
        if time.monotonic() >= deadline:
            held = "an unknown number of" if inflight is None else str(inflight)
            return _fail(f"{iid} still holds {held} request(s) after {limit_s:g} s", 1)
        await asyncio.sleep(POLL_S)


def _fail(message: str, code: int) -> int:
    print(f"coordinator cordon: error: {message}", file=sys.stderr)
    return code
