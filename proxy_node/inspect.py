"""`coordinator inspect`: a pool's instances, node leases and reservations, read from Redis.

No proxy node is needed: the command builds a Coordinator of its own (node id
`inspect`) and only reads. It never takes a lease (Coordinator.connect would), so an
operator watching a pool leaves no node behind for the reapers.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError
from rich import box
from rich.console import Console, Group, JustifyMethod, RenderableType
from rich.live import Live
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from coordinator.connection import redact
from coordinator.coordinator import Coordinator
from coordinator.errors import CoordinatorError, InvalidArgumentError
from coordinator.invariants import pool_problems
from coordinator.keys import POOL_NAME_RE, PoolKeys
from coordinator.packed import as_text
from coordinator.settings import Settings
from coordinator.tasks import raise_if_cancelling
from proxy_node.pool_access import add_pool_arguments, leaseless_coordinator
from proxy_node.views import instance_loads_view, selection_exclusions

NODE_ID = "inspect"  # shown as node_id in --json, like a node's /debug/instance_loads
WATCH_DEFAULT_S = 2.0
WATCH_MIN_S = 0.1  # faster refreshes would only load Redis; nothing changes that fast to a human
WATCH_MAX_S = 3600.0
RESERVATION_SCAN_COUNT = 500  # HSCAN batch: a big pool is read without blocking Redis
PLAIN_WIDTH = 160  # table width when stdout is not a terminal (pipes, files, tests)
# Short names keep a 64-instance table readable in a terminal.
HINT_LABELS = {"engine_running": "run", "engine_waiting": "wait", "queue_depth": "queue"}
COMPONENT_LABELS = {
    "inflight": "inflight",
    "engine_running": "running",
    "engine_waiting": "waiting",
    "queue_depth": "queue",
    "pending_prefill": "prefill",
    "active_decode": "decode",
    "backlog_ms": "backlog",
}


class InspectError(Exception):
    """Redis could not be read; the message says why."""


@dataclass(frozen=True, slots=True)
class PoolState:
    """One reading of a pool: the debug view, the node leases and the phase counts."""

    loads: dict[str, Any]  # exactly what /debug/instance_loads serves
    nodes: list[tuple[str, int]]  # (node id, lease deadline in Redis ms), soonest first
    phases: dict[str, int] = field(default_factory=dict)  # reservation phase -> count
    # The last pool rebuild by the audit (lua/renew_lease.lua): what it found, and when
    # (Redis ms); None when none happened since the pool's keys were last created.
    audit_reset: tuple[str, int] | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `coordinator inspect`."""
    add_pool_arguments(parser, "pool to inspect")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the /debug/instance_loads document instead of tables",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the pool's invariants as stored (counters, index and totals against "
        "the reservation records, in one read of the whole pool) and list what does not "
        "hold; exit 1 if anything does not, 0 if the pool is consistent",
    )
    parser.add_argument(
        "--watch",
        nargs="?",
        const=WATCH_DEFAULT_S,
        default=None,
        type=_interval,
        metavar="SECONDS",
        help=f"refresh in place every SECONDS (default {WATCH_DEFAULT_S:g}) until Ctrl-C; "
        "when stdout is not a terminal, print one plain frame after another (like top -b)",
    )


def _interval(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {raw!r}") from None
    if not math.isfinite(value) or not WATCH_MIN_S <= value <= WATCH_MAX_S:
        raise argparse.ArgumentTypeError(
            f"refresh interval must be in {WATCH_MIN_S:g}..{WATCH_MAX_S:g} seconds, got {raw}"
        )
    return value


def run(args: argparse.Namespace) -> int:
    """Print the pool once (or keep refreshing with --watch); 1 if Redis cannot be read."""
    if not POOL_NAME_RE.fullmatch(args.pool):
        _error(f"pool name {args.pool!r} must match {POOL_NAME_RE.pattern} (no braces)")
        return 2
    if args.json and args.watch is not None:
        _error("--json prints one document; it does not combine with --watch")
        return 2
    if args.check and (args.json or args.watch is not None):
        _error("--check prints what does not hold; it combines with neither --json nor --watch")
        return 2
    try:
        settings = Settings.from_env()
        coordinator = _coordinator(args.redis_url, args.pool, settings)
    except InvalidArgumentError as exc:
        _error(str(exc))
        return 2
    if args.watch is not None:
        # On a terminal, redraw in place; into a pipe or file, print one plain frame
        # after another, as `top -b` does.
        watch = _watch if sys.stdout.isatty() else _watch_plain
        try:
            asyncio.run(watch(coordinator, args, settings))
        except KeyboardInterrupt:
            pass  # Ctrl-C is how a watch ends
        except BrokenPipeError:
            # The reader went away (`| head`): stop quietly, without a second error
            # when Python flushes stdout at exit.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    if args.check:
        return _check(coordinator, args.redis_url)
    try:
        state = asyncio.run(_read_once(coordinator, settings))
    except InspectError as exc:
        _error(f"Redis at {redact(args.redis_url)}: {exc}")
        return 1
    if args.json:
        print(json.dumps(state.loads, indent=2))
    else:
        console = _plain_console()
        console.print(render(state, args.redis_url, console.width))
    return 0


def _check(coordinator: Coordinator, url: str) -> int:
    """`--check`: the pool's invariants (coordinator/invariants.py), 1 if any fails."""

    async def problems() -> list[str]:
        try:
            return await pool_problems(coordinator.redis, coordinator.keys)
        finally:
            await coordinator.close()

    try:
        found = asyncio.run(problems())
    except (RedisError, OSError) as exc:
        _error(f"Redis at {redact(url)}: cannot read pool {coordinator.pool!r}: {exc}")
        return 1
    for problem in found:
        print(problem)
    where = f"pool {coordinator.pool!r}"
    print(f"{where}: {len(found)} invariant(s) do not hold" if found else f"{where}: consistent")
    return 1 if found else 0


def _error(message: str) -> None:
    print(f"coordinator inspect: error: {message}", file=sys.stderr)


def _coordinator(url: str, pool: str, settings: Settings) -> Coordinator:
    return leaseless_coordinator(url, pool, NODE_ID, settings)


def _plain_console() -> Console:
    wide = sys.stdout.isatty() or "COLUMNS" in os.environ
    return Console(width=None if wide else PLAIN_WIDTH, highlight=False)


async def _read_once(coordinator: Coordinator, settings: Settings) -> PoolState:
    try:
        return await read_pool(coordinator, settings)
    finally:
        await coordinator.close()


async def read_pool(coordinator: Coordinator, settings: Settings) -> PoolState:
    """Snapshot, rank and read leases and reservations; raises InspectError if Redis fails."""
    try:
        # snapshot() hides an unreachable Redis behind degraded mode: ask it directly
        # first so the error names the cause, then check the state snapshot() left.
        await coordinator.redis.ping()
        await coordinator.sync_timing()  # the learned timing every node predicts with
        snapshot = await coordinator.snapshot()
        if coordinator.coordination != "ok":
            raise InspectError(f"cannot read pool {coordinator.pool!r}: Redis did not answer")
        keys = PoolKeys(settings.key_prefix, coordinator.pool)
        raw_nodes = await coordinator.redis.zrange(keys.column("nodes"), 0, -1, withscores=True)
        found, at = await coordinator.redis.hmget(
            keys.column("meta"), "audit_reset", "audit_reset_ms"
        )
        outliers = await coordinator.read_outliers()
        phases: Counter[str] = Counter()
        async for _, raw in coordinator.redis.hscan_iter(
            keys.column("reservations"), count=RESERVATION_SCAN_COUNT
        ):
            phases[_phase_of(raw)] += 1
    except (RedisError, OSError, CoordinatorError) as exc:
        raise InspectError(f"cannot read pool {coordinator.pool!r}: {exc}") from exc
    # The ranking a node would make: ejected instances are skipped (passive health).
    ranking = coordinator.rank(
        snapshot, settings.strategy, exclude=selection_exclusions(snapshot, outliers)
    )
    try:
        held = await coordinator.prefix.index_tokens([(r.id, r.epoch) for r in snapshot.rows])
    except (RedisError, OSError) as exc:
        raise InspectError(f"cannot read pool {coordinator.pool!r}: {exc}") from exc
    loads = instance_loads_view(
        snapshot, ranking, settings, NODE_ID, coordinator.pool, outliers, index_tokens=held
    )
    nodes = [(str(node), int(deadline)) for node, deadline in raw_nodes]
    at_ms = "" if at is None else as_text(at)  # written by the script: digits, unless edited
    reset = (as_text(found), int(at_ms)) if found is not None and at_ms.isdigit() else None
    return PoolState(loads, nodes, dict(sorted(phases.items())), reset)


def _phase_of(raw: Any) -> str:
    try:
        record = json.loads(raw)
    except (TypeError, ValueError):
        return "unreadable"
    phase = record.get("phase") if isinstance(record, dict) else None
    return phase if isinstance(phase, str) else "unknown"


class _Frames:
    """Successive frames of a watch: one Coordinator while Redis answers, a fresh one after."""

    def __init__(
        self, coordinator: Coordinator, args: argparse.Namespace, settings: Settings
    ) -> None:
        self.current: Coordinator | None = coordinator
        self.args = args
        self.settings = settings

    async def next(self, width: int | None) -> RenderableType:
        """Read the pool and render it, or render why it could not be read."""
        if self.current is None:
            self.current = _coordinator(self.args.redis_url, self.args.pool, self.settings)
        try:
            # One Coordinator across frames: its cache reads specs only when they change.
            state = await read_pool(self.current, self.settings)
        except InspectError as exc:
            # A degraded Coordinator would start re-asserting a lease for node
            # `inspect` once Redis is back: drop it and start afresh next frame.
            await self.current.close()
            self.current = None
            return Text(
                f"error: Redis at {redact(self.args.redis_url)}: {exc}\n"
                f"retrying every {self.args.watch:g}s (Ctrl-C to quit)",
                style="red",
            )
        return render(state, self.args.redis_url, width)

    async def close(self) -> None:
        """Close the Coordinator in use."""
        if self.current is not None:
            await self.current.close()
            self.current = None


async def _watch(coordinator: Coordinator, args: argparse.Namespace, settings: Settings) -> None:
    """Redraw in place every args.watch seconds until cancelled (Ctrl-C)."""
    console = Console(highlight=False)
    frames = _Frames(coordinator, args, settings)
    try:
        with Live(console=console, auto_refresh=False, transient=False) as live:
            while True:
                live.update(await frames.next(console.width), refresh=True)
                raise_if_cancelling()  # redis-py may have swallowed Ctrl-C's cancel
                await asyncio.sleep(args.watch)
    finally:
        await frames.close()


async def _watch_plain(
    coordinator: Coordinator, args: argparse.Namespace, settings: Settings
) -> None:
    """Print one plain frame every args.watch seconds, each after a blank line (`top -b`)."""
    console = _plain_console()
    frames = _Frames(coordinator, args, settings)
    try:
        while True:
            console.print(await frames.next(console.width))
            console.print()
            console.file.flush()
            await asyncio.sleep(args.watch)
    finally:
        await frames.close()


def render(state: PoolState, redis_url: str, width: int | None = None) -> Group:
    """The tables of one reading: header, instances, node leases, reservation phases.

    `width` is the terminal's: instance columns that do not fit are left out.
    """
    loads = state.loads
    now_ms = int(loads["generated_at"])
    instances = loads["instances"]
    alive = sum(1 for row in instances if row["alive"])
    ejected = sum(1 for row in instances if (row.get("outlier") or {}).get("ejected"))
    cordoned = sum(1 for row in instances if (row.get("outlier") or {}).get("cordoned"))
    header = Text.assemble(
        ("pool ", "dim"),
        (str(loads["pool"]), "bold"),
        ("  redis ", "dim"),
        redact(redis_url),
        ("  coordination ", "dim"),
        (str(loads["coordination"]), "green" if loads["coordination"] == "ok" else "red"),
        ("  strategy ", "dim"),
        str(loads["strategy"]),
        ("  version ", "dim"),
        str(loads["version"]),
        ("  instances ", "dim"),
        f"{alive} alive / {len(instances)}"
        + (f", {ejected} ejected" if ejected else "")
        + (f", {cordoned} cordoned" if cordoned else ""),
        ("  redis time ", "dim"),
        str(now_ms),
    )
    parts: list[RenderableType] = [
        header,
        _instance_table(instances, width),
        _timing_table(instances),
        _node_table(state.nodes, now_ms),
        _phase_line(state.phases),
    ]
    if state.audit_reset is not None:
        found, at = state.audit_reset
        parts.append(
            Text.assemble(
                ("rebuilt by the audit ", "bold red"),
                f"{_age(max(0, now_ms - at))} ago: {found} (a key lost or edited by hand; "
                "docs/reliability.md)",
            )
        )
    return Group(*parts)


# Instance table columns: (header, justify, keep). When the terminal is too narrow,
# columns are hidden highest `keep` first, like top does, rather than squeezing every
# cell into an ellipsis; the instance id is never hidden.
INSTANCE_COLUMNS: tuple[tuple[str, JustifyMethod, int], ...] = (
    ("rank", "right", 5),
    ("instance", "left", 0),
    ("state", "left", 1),
    ("epoch", "right", 9),
    ("inflight", "right", 2),
    ("prefill", "right", 4),
    ("decode", "right", 4),
    ("fails", "right", 5),
    ("slot ms", "right", 11),
    ("free ms", "right", 10),
    ("backlog ms", "right", 6),
    ("cache", "right", 10),
    ("hint ages", "left", 8),
    ("score", "right", 3),
    ("top components", "left", 7),
)


def _state_cell(row: dict[str, Any]) -> Text:
    outlier = row.get("outlier") or {}
    if not row["alive"]:
        return Text("stale", "red")
    if outlier.get("cordoned"):
        return Text("cordoned", "magenta")
    if outlier.get("ejected"):
        return Text(f"ejected({math.ceil(outlier['ejected_for_ms'] / 1000)}s)", "yellow")
    return Text("alive", "green")


def _instance_cells(row: dict[str, Any]) -> list[Text]:
    score = row["least_load_score"] or {}
    rank = row["rank"]
    outlier = row.get("outlier") or {}
    return [
        Text(_num(None if rank is None else rank + 1)),  # 1 = chosen first
        Text(str(row["id"])),
        _state_cell(row),
        Text(_num(row["epoch"])),
        Text(_num(row["inflight"])),
        Text(_num(row["pending_prefill_count"])),
        Text(_num(row["active_decode_count"])),
        Text(_num(outlier.get("consecutive_failures", 0))),
        Text(_num(row["next_slot_ready_in_ms"])),
        Text(_num(row["prefill_free_in_ms"])),
        Text(_num(row["predicted_total_backlog_ms"])),
        Text(_tokens((row.get("prefix") or {}).get("index_tokens"))),
        _hint_ages(row["hints"]),
        Text(_num(score.get("total"), 3)),
        Text(_top_components(score.get("weighted_components") or {})),
    ]


def _tokens(value: int | None) -> str:
    """A token count, short: 1234 -> 1.2k, 1500000 -> 1.5M."""
    if value is None:
        return "-"
    if value >= 1_000_000:
        return f"{value / 1_000_000:.1f}M"
    if value >= 1000:
        return f"{value / 1000:.1f}k"
    return str(value)


def _timing_table(instances: list[dict[str, Any]]) -> Table:
    """The timing each instance is predicted with, and where it came from."""
    table = Table(
        title="prediction timing", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False
    )
    for name, justify in (
        ("instance", "left"),
        ("prefill from", "left"),
        ("ms/token", "right"),
        ("overhead ms", "right"),
        ("decode from", "left"),
        ("ms/token ", "right"),
    ):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for row in sorted(instances, key=_rank_order):
        t = row.get("timing")
        if not t:
            continue
        table.add_row(
            str(row["id"]),
            f"{t['prefill']} ({t['prefill_samples']})",
            _num(t["prefill_ms_per_token"], 3),
            _num(t["prefill_overhead_ms"], 1),
            f"{t['decode']} ({t['decode_samples']})",
            _num(t["decode_ms_per_token"], 2),
        )
    return table


def _rank_order(row: dict[str, Any]) -> tuple[bool, int, str]:
    # Ranked rows first, best first; unranked (dead, or not eligible) after, by id.
    rank = row["rank"]
    return (rank is None, rank if rank is not None else 0, str(row["id"]))


def _instance_table(instances: list[dict[str, Any]], width: int | None) -> Table:
    rows = [_instance_cells(row) for row in sorted(instances, key=_rank_order)]
    shown = set(range(len(INSTANCE_COLUMNS)))
    if width is not None:
        for k in sorted(shown, key=lambda k: -INSTANCE_COLUMNS[k][2]):
            if _table_width(_build_table(rows, shown, 0)) <= width or INSTANCE_COLUMNS[k][2] == 0:
                break
            shown.discard(k)
    return _build_table(rows, shown, len(INSTANCE_COLUMNS) - len(shown))


def _build_table(rows: list[list[Text]], shown: set[int], hidden: int) -> Table:
    caption = None
    if hidden:
        noun = "column" if hidden == 1 else "columns"
        caption = f"{hidden} {noun} hidden: widen the terminal or use --json"
    table = Table(
        title="instances",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        collapse_padding=True,  # two spaces between columns, not three: 13 columns fit 160
        pad_edge=False,
        caption=caption,
        caption_justify="left",
    )
    for k, (name, justify, _) in enumerate(INSTANCE_COLUMNS):
        if k in shown:
            table.add_column(name, justify=justify, no_wrap=True)
    for cells in rows:
        table.add_row(*(cell for k, cell in enumerate(cells) if k in shown))
    return table


def _table_width(table: Table) -> int:
    """The width the table takes when nothing is squeezed, as rich itself measures it."""
    console = Console(width=10_000, file=io.StringIO())
    return Measurement.get(console, console.options, table).maximum


def _node_table(nodes: list[tuple[str, int]], now_ms: int) -> Table:
    table = Table(title="node leases", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False)
    table.add_column("node", no_wrap=True)
    table.add_column("lease deadline", justify="right")
    table.add_column("expires in", justify="right")
    for node, deadline in nodes:
        left_s = (deadline - now_ms) / 1000
        expiry = (
            Text(f"{left_s:.1f}s")
            if left_s >= 0
            else Text(f"expired {-left_s:.1f}s ago", style="red")
        )
        table.add_row(node, str(deadline), expiry)
    if not nodes:
        table.add_row(Text("(no node holds a lease)", style="dim"), "", "")
    return table


def _phase_line(phases: dict[str, int]) -> Text:
    total = sum(phases.values())
    counts = {"prefill": 0, "decode": 0, **phases}
    parts = ", ".join(f"{phase} {count}" for phase, count in counts.items())
    return Text.assemble(("reservations ", "bold"), f"{total}: {parts}")


def _num(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    if digits and isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _hint_ages(hints: dict[str, dict[str, Any]]) -> Text:
    # Hints sent in one heartbeat share their age: one age per group keeps it narrow,
    # e.g. "run wait 1.2s".
    if not hints:
        return Text("-", style="dim")
    groups: dict[tuple[str, bool], list[str]] = {}
    for name, hint in hints.items():
        key = (_age(int(hint["age_ms"])), bool(hint["fresh"]))
        groups.setdefault(key, []).append(HINT_LABELS.get(name, name))
    out = Text()
    for (age, fresh), names in groups.items():
        if out:
            out.append(", ")
        out.append(f"{' '.join(names)} {age}", style=None if fresh else "red")
    return out


def _age(ms: int) -> str:
    if ms < 1000:
        return f"{ms}ms"
    return f"{ms / 1000:.1f}s" if ms < 100_000 else f"{ms // 1000}s"


def _top_components(weighted: dict[str, float]) -> str:
    top = sorted(((v, k) for k, v in weighted.items() if v > 0), reverse=True)[:2]
    return (
        ", ".join(f"{COMPONENT_LABELS.get(name, name)} {value:.3g}" for value, name in top) or "-"
    )
