"""bench/metrics_flood.py's table and argument checks (its runs are the bench)."""

from __future__ import annotations

import argparse

import pytest

from bench.metrics_flood import Phase, main, median_phase, render


def test_each_figure_is_the_median_over_rounds() -> None:
    runs = [Phase(10, 300, 1.0, 9.0), Phase(30, 100, 3.0, 5.0), Phase(20, 200, 2.0, 7.0)]
    assert median_phase(runs) == Phase(20, 200, 2.0, 7.0)


def test_the_table_has_an_idle_and_a_flood_row_per_code_and_size() -> None:
    idle, flood = Phase(0, 37, 0.8, 1.4), Phase(557, 281, 0.9, 8.0)
    args = argparse.Namespace(
        against_name="abc", rounds=1, instances=[64], scrapers=32, seconds=5.0
    )
    text = render({("abc", 64): [(idle, flood)], ("this", 64): [(idle, flood)]}, args, 10.0)
    rows = [line for line in text.splitlines() if line.startswith("| abc") or "| this" in line]
    assert rows == [
        "| abc | 64 | idle | 0 | 37 | 0.8 | 1.4 |",
        "| abc | 64 | flood | 557 | 281 | 0.9 | 8.0 |",
        "| this | 64 | idle | 0 | 37 | 0.8 | 1.4 |",
        "| this | 64 | flood | 557 | 281 | 0.9 | 8.0 |",
    ]


@pytest.mark.parametrize(
    "bad", [["--rounds", "0"], ["--scrapers", "0"], ["--seconds", "0"], ["--instances", "1"]]
)
def test_bad_arguments_are_refused_before_any_cluster_starts(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--against", "HEAD~1", *bad])
    assert exit_.value.code == 2
