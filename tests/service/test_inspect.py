"""`coordinator inspect`: the pool read straight from Redis, as JSON, tables, or a live view."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import io
import json
import os
import re
import shlex
import shutil
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from coordinator import Coordinator, Settings
from coordinator_cli.main import build_parser
from local_fleet.embedded import free_port
from proxy_node.inspect import NODE_ID, PoolState, read_pool, render
from tests.fake_engine import Harness
from tests.helpers import delete_pool, register_stale_instance, spec, wait_for

pytestmark = pytest.mark.timeout(40)

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
CLI = [sys.executable, "-m", "coordinator_cli.main", "inspect"]


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without coordinator knobs, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COORD_") and k != "REDIS_URL"}
    env.update(extra)
    return env


async def inspect_cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run `coordinator inspect` as a process: (exit code, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        *CLI,
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env or clean_env(),
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def run_inspect(*argv: str) -> int:
    """Run the subcommand in this process (parsed exactly as the CLI parses it)."""
    args: argparse.Namespace = build_parser().parse_args(["inspect", *argv])
    return int(args._module.run(args))


async def redis_now_ms(c: Coordinator) -> int:
    seconds, micros = await c.redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def load_pool(c: Coordinator) -> dict[str, list[str]]:
    """i0..i3 with 3, 2, 1 and 0 reservations (one in decode), i1 with hints.

    Instances join one by one so least_load puts each batch on the newcomer: every
    total differs, so no tie at the minimum makes the ranking rotate between reads.
    """
    rids: dict[str, list[str]] = {}
    for i, n in enumerate((3, 2, 1, 0)):
        await c.register_instance(spec(i))
        for _ in range(n):
            res = await c.reserve(100, 20)
            rids.setdefault(res.instance_id, []).append(res.rid)
    assert {k: len(v) for k, v in rids.items()} == {"i0": 3, "i1": 2, "i2": 1}
    await c.mark_first_token(rids["i0"][0])
    await c.heartbeat_instance("i1", {"engine_running": 2, "engine_waiting": 1})
    return rids


async def prefill_elapsed(c: Coordinator) -> bool:
    """The predicted prefill windows (a few ms each) are over: backlogs read 0."""
    snap = await c.snapshot()
    return all(row.prefill_free_in_ms == 0 for row in snap.rows if row.alive)


def normalized(doc: dict[str, Any]) -> dict[str, Any]:
    """A view with its read-time-relative fields turned into absolute Redis times.

    generated_at is the Redis time of each read, so every age derived from it differs
    between two reads of unchanged state; `generated_at - age` (the time the instance
    or hint was last seen) does not. node_id names the reader and is checked apart.
    The order of `instances` follows each reader's cache (a full read lists them in
    Redis hash order, a node's cache in the order it learnt them): rows are compared
    by id. Nothing else is excluded: `rank` is stable because no two eligible totals
    tie at the minimum (see load_pool), and the backlogs are 0 once prefill_elapsed
    holds.
    """
    doc = json.loads(json.dumps(doc))
    now = doc.pop("generated_at")
    doc.pop("node_id")
    doc["instances"].sort(key=lambda row: row["id"])
    for row in doc["instances"]:
        row["last_seen_at_ms"] = now - row.pop("last_seen_age_ms")
        row["hint_ages_ms"] = {k: now - v for k, v in row["hint_ages_ms"].items()}
        for hint in row["hints"].values():
            hint["at_ms"] = now - hint.pop("age_ms")
    return doc


async def test_json_equals_the_nodes_debug_view(
    harness: Harness, redis_url: str, pool: str
) -> None:
    await register_stale_instance(redis_url, pool, "gone")
    node = await harness.node(await harness.coordinator(node_id="node-a"))
    await load_pool(node.coordinator)
    await wait_for(lambda: prefill_elapsed(node.coordinator), what="prefill windows to pass")

    async with harness.http.get(node.control_url + "/debug/instance_loads") as resp:
        assert resp.status == 200
        served = await resp.json()
    code, out, err = await inspect_cli("--json", "--redis-url", redis_url, "--pool", pool)
    assert (code, err) == (0, "")
    printed = json.loads(out)

    assert (served["node_id"], printed["node_id"]) == ("node-a", NODE_ID)
    assert printed["generated_at"] >= served["generated_at"]
    assert normalized(printed) == normalized(served)
    # The comparison covers real content, not two empty documents.
    rows = {row["id"]: row for row in printed["instances"]}
    assert set(rows) == {"gone", "i0", "i1", "i2", "i3"}
    assert [rows[i]["inflight"] for i in ("i0", "i1", "i2", "i3")] == [3, 2, 1, 0]
    assert (rows["i0"]["pending_prefill_count"], rows["i0"]["active_decode_count"]) == (2, 1)
    assert rows["gone"]["alive"] is False and rows["gone"]["rank"] is None
    assert [rows[i]["rank"] for i in ("i3", "i2", "i1", "i0")] == [0, 1, 2, 3]  # as served
    assert rows["i1"]["hints"]["engine_running"]["value"] == 2.0
    # Reading took no lease: only the node is in the pool's node set.
    nodes = await node.coordinator.redis.zrange(node.coordinator.keys.column("nodes"), 0, -1)
    assert nodes == ["node-a"]


@pytest.fixture
async def quiet_pool(redis_url: str, pool: str) -> AsyncIterator[Coordinator]:
    """A loaded pool, one node lease and one expired lease; no background task runs."""
    await register_stale_instance(redis_url, pool, "gone")
    c = await Coordinator.connect(
        redis_url, pool=pool, node_id="node-a", settings=Settings(), background=False
    )
    try:
        await load_pool(c)
        await c.redis.zadd(c.keys.column("nodes"), {"node-dead": await redis_now_ms(c) - 5_000})
        yield c
    finally:
        await delete_pool(c.redis, c.settings.key_prefix, pool)
        await c.close()


async def test_tables_show_instances_leases_and_phases(
    quiet_pool: Coordinator, redis_url: str, pool: str
) -> None:
    # Flags from the environment, as an operator's shell would set them.
    env = clean_env(COORD_REDIS_URL=redis_url, COORD_POOL=pool)
    code, out, err = await inspect_cli(env=env)
    assert (code, err) == (0, ""), err
    lines = out.splitlines()
    ids = {"gone", "i0", "i1", "i2", "i3"}
    rows = {cells[1]: cells for cells in map(str.split, lines) if cells[1:2] and cells[1] in ids}
    assert set(rows) == {"gone", "i0", "i1", "i2", "i3"}
    assert rows["gone"][:3] == ["-", "gone", "stale"]
    # rank (1 = chosen first), id, state, epoch, inflight, prefill, decode
    assert rows["i0"][:7] == ["4", "i0", "alive", "1", "3", "2", "1"]
    assert rows["i3"][:7] == ["1", "i3", "alive", "1", "0", "0", "0"]
    # Rows in rank order, the unranked (dead) instance last.
    order = [cells[1] for cells in map(str.split, lines) if cells[1:2] and cells[1] in ids]
    assert order == ["i3", "i2", "i1", "i0", "gone"]
    assert "hidden" not in out  # every column fits the 160 columns of a pipe
    assert "run" in rows["i1"] and "wait" in rows["i1"]  # hint ages
    lease = next(line for line in lines if line.split()[:1] == ["node-a"])
    assert lease.split()[-1].endswith("s") and float(lease.split()[-1][:-1]) > 0
    dead = next(line for line in lines if line.split()[:1] == ["node-dead"])
    assert "expired" in dead and "ago" in dead
    assert "reservations 6: prefill 5, decode 1" in out
    # Where each instance's predicting timing comes from (registered: configured).
    timing = next(line for line in lines if line.split()[:1] == ["i0"] and "configured" in line)
    assert timing.split()[1:3] == ["configured", "(0)"]
    assert f"pool {pool}" in out

    # The same frame, rendered for the docs: the SVG the watch screenshot is made from.
    state = await read_pool(
        Coordinator(quiet_pool.redis, pool=pool, node_id=NODE_ID, settings=Settings()),
        Settings(),
    )
    console = Console(record=True, width=150, file=io.StringIO(), force_terminal=True)
    console.print(render(state, redis_url))
    await asyncio.to_thread(_save_svg, console, ARTIFACTS / "inspect_watch.svg")


async def test_a_cordoned_instance_shows_as_such_and_unranked(
    quiet_pool: Coordinator, redis_url: str, pool: str
) -> None:
    await quiet_pool.cordon("i3", "engine upgrade")
    code, out, err = await inspect_cli(env=clean_env(COORD_REDIS_URL=redis_url, COORD_POOL=pool))
    assert (code, err) == (0, ""), err
    rows = {cells[1]: cells for cells in map(str.split, out.splitlines()) if cells[1:2]}
    assert rows["i3"][:3] == ["-", "i3", "cordoned"]  # the idlest, yet skipped
    assert rows["i2"][:3] == ["1", "i2", "alive"]
    assert ", 1 cordoned" in out


async def test_a_pool_the_audit_rebuilt_says_so(
    quiet_pool: Coordinator, redis_url: str, pool: str
) -> None:
    """`meta`'s audit_reset and audit_reset_ms, once an audit cleared the pool."""
    args = ("--redis-url", redis_url, "--pool", pool)
    code, out, err = await inspect_cli(*args)
    assert (code, err) == (0, "") and "rebuilt" not in out
    meta = quiet_pool.keys.column("meta")
    await quiet_pool.redis.hdel(meta, "audit_at")  # a step is due
    await quiet_pool.redis.delete(quiet_pool.keys.column("reservations"))
    await quiet_pool.renew_lease()
    assert quiet_pool.stats.audit_resets == 1
    code, out, err = await inspect_cli(*args)
    assert (code, err) == (0, ""), err
    line = next(line for line in out.splitlines() if line.startswith("rebuilt by the audit"))
    assert "ago: reservations and by_instance hold other reservations" in line


def busy_pool(instances: int = 16) -> PoolState:
    """A reading with wide values everywhere: long ids, 3 stale hints, 5-digit backlogs."""
    rows = [
        {
            "id": f"gpu-node-{i:02d}",
            "rank": instances - 1 - i,
            "alive": True,
            "epoch": 12,
            "inflight": 128,
            "pending_prefill_count": 64,
            "active_decode_count": 64,
            "next_slot_ready_in_ms": 12345,
            "prefill_free_in_ms": 12345,
            "predicted_total_backlog_ms": 12345,
            "hints": {
                name: {"age_ms": 12345, "fresh": False}
                for name in ("engine_running", "engine_waiting", "queue_depth")
            },
            "least_load_score": {
                "total": 1234.567,
                "weighted_components": {"inflight": 128.0, "engine_running": 64.0},
            },
        }
        for i in range(instances)
    ]
    loads = {
        "generated_at": 1_796_000_000_000,
        "instances": rows,
        "pool": "chat",
        "coordination": "ok",
        "strategy": "least_load",
        "version": 123456,
    }
    return PoolState(loads, [("node-a", 1_796_000_009_000)], {"prefill": 3})


def rendered(state: PoolState, width: int) -> str:
    console = Console(width=width, file=io.StringIO(), highlight=False)
    console.print(render(state, "redis://127.0.0.1:6379/0", width))
    text = console.file.getvalue()
    assert isinstance(text, str)
    return text


def test_the_audit_line_shows_what_was_found_and_how_long_ago() -> None:
    state = busy_pool()
    now = int(state.loads["generated_at"])
    assert "rebuilt" not in rendered(state, 160)
    found = ("meta slots is not the slots held plus free_slots", now - 42_000)
    state = dataclasses.replace(state, audit_reset=found)
    line = next(line for line in rendered(state, 160).splitlines() if line.startswith("rebuilt by"))
    assert "rebuilt by the audit 42.0s ago: meta slots is not the slots held" in line


def test_a_busy_pool_fits_160_columns_and_narrower_terminals_hide_columns() -> None:
    text = rendered(busy_pool(), 160)
    assert "hidden" not in text
    header = next(line for line in text.splitlines() if line.split()[:2] == ["rank", "instance"])
    for name in (
        "epoch",
        "slot ms",
        "free ms",
        "backlog ms",
        "cache",
        "hint ages",
        "top components",
    ):
        assert name in header
    assert max(map(len, text.splitlines())) <= 160
    # One hint age for hints of the same heartbeat.
    assert "run wait queue 12.3s" in text
    # Ranked 1.. in rank order whatever the ids say.
    ranks = [line.split()[:2] for line in text.splitlines() if "gpu-node-" in line]
    assert ranks[:2] == [["1", "gpu-node-15"], ["2", "gpu-node-14"]]

    narrow = rendered(busy_pool(), 100)
    assert max(map(len, narrow.splitlines())) <= 100
    caption = next(line for line in narrow.splitlines() if "hidden" in line)
    assert caption.split()[1] == "columns" and int(caption.split()[0]) > 1
    # Just one column too wide: the caption says so in the singular.
    full = max(map(len, text.splitlines()))
    one_short = rendered(busy_pool(), full - 1)
    assert "1 column hidden: widen the terminal or use --json" in one_short


def _save_svg(console: Console, path: Path) -> None:
    svg = console.export_svg(title="coordinator inspect --watch")
    # Rich points its font at a CDN; a viewer of this file should fetch nothing.
    svg = re.sub(r',\s*url\("https?://[^"]+"\) format\("[^"]+"\)', "", svg)
    assert "cdnjs" not in svg
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(svg)


async def test_check_lists_what_does_not_hold(quiet_pool: Coordinator, redis_url: str) -> None:
    """`inspect --check` on a loaded pool: consistent (exit 0); with one counter and
    the pool's total edited by hand, it names both (exit 1)."""
    args = ("--redis-url", redis_url, "--pool", quiet_pool.pool, "--check")
    code, out, err = await inspect_cli(*args)
    assert (code, err) == (0, ""), err
    assert out == f"pool {quiet_pool.pool!r}: consistent\n"
    await quiet_pool.redis.hincrby(quiet_pool.keys.column("meta"), "inflight_total", 3)
    code, out, _ = await inspect_cli(*args)
    assert code == 1
    assert "meta inflight_total" in out
    assert out.endswith(f"pool {quiet_pool.pool!r}: 2 invariant(s) do not hold\n"), out


def test_bad_pool_name_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_inspect("--pool", "a{b}", "--redis-url", "redis://127.0.0.1:1/0") == 2
    assert "pool name 'a{b}'" in capsys.readouterr().err
    assert run_inspect("--json", "--watch", "--redis-url", "redis://127.0.0.1:1/0") == 2
    assert "does not combine" in capsys.readouterr().err
    assert run_inspect("--check", "--json", "--redis-url", "redis://127.0.0.1:1/0") == 2
    assert "combines with neither" in capsys.readouterr().err
    for bad in ("0", "-1", "nan", "x", "1e9"):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(["inspect", "--watch", bad])
        assert exit_info.value.code == 2
        assert "--watch" in capsys.readouterr().err


def test_unreachable_redis_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    assert run_inspect("--redis-url", url, "--pool", "p") == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "error: Redis at redis://***@127.0.0.1:" in captured.err
    assert "cannot read pool 'p'" in captured.err and "hunter2" not in captured.err
    assert run_inspect("--redis-url", url, "--pool", "p", "--check") == 1
    captured = capsys.readouterr()
    assert "cannot read pool 'p'" in captured.err and "hunter2" not in captured.err
    assert run_inspect("--redis-url", "http://127.0.0.1:1", "--pool", "p") == 2


async def test_watch_into_a_pipe_prints_plain_frames(
    quiet_pool: Coordinator, redis_url: str, pool: str
) -> None:
    env = clean_env(COORD_REDIS_URL=redis_url, COORD_POOL=pool)
    proc = await asyncio.create_subprocess_exec(
        *CLI,
        "--watch",
        "0.1",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        # Frames follow one another, like `top -b`: read until the third one starts.
        while sum("reservations 6: prefill 5, decode 1" in line for line in lines) < 2:
            line = await asyncio.wait_for(proc.stdout.readline(), 20)
            assert line, f"the watch wrote no frame into a pipe: {lines}"
            lines.append(line.decode())
        proc.send_signal(signal.SIGINT)
        rest, err = await asyncio.wait_for(proc.communicate(), 20)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    out = "".join(lines) + rest.decode()
    assert proc.returncode == 0, err.decode()
    assert "\x1b[" not in out  # plain text: no cursor movement, no colour
    assert out.count("node leases") >= 2
    assert "Traceback" not in err.decode()


class Tmux:
    """A private tmux server (its own socket) running one command in a fixed-size pane."""

    def __init__(self, tmp: Path) -> None:
        self.socket = f"inspect-{uuid.uuid4().hex[:8]}"
        self.conf = tmp / "tmux.conf"
        self.conf.write_text("set -g remain-on-exit on\nset -g history-limit 200\n")

    async def tmux(self, *args: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            "tmux",
            "-L",
            self.socket,
            "-f",
            str(self.conf),
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 10)
        assert proc.returncode == 0, (args, err.decode())
        return out.decode()

    async def start(self, command: str) -> None:
        await self.tmux("new-session", "-d", "-s", "w", "-x", "170", "-y", "40", command)

    async def screen(self) -> str:
        return await self.tmux("capture-pane", "-p", "-t", "w")

    async def close(self) -> None:
        proc = await asyncio.create_subprocess_exec(
            "tmux",
            "-L",
            self.socket,
            "kill-server",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        await proc.wait()


async def test_watch_refreshes_in_place_and_quits_on_ctrl_c(
    quiet_pool: Coordinator, redis_url: str, pool: str, tmp_path: Path
) -> None:
    if shutil.which("tmux") is None or shutil.which("bash") is None:
        pytest.skip("tmux is not installed (apt-get install -y tmux)")
    term = Tmux(tmp_path)
    inspect = shlex.join(
        [
            "env",
            "-u",
            "COLUMNS",
            "-u",
            "LINES",
            f"COORD_REDIS_URL={redis_url}",
            f"COORD_POOL={pool}",
            *CLI,
            "--watch",
            "0.2",
        ]
    )
    # bash reports the exit code itself: tmux 3.3 sometimes never reaps a pane's
    # process, leaving #{pane_dead_status} empty. Ctrl-C reaches bash too, and bash
    # carries on after a child that handled SIGINT and exited normally.
    command = shlex.join(["bash", "-c", f'{inspect}; echo "inspect exited with status $?"'])
    try:
        await term.start(command)
        screens: list[str] = []

        async def showing(text: str) -> bool:
            screens.append(await term.screen())
            return text in screens[-1]

        await wait_for(lambda: showing("reservations 6: prefill 5, decode 1"), what="first frame")
        first = screens[-1]
        assert "i0" in first and "node-a" in first and "stale" in first
        # New state in Redis: the running watch shows it without being restarted.
        res = await quiet_pool.reserve(100, 20)
        await quiet_pool.mark_first_token(res.rid)
        await wait_for(lambda: showing("reservations 7: prefill 5, decode 2"), what="new frame")
        # Redrawn in place: one frame on screen, not a scrolling log of frames.
        assert screens[-1].count("node leases") == 1
        assert "inspect exited" not in screens[-1]

        await term.tmux("send-keys", "-t", "w", "C-c")
        await wait_for(lambda: showing("inspect exited with status"), what="the watch to exit")
        final = screens[-1]
        assert "inspect exited with status 0" in final, final
        assert "Traceback" not in final and "KeyboardInterrupt" not in final
        assert final.count("node leases") == 1  # the last frame stays on screen
    finally:
        await term.close()
