"""bench/lua_costs.py: what a script's building blocks cost, counted under callgrind."""

from __future__ import annotations

import shutil

import pytest
from redis import Redis

from bench import lua_costs


def test_a_blocks_cost_is_its_loop_less_the_baseline_over_its_runs() -> None:
    counted = {"bare": 5.0, "empty": 9.0, "baseline": 1_000.0}
    for k, (label, _) in enumerate(lua_costs.BLOCKS):
        counted[label] = 1_000.0 + lua_costs.OPS * 100 * (k + 1)
    costs = lua_costs.per_run(counted)
    assert list(costs.values()) == [100.0 * (k + 1) for k in range(len(lua_costs.BLOCKS))]
    lines = lua_costs.table(counted, calls=7).splitlines()
    assert lines[0] == "Instructions per call or per run, 7 calls of each script."
    assert f"| {lua_costs.BLOCKS[0][0]} | 100 |" in lines


@pytest.mark.real
def test_every_measured_script_runs_as_written(redis_url: str) -> None:
    """Each script (floors, baseline, every block) answers 1 with the bench's keys and
    arguments: a block that failed would count an error's instructions."""
    client = Redis.from_url(redis_url)
    try:
        lua_costs.prepare(client)
        args = lua_costs.request_args()
        assert len(args) == lua_costs.REQUEST_ARGS
        for name, text in lua_costs.scripts().items():
            keys = lua_costs.KEYS if name != "empty" else []
            assert client.eval(text, len(keys), *keys, *args) == 1, name
    finally:
        client.delete(*lua_costs.KEYS)
        client.close()


def test_no_calls_is_refused() -> None:
    with pytest.raises(SystemExit) as exc:
        lua_costs.main(["--calls", "0"])
    assert exc.value.code == 2


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind")
def test_every_block_costs_instructions_and_keys_cost_more_than_none() -> None:
    counted = lua_costs.measure(calls=20)
    assert counted["empty"] > counted["bare"]
    assert all(cost > 0 for cost in lua_costs.per_run(counted).values())
