"""bench/gray_failure.py's arithmetic and argument checks (its runs are the bench)."""

from __future__ import annotations

import pytest

from bench.gray_failure import Round, main, table


def test_attempts_on_the_failing_engine_add_its_served_requests_and_the_failures() -> None:
    r = Round({"engine-0": 30, "engine-1": 60}, node_failures=12, client_failures=3, requests=95)
    assert r.attempts_on_failing == 42
    assert Round({"engine-1": 5}, 2, 0, 5).attempts_on_failing == 2


def test_the_table_reports_medians_per_fault_and_rule() -> None:
    rounds = [
        Round({"engine-0": served}, failures, client, 100)
        for served, failures, client in ((10, 4, 1), (30, 2, 5), (20, 9, 3))
    ]
    lines = table({("cut stream", "on"): rounds}, engines=4)
    assert lines[0].startswith("| engine-0 fails | failure-share rule | attempts on engine-0")
    assert "1/4" in lines[0]
    # attempts 14, 32, 29 -> 29; served 10, 30, 20 -> 20; client failures -> 3
    assert lines[2] == "| cut stream | on | 29 | 20 | 3 | 100 |"


@pytest.mark.parametrize(
    "bad", [["--rounds", "0"], ["--engines", "1"], ["--fail-share", "0"], ["--rate", "0"]]
)
def test_bad_arguments_are_refused_before_any_cluster_starts(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(bad)
    assert exit_.value.code == 2
