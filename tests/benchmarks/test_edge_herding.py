"""bench/edge_herding.py's arithmetic and argument checks (its runs are the bench)."""

from __future__ import annotations

import pytest

from bench.edge_herding import Outcome, main
from bench.herding import spread


def test_spread_counts_engines_that_got_nothing_and_skips_failures() -> None:
    two, four = ["engine-0", "engine-1"], [f"engine-{j}" for j in range(4)]
    assert spread(["engine-0", "engine-1", "engine-0", "engine-1"], two) == 0
    assert spread(["engine-0", "engine-0", ""], two) == 2  # engine-1 got none
    assert spread(["engine-0", "engine-1", "engine-2", "engine-2"], four) == 2


def test_outcome_line_reports_even_trials_worst_and_the_distribution() -> None:
    line = Outcome([0, 2, 0, 3], failed=1).line("default")
    assert line == "| default | 2/4 | 3 | 0: 2, 2: 1, 3: 1 | 1 |"


@pytest.mark.parametrize("bad", [["--trials", "0"], ["--engines", "0"], ["--gap-s", "-1"]])
def test_bad_arguments_are_refused_before_any_cluster_starts(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(bad)
    assert exit_.value.code == 2
