"""Redis server instructions per request, counted by valgrind's callgrind: a cost that
does not move with this shared machine's speed (the µs of bench/scaling.py and
bench/prefix_cost.py move 2-4x from one day to the next), for comparing script changes.

    python bench/instructions.py [--against REF] [--instances 64 1024] [--requests 300]

Each tree (this checkout, and REF's when given) runs its own node code in a child
process: on a private server it sets a workload's pool up, keeps the pool's keys
(DUMP) and records every call the nodes then send. The parent replays each recording
on one server run under callgrind, from the state the recording started from (RESTORE),
with that tree's scripts, counting instructions only inside `processCommand`: the
execution of each command a client sent, scripts and the commands they run included,
socket reads, parsing and writes not. The same calls from the same state run nearly
the same instructions: replays of one recording agree within about 2% (what differs is
the Redis clock the scripts read, so the numbers they format and the strings Lua
interns and collects), against 2-4x for µs on this machine from one day to the next.

Workloads (`--instances` each):
- request: one node's proxied requests, as bench/scaling.py section 1 makes them:
  `reserve`, its first-token mark and (512 requests later: the pool holds 512 in
  flight) its release, which ride on the node's next `reserve`;
- request, 64 nodes: the same cycles from 64 nodes at once (one process, each node
  its own connection, view and lease, and 8 of the 512 in flight, as bench/scaling.py
  section 1 runs them): its
  ratio to `request` is the busy shard's flatness in nodes (issue 12), in
  instructions, where the replayed µs of bench/scaling.py move from run to run;
- index follow-up / index new prompt: the prefix index's lookup (one HMGET) and the
  record, with every instance's index full at 100,000 tokens of 30-block
  conversations, for a follow-up turn (+2 blocks on a held conversation, sent to its
  holder) and for a new 30-block prompt (bench/prefix_report.py's cost table). A
  record rides along with the node's next `reserve` in service; here each goes in a
  `carry` call of its own, less an empty `carry` call per request, recorded and
  replayed apart: what carrying a record adds to a call (a tree from before records
  rode along: its whole `record_prefix` call). Calls per request are counted the
  same way: the lookup's HMGETs, and a sampled reclaim's commands.

Needs valgrind on PATH (Debian's package `valgrind`).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import pickle
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Nothing of this checkout is imported at the top: a child process loads this file to
# record with another tree's code, which must come first on its path.
ROOT = Path(__file__).resolve().parent.parent

FLEET = 64  # nodes of the "request, 64 nodes" workload
WORKLOADS = ("request", f"request, {FLEET} nodes", "index follow-up", "index new prompt")
# Reservations in flight in the pool while a request workload records, whatever its
# node count (each node its share), as bench/scaling.py holds them: more nodes carry
# the same load, not more of it.
IN_FLIGHT = 512
WARMUP = 20  # request cycles past a node's share before the recording starts
INDEX_TOKENS = 100_000  # each instance's prefix index, filled before recording
BLOCKS, ADDED = 30, 2  # a conversation's blocks; the blocks a follow-up turn adds
TOGGLE = "processCommand"  # callgrind counts only inside this server function
PIPELINE = 500  # calls per pipeline in a replay
LUA_GC_PERIOD = 50  # Redis steps Lua's collector once every this many scripts

# Runs in a child whose code is one tree (argv[1]); the workloads are this file's.
RUNNER = """
import asyncio, importlib.util, sys
tree, here, url, instances, requests, out, workloads = sys.argv[1:8]
sys.path.insert(0, tree)
spec = importlib.util.spec_from_file_location("instructions_workloads", here)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
bench.record_all(url, int(instances), int(requests), out, workloads.split("|"))
"""

Call = tuple[str, str, list[Any], list[Any]]  # ("evalsha", script, keys, args) | ("cmd", ...)


class CallLog:
    """The calls a workload's node sends, in order, with each reply's status word."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.statuses: list[Any] = []
        self.on = False

    def command(self, args: Sequence[Any], reply: Any) -> None:
        """Note one plain command (its whole argument list, name first)."""
        if self.on:
            self.calls.append(("cmd", str(args[0]), [], list(args)))
            self.statuses.append(plain_status(reply))

    def attach(self, c: Any) -> None:
        """Record `c`'s script calls and its prefix index's plain commands while `on`."""
        from coordinator import scripts

        own_keys: frozenset[str] = getattr(scripts, "OWN_KEYS", frozenset())  # older: none
        inner = c._direct_call
        log = self

        async def recording(name: str, args: list[Any], extra: tuple[Any, ...] = ()) -> Any:
            reply = await inner(name, args, extra)
            if log.on:
                keys = list(extra) if name in own_keys else [*c._columns, *extra]
                log.calls.append(("evalsha", name, keys, list(args)))
                log.statuses.append(status_of(reply))
            return reply

        c._direct_call = recording
        prefix = getattr(c, "prefix", None)
        if prefix is not None:
            prefix._redis = _Recorded(prefix._redis, log)


class _Recorded:
    """A client whose commands, direct or pipelined, a CallLog notes."""

    def __init__(self, redis: Any, log: CallLog) -> None:
        self._redis = redis
        self._log = log

    def __getattr__(self, attr: str) -> Any:
        method = getattr(self._redis, attr)
        if not callable(method):
            return method
        redis, log = self._redis, self._log

        async def call(*args: Any, **kwargs: Any) -> Any:
            pipe = redis.pipeline(transaction=False)
            getattr(pipe, attr)(*args, **kwargs)
            ((raw, _),) = pipe.command_stack
            (reply,) = await pipe.execute()
            log.command(raw, reply)
            return reply

        return call

    def pipeline(self, transaction: bool = True) -> Any:
        return _RecordedPipeline(self._redis.pipeline(transaction=transaction), self._log)


class _RecordedPipeline:
    def __init__(self, pipe: Any, log: CallLog) -> None:
        self._pipe = pipe
        self._log = log

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._pipe, attr)

    async def execute(self) -> list[Any]:
        raws = [raw for raw, _ in self._pipe.command_stack]
        replies = await self._pipe.execute()
        for raw, reply in zip(raws, replies, strict=True):
            self._log.command(raw, reply)
        return list(replies)


def plain_status(reply: Any) -> Any:
    """A plain command's reply, summed up: the values a list holds, else the reply."""
    if isinstance(reply, list | tuple):
        return sum(v is not None for v in reply)
    return reply if isinstance(reply, int) else type(reply).__name__


def status_of(reply: Any) -> Any:
    """A script reply's status word ('ok', 'stale', ...), or its type's name."""
    if isinstance(reply, list) and reply and isinstance(reply[0], str | bytes):
        first = reply[0]
        return first.decode() if isinstance(first, bytes) else first
    return type(reply).__name__


def pool_keys(client: Any, pool: str) -> dict[bytes, bytes]:
    """Every key of a pool, DUMPed."""
    from coordinator.keys import PoolKeys
    from coordinator.settings import Settings

    pattern = PoolKeys(Settings().key_prefix, pool).pattern()
    return {k: client.dump(k) for k in client.scan_iter(match=pattern, count=1000)}


def record_all(
    url: str, instances: int, requests: int, out: str, workloads: Sequence[str] = WORKLOADS
) -> None:
    """Record `workloads` on the server at `url` (this tree's code), pickled to `out`
    with the tree's script texts."""
    from coordinator.scripts import SCRIPT_NAMES, with_prelude

    texts = {}
    lua = Path(sys.modules["coordinator.scripts"].__file__ or "").parent / "lua"
    for name in SCRIPT_NAMES:
        texts[name] = with_prelude((lua / f"{name}.lua").read_text())
    recorded = {w: asyncio.run(_record(w, url, instances, requests)) for w in workloads}
    Path(out).write_bytes(pickle.dumps({"scripts": texts, "workloads": recorded}))


async def _record(workload: str, url: str, instances: int, requests: int) -> dict[str, Any]:
    from redis import Redis as SyncRedis

    from coordinator import Coordinator, InstanceSpec, Settings
    from coordinator.prefix import block_hashes, salt_key

    pool = f"ins-{instances}-" + "".join(ch if ch.isalnum() else "-" for ch in workload)
    settings = Settings(
        instance_ttl_ms=600_000,
        lease_ms=600_000,
        redis_timeout_ms=5_000,
        prefix_cache_tokens=INDEX_TOKENS,
        # the index workloads: a record goes at once, in a carry call of its own (a
        # tree from before records rode along: its record_prefix call)
        carry_ms=20 if workload.startswith("request") else 0,
    )
    sync = SyncRedis.from_url(url)
    c = await Coordinator.connect(url, pool=pool, node_id="n0", settings=settings, background=False)
    log = CallLog()
    log.attach(c)
    fleet = [c]
    try:
        for i in range(instances):  # as bench/scaling.py registers them
            await c.register_instance(
                InstanceSpec(
                    id=f"i{i:05d}",
                    url=f"http://10.{i // 62500}.{i // 250 % 250}.{i % 250}:8000",
                    max_slots=64,
                    prefill_ms_per_token=0.08,
                    prefill_overhead_ms=10.0,
                    decode_ms_per_token=16.0,
                    model="llama-3.1-8b-instruct",
                    tags=("h100", f"zone-{i % 3}"),
                )
            )
        await c.refresh()
        if workload.startswith("request"):
            nodes = FLEET if workload.endswith("nodes") else 1
            for k in range(1, nodes):
                fleet.append(
                    await Coordinator.connect(
                        url, pool=pool, node_id=f"n{k}", settings=settings, background=False
                    )
                )
                log.attach(fleet[-1])
                await fleet[-1].refresh()
            lives: list[list[str]] = [[] for _ in fleet]
            share = max(1, IN_FLIGHT // nodes)

            async def cycles(node: Any, live: list[str], n: int) -> None:
                for _ in range(n):
                    res = await node.reserve(512, 128)
                    node.first_token_soon(res.rid)
                    live.append(res.rid)
                    if len(live) > share:
                        node.release_soon(live.pop(0))

            await asyncio.gather(
                *(cycles(n, live, share + WARMUP) for n, live in zip(fleet, lives, strict=True))
            )
            start = pool_keys(sync, pool)
            log.on = True
            each = per_node(requests, nodes)
            await asyncio.gather(
                *(cycles(n, live, each) for n, live in zip(fleet, lives, strict=True))
            )
            log.on = False
            requests = each * nodes
        else:
            prefix = c.prefix
            key = salt_key(pool, settings.prefix_salt)
            chars = settings.prefix_block_chars

            def text(i: int, k: int, blocks: int) -> str:
                return f"{i}:{k}:" + "x" * (chars * blocks)

            held_each = INDEX_TOKENS // prefix.block_tokens // BLOCKS
            for i in range(instances):
                await asyncio.gather(
                    *(
                        prefix.record(f"i{i:05d}", block_hashes(text(i, k, BLOCKS), key, chars, BLOCKS))
                        for k in range(held_each)
                    )
                )  # fmt: skip
            rng = random.Random(0)
            batch = []
            for n in range(requests):
                i = rng.randrange(instances)
                if workload.endswith("new prompt"):
                    hashes = block_hashes(text(i, held_each + n, BLOCKS), key, chars, BLOCKS)
                else:
                    size = BLOCKS + ADDED
                    hashes = block_hashes(text(i, rng.randrange(held_each), size), key, chars, size)
                batch.append((f"i{i:05d}", hashes))
            start = pool_keys(sync, pool)
            log.on = True
            for iid, hashes in batch:
                found = await prefix.cached_tokens(hashes)
                await prefix.record(iid, hashes, found.get(iid, 0))
            log.on = False
            if hasattr(c, "hold_record"):
                # Records ride along with a call the node makes anyway: an empty carry
                # call per request, recorded apart, is that call's floor (`replay`).
                done = {"start": start, "calls": log.calls, "statuses": log.statuses}
                log.calls, log.statuses = [], []
                log.on = True
                for _ in range(requests):
                    await c._call("carry", [0], (c._node_rids,))
                log.on = False
                floor = {"start": start, "calls": log.calls, "statuses": log.statuses}
                return {**done, "requests": requests, "floor": {**floor, "requests": requests}}
    finally:
        for node in fleet:
            await node.close()
        keys = list(sync.scan_iter(match=c.keys.pattern(), count=1000))
        if keys:
            sync.delete(*keys)
        sync.close()
    return {"start": start, "calls": log.calls, "statuses": log.statuses, "requests": requests}


class CallgrindServer:
    """A private server run under valgrind's callgrind, counting inside TOGGLE only."""

    def __init__(self) -> None:
        from local_fleet.embedded import find_server_binary, free_port

        if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
            sys.exit(
                "bench/instructions.py needs valgrind on PATH (Debian: apt-get install valgrind)"
            )
        self.dir = tempfile.TemporaryDirectory(prefix="coordinator-callgrind-")
        self.port = free_port()
        self.out = Path(self.dir.name) / "callgrind.out"
        self.process = subprocess.Popen(
            ["valgrind", "--tool=callgrind", f"--toggle-collect={TOGGLE}",
             f"--callgrind-out-file={self.out}", find_server_binary(),
             "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir.name],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        from local_fleet.embedded import pings

        deadline = time.monotonic() + 60  # valgrind starts a server about 50x slower
        while not pings(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                sys.exit("the server did not start under valgrind")
            time.sleep(0.1)

    def control(self, command: str) -> None:
        """Send callgrind_control a command (-z zero, -d dump) and wait for it to act."""
        subprocess.run(
            ["callgrind_control", command, str(self.process.pid)],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def instructions(self, run: Any) -> int:
        """Instructions counted while `run()` executes."""
        before = set(Path(self.dir.name).glob("callgrind.out*"))
        self.control("-z")
        run()
        self.control("-d")
        dumps = set(Path(self.dir.name).glob("callgrind.out*")) - before
        if not dumps:
            raise RuntimeError("callgrind wrote no dump")
        dump = max(dumps, key=os.path.getmtime)
        for line in dump.read_text().splitlines():
            if line.startswith("summary:"):
                dump.unlink()
                return int(line.split()[1])
        raise RuntimeError(f"no summary line in {dump}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(30)
        self.dir.cleanup()


def replay(
    server: CallgrindServer, scripts: dict[str, str], recorded: dict[str, Any]
) -> dict[str, float]:
    """Instructions per request of one recording replayed with `scripts`, and the share
    of its calls whose status equals the recording's."""
    from redis import Redis as SyncRedis

    from bench.replay import call_replies, queue_call

    client = SyncRedis(port=server.port)
    try:
        client.flushall()
        for key, value in recorded["start"].items():
            client.restore(key, 0, value, replace=True)
        sha = {name: client.script_load(text) for name, text in scripts.items()}
        calls = recorded["calls"]
        replies: list[Any] = []
        # Nearly the same Lua heap and collector phase at the start of every replay: a
        # full collection, and scripts run since the server started a multiple of the
        # period of Redis's own collection steps (padded at the end).
        client.eval("collectgarbage('collect') return 1", 0)
        scripts_run = 1 + sum(kind == "evalsha" for kind, _, _, _ in calls)

        def run() -> None:
            for at in range(0, len(calls), PIPELINE):
                pipe = client.pipeline(transaction=False)
                for kind, name, keys, args in calls[at : at + PIPELINE]:
                    if kind == "cmd":
                        pipe.execute_command(*args)  # type: ignore[no-untyped-call]
                    else:
                        queue_call(pipe, sha[name], name, keys, args)
                replies.extend(pipe.execute(raise_on_error=False))

        total = server.instructions(run)
        for _ in range(-scripts_run % LUA_GC_PERIOD):
            client.eval("return 1", 0)
    finally:
        client.close()
    statuses = [
        plain_status(reply) if kind == "cmd" else status_of(reply)
        for (kind, _, _, _), reply in zip(
            calls, call_replies([c[1:] for c in calls], replies), strict=True
        )
    ]
    same = sum(a == b for a, b in zip(statuses, recorded["statuses"], strict=True))
    return {
        "per_request": total / recorded["requests"],
        "calls_per_request": len(calls) / recorded["requests"],
        "same": same / max(1, len(calls)),
    }


def replay_less_floor(
    server: CallgrindServer, scripts: dict[str, str], recorded: dict[str, Any]
) -> dict[str, float]:
    """`replay`, less the recording's floor where it has one: the empty calls its
    records would ride on in service, which the node makes anyway."""
    result = replay(server, scripts, recorded)
    if "floor" in recorded:
        floor = replay(server, scripts, recorded["floor"])
        result["per_request"] -= floor["per_request"]
        result["calls_per_request"] -= floor["calls_per_request"]
    return result


def record_tree(
    tree: str, url: str, instances: int, requests: int, workloads: Sequence[str]
) -> dict[str, Any]:
    """Run RUNNER for one tree; its recordings and script texts."""
    with tempfile.NamedTemporaryFile(suffix=".pickle") as out:
        child = subprocess.run(
            [sys.executable, "-c", RUNNER, tree, str(Path(__file__).resolve()), url,
             str(instances), str(requests), out.name, "|".join(workloads)],
            capture_output=True, text=True, cwd=tree,
        )  # fmt: skip
        if child.returncode:
            sys.exit(f"recording with {tree} failed:\n{child.stderr}")
        data: dict[str, Any] = pickle.loads(Path(out.name).read_bytes())
    return data


def main(argv: Sequence[str] | None = None) -> int:
    from bench.against import tree_of
    from bench.docs import add_write_docs, write_section
    from local_fleet.embedded import EmbeddedRedis

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--against", default=None, help="git ref to compare with (default: none)")
    parser.add_argument("--instances", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--requests", type=int, default=300, help="recorded per workload")
    parser.add_argument(
        "--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS), metavar="W",
        help=f"the workloads to record (default: all of {', '.join(WORKLOADS)})",
    )  # fmt: skip
    add_write_docs(parser)
    args = parser.parse_args(argv)
    if min(args.instances) < 1 or args.requests < 1:
        parser.error("--instances and --requests must be >= 1")
    if importlib.util.find_spec("redis") is None:
        parser.error("redis-py is not installed")
    trees = {"this": str(ROOT)}
    rows: list[tuple[str, int, str, dict[str, float]]] = []
    with tree_of(args.against) if args.against else _no_tree() as other:
        if other:
            trees = {args.against[:10]: other, **trees}
        recorder = EmbeddedRedis().start()
        server = CallgrindServer()
        try:
            for n in args.instances:
                for label, tree in trees.items():
                    print(f"{n} instances, {label}: recording", file=sys.stderr, flush=True)
                    data = record_tree(tree, recorder.url, n, args.requests, args.workloads)
                    if not rows:  # a new server's first replay counts about 1% more
                        replay(server, data["scripts"], data["workloads"][args.workloads[0]])
                    for workload in args.workloads:
                        result = replay_less_floor(
                            server, data["scripts"], data["workloads"][workload]
                        )
                        rows.append((workload, n, label, result))
                        print(f"  {workload}: {result['per_request']:,.0f} instructions/request",
                              file=sys.stderr, flush=True)  # fmt: skip
        finally:
            server.stop()
            recorder.stop()
    text = table(rows, args.requests)
    print(text)
    if args.write_docs:
        command = " ".join(
            ["python bench/instructions.py", *(argv if argv is not None else sys.argv[1:])]
        )
        command = command.replace(" --write-docs", "")
        write_section("instructions", f"{SECTION_HEAD}\n\nGenerated by `{command}`.\n\n{text}\n")
    return 0


SECTION_HEAD = """## Server instructions per request (callgrind)

What a request costs inside Redis in instructions, which do not move with this shared
machine's speed as µs do (bench/instructions.py says how they are counted; replays of
one recording agree within about 2%). Each code version records its own calls and
is replayed from the state they started from. For scale, a proxied request's
`reserve` (with the previous request's mark and release) took 74 µs inside Redis
at 64 instances on a fast day (docs/scaling.md section 2). A `request, 64 nodes` row
over the same code's `request` row is issue 12's flatness in nodes on a busy shard
(target: at most 1.3), counted where docs/scaling.md's replayed µs move from run to
run; one recording of 64 concurrent nodes differs from the next by a few percent (the
order their calls reach the server in), so compare such rows across runs with care.
Instruction counts charge a large copy (a whole `state` read, say) per byte
(valgrind counts each step of `rep movsb`), more than it costs a real core."""


class _no_tree:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def per_node(requests: int, nodes: int) -> int:
    """Request cycles each node of a workload records: at least 40 a node with several
    nodes, so that views age and fall behind as in a longer run."""
    return max(1, requests // nodes, 40 if nodes > 1 else 1)


def table(rows: list[tuple[str, int, str, dict[str, float]]], requests: int) -> str:
    """The results as a markdown table, each workload's trees side by side, then each
    tree's 64 nodes ÷ 1 node where both request workloads ran."""
    fleet = per_node(requests, FLEET)
    lines = [
        f"Server instructions per request inside `{TOGGLE}` (callgrind), {requests} "
        f"recorded requests per workload ({FLEET} nodes: {fleet} each, {fleet * FLEET:,}), "
        "replayed from the state they started from.",
        "",
        "| workload | instances | code | instructions/request | ratio to the first | "
        "calls/request | same status |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    first: dict[tuple[str, int], float] = {}
    for workload, n, label, r in rows:
        base = first.setdefault((workload, n), r["per_request"])
        lines.append(
            f"| {workload} | {n:,} | {label} | {r['per_request']:,.0f} | "
            f"{r['per_request'] / base:.3f} | {r['calls_per_request']:.2f} | {r['same']:.1%} |"
        )
    per = {(w, n, label): r["per_request"] for w, n, label, r in rows}
    flat = [
        f"{label} at {n:,} instances: {per[(WORKLOADS[1], n, label)] / one:.2f}"
        for (w, n, label), one in per.items()
        if w == WORKLOADS[0] and (WORKLOADS[1], n, label) in per
    ]
    if flat:
        lines += ["", f"{FLEET} nodes ÷ 1 node (issue 12: at most 1.3): " + "; ".join(flat) + "."]
    return "\n".join(lines)


if __name__ == "__main__":
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
