"""bench/instructions.py: server instructions per request, counted under callgrind."""

from __future__ import annotations

import shutil
from importlib import resources

import pytest

from bench import instructions
from coordinator.scripts import SCRIPT_NAMES, with_prelude

LUA_DIR = resources.files("coordinator") / "lua"


def test_the_table_gives_each_tree_its_ratio_to_the_first() -> None:
    row = {"calls_per_request": 1.0, "same": 1.0}
    text = instructions.table(
        [
            ("request", 64, "abc", {"per_request": 800_000.0, **row}),
            ("request", 64, "this", {"per_request": 600_000.0, **row}),
            ("request", 1024, "abc", {"per_request": 500_000.0, **row}),
            ("request", 1024, "this", {"per_request": 750_000.0, **row}),
        ],
        requests=10,
    )
    lines = text.splitlines()
    assert "| request | 64 | this | 600,000 | 0.750 | 1.00 | 100.0% |" in lines
    assert "| request | 1,024 | this | 750,000 | 1.500 | 1.00 | 100.0% |" in lines
    assert "| request | 1,024 | abc | 500,000 | 1.000 | 1.00 | 100.0% |" in lines


def test_the_table_gives_each_trees_flatness_in_nodes() -> None:
    row = {"calls_per_request": 1.0, "same": 1.0}
    fleet = f"request, {instructions.FLEET} nodes"
    text = instructions.table(
        [
            ("request", 64, "abc", {"per_request": 600_000.0, **row}),
            (fleet, 64, "abc", {"per_request": 900_000.0, **row}),
            ("request", 64, "this", {"per_request": 500_000.0, **row}),
            (fleet, 64, "this", {"per_request": 600_000.0, **row}),
            ("request", 1024, "this", {"per_request": 500_000.0, **row}),
        ],
        requests=300,
    )
    assert "(64 nodes: 40 each, 2,560)" in text
    assert text.splitlines()[-1] == (
        "64 nodes ÷ 1 node (issue 12: at most 1.3): abc at 64 instances: 1.50; "
        "this at 64 instances: 1.20."
    )


@pytest.mark.parametrize("flags", [["--requests", "0"], ["--instances", "0"]])
def test_bad_counts_are_refused(flags: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        instructions.main(flags)
    assert exc.value.code == 2


@pytest.mark.slow
@pytest.mark.real
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind")
async def test_a_replay_counts_the_same_twice_and_tells_heavier_scripts_apart(
    redis_url: str,
) -> None:
    recorded = await instructions._record("request", redis_url, 8, 30)
    assert len(recorded["calls"]) >= 30  # every request's reserve, carried ones inside
    scripts = {n: with_prelude((LUA_DIR / f"{n}.lua").read_text()) for n in SCRIPT_NAMES}
    # The same reserve with a loop of string conversions in front: more work per call.
    heavier = dict(scripts)
    heavier["reserve"] = with_prelude(
        "for i = 1, 200 do local _ = tostring(i) end\n" + (LUA_DIR / "reserve.lua").read_text()
    )
    server = instructions.CallgrindServer()
    try:
        instructions.replay(server, scripts, recorded)  # a new server's first counts ~1% more
        first = instructions.replay(server, scripts, recorded)
        again = instructions.replay(server, scripts, recorded)
        heavy = instructions.replay(server, heavier, recorded)
    finally:
        server.stop()
    assert first["same"] == again["same"] == heavy["same"] == 1.0
    assert first["per_request"] > 0
    # Replays differ by the clock their scripts read (measured: within 2%).
    assert abs(again["per_request"] / first["per_request"] - 1) < 0.05
    assert heavy["per_request"] > first["per_request"] * 1.2
