"""What a Lua script's building blocks cost inside Redis, in server instructions
(callgrind, counted as bench/instructions.py counts them: inside `processCommand`).

A script's cost (docs/scaling.md, section 2) follows from how many of each block it
runs: the floor of an EVALSHA with a proxied request's keys and arguments, each
`redis.call` beyond its command's own work, and the Lua around the commands (numbers
to and from text, formatting, concatenation, a packed field, a JSON record).

    python bench/lua_costs.py [--calls 300] [--write-docs]

Each block runs OPS times in a loop of its own script; its cost per run is that
script's instructions per call less those of the same loop storing only the index
(`BASELINE`), over OPS. Every script gets the same keys and arguments, so pushing them
costs all alike. Needs valgrind on PATH (Debian's package `valgrind`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.docs import add_write_docs, write_section  # noqa: E402
from coordinator.keys import COLUMNS  # noqa: E402

OPS = 10  # runs of a block per call
RECORD = (
    '{"instance":"inst-00001","epoch":1,"node":"n0","phase":"prefill","prompt_tokens":512,'
    '"expected_output_tokens":128,"prefill_ms":51,"decode_ms":2048,"created_ms":1733333333000,'
    '"first_token_at_ms":1733333333051,"end_at_ms":1733333335099,"predicted_ttft_ms":51,'
    '"slot":1}'
)
# ARGV of every script: a Redis ms time, two short strings, a packed 6-digit field, a
# reservation record as reserve.lua stores it; then padding to a proxied request's 33.
ARGS = ["1733333333000", "inst-00001", "#1", "\x01\x02\x03\x04\x05\x06", RECORD]
REQUEST_ARGS = 33
KEYS = [f"lc:{{costs}}:{name}" for name in COLUMNS] + ["lc:{costs}:node:n0:rids"]
LOOP = "local t = {{}} for i = 1, {n} do {body} end return 1"
BASELINE = "t[i] = i"
# label, the body run OPS times (i: the loop index; t: a table to store results in)
BLOCKS: tuple[tuple[str, str], ...] = (
    ("`redis.call('HGET', ...)` of a small hash", "t[i] = redis.call('HGET', KEYS[1], 'f1')"),
    (
        "the same with a 13-digit number for its field (Redis formats it)",
        "t[i] = redis.call('HGET', KEYS[1], 1733333333000 + i)",
    ),
    (
        "the same with the number formatted first by `string.format('%d', n)`",
        "t[i] = redis.call('HGET', KEYS[1], string.format('%d', 1733333333000 + i))",
    ),
    (
        "`redis.call('GETRANGE', ...)` of 27 bytes (a packed record; offsets as numbers)",
        f"t[i] = redis.call('GETRANGE', KEYS[{COLUMNS.index('state') + 1}], 0, 26)",
    ),
    ("`tonumber` of a 13-digit string (a Redis ms time)", "t[i] = tonumber(ARGV[1])"),
    ("`tostring` of a 13-digit number", "t[i] = tostring(1733333333000 + i)"),
    ("`string.format('%d', n)` of a 13-digit number", "t[i] = string.format('%d', 1733333333000 + i)"),
    ("`..` of a short string and a 13-digit number", "t[i] = ARGV[3] .. (1733333333000 + i)"),
    ("`..` of two short strings", "t[i] = ARGV[2] .. ARGV[3]"),
    (
        "a packed field: `string.byte` of 6 bytes and base-128 arithmetic",
        "local a, b, c, d, e, f = string.byte(ARGV[4], 1, 6) "
        "t[i] = ((((a * 128 + b) * 128 + c) * 128 + d) * 128 + e) * 128 + f",
    ),
    ("`cjson.decode` of a reservation record (13 fields)", "t[i] = cjson.decode(ARGV[5])"),
)  # fmt: skip


def request_args() -> list[str]:
    """ARGS padded to a proxied request's number of arguments."""
    return [*ARGS, *(["0"] * (REQUEST_ARGS - len(ARGS)))]


def scripts() -> dict[str, str]:
    """Every script measured: the floors, the baseline loop and one loop per block."""
    out = {"empty": "return 1", "baseline": LOOP.format(n=OPS, body=BASELINE)}
    for label, body in BLOCKS:
        out[label] = LOOP.format(n=OPS, body=body)
    return out


def per_run(instructions: dict[str, float]) -> dict[str, float]:
    """Each block's instructions per run, from each script's instructions per call."""
    base = instructions["baseline"]
    return {label: (instructions[label] - base) / OPS for label, _ in BLOCKS}


def prepare(client: Any) -> None:
    """The keys the blocks read: a small hash and a packed `state` string."""
    client.hset(KEYS[0], "f1", "1733333333000")
    client.set(KEYS[COLUMNS.index("state")], "x" * 27 * 64)


def measure(calls: int) -> dict[str, float]:
    """Instructions per call of every script, and of `return 1` with no keys and no
    arguments, on one server run under callgrind."""
    from redis import Redis as SyncRedis

    from bench.instructions import CallgrindServer

    server = CallgrindServer()
    client = SyncRedis(port=server.port)
    try:
        prepare(client)
        out: dict[str, float] = {}

        args = request_args()

        def run(sha: str, keys: Sequence[str], argv: Sequence[str]) -> float:
            def send() -> None:
                pipe = client.pipeline(transaction=False)
                for _ in range(calls):
                    pipe.evalsha(sha, len(keys), *keys, *argv)
                for reply in pipe.execute():
                    if reply != 1:
                        raise RuntimeError(f"a measured script returned {reply!r}")

            return server.instructions(send) / calls

        shas = {name: client.script_load(text) for name, text in scripts().items()}
        run(shas["empty"], KEYS, args)  # a new server's first calls count a little more
        out["bare"] = run(shas["empty"], [], [])
        for name, sha in shas.items():
            out[name] = run(sha, KEYS, args)
        return out
    finally:
        client.close()
        server.stop()


SECTION_HEAD = """## What a script's building blocks cost (callgrind)

Server instructions, counted as in the section above, of the blocks the scripts are
made of (`bench/lua_costs.py`: each block run in a loop of its own script, less the
same loop without it). A script's cost follows from how many of each it runs: the
floor of its EVALSHA, then each `redis.call` and each number it turns into text or
back. For scale, a proxied request (`request` above) is about 670,000."""


def table(instructions: dict[str, float], calls: int) -> str:
    lines = [
        f"Instructions per call or per run, {calls} calls of each script.",
        "",
        "| block | instructions |",
        "|---|---:|",
        f"| EVALSHA of `return 1`, no keys or arguments | {instructions['bare']:,.0f} |",
        f"| EVALSHA of `return 1` with a proxied request's {len(KEYS)} keys and "
        f"{REQUEST_ARGS} arguments | {instructions['empty']:,.0f} |",
    ]
    for label, cost in per_run(instructions).items():
        lines.append(f"| {label} | {cost:,.0f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=300, help="calls of each script")
    add_write_docs(parser)
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error("--calls must be >= 1")
    text = table(measure(args.calls), args.calls)
    print(text)
    if args.write_docs:
        command = "python bench/lua_costs.py" + (
            "" if args.calls == 300 else f" --calls {args.calls}"
        )
        write_section("lua-costs", f"{SECTION_HEAD}\n\nGenerated by `{command}`.\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
