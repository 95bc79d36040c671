"""The benchmark commands: documented flags, and docs written only when asked."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import bench.decision_overhead
import bench.herding
from coordinator_cli.main import build_parser


def options(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.Action]]:
    """Every flag of every (sub)command, with the command path that has it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from options(child, (*path, name))
        elif action.option_strings and not isinstance(action, argparse._HelpAction):
            yield path, action


def subparser(*path: str) -> argparse.ArgumentParser:
    """The parser of `coordinator PATH...`."""
    parser = build_parser()
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def test_every_flag_of_every_command_has_help() -> None:
    missing = [
        f"coordinator {' '.join(path)} {action.option_strings[0]}"
        for path, action in options(build_parser())
        if not action.help or action.help == argparse.SUPPRESS
    ]
    assert missing == []


def test_bench_herding_help_names_each_default() -> None:
    _, _, text = subparser("bench", "herding").format_help().partition("options:")
    text = " ".join(text.split())
    for flag, default in (("--nodes", 4), ("--burst", 8), ("--instances", 16), ("--trials", 10)):
        entry = text.split(f"{flag} ", 1)[1].split(" --", 1)[0]
        assert f"(default: {default})" in entry, entry
    assert "--write-docs" in text and "--no-write" not in text


def test_no_benchmark_flag_rewrites_docs_by_default() -> None:
    for path, action in options(subparser("bench")):
        assert action.dest not in ("no_write", "no_doc"), path
        if action.dest == "write_docs":
            assert action.default is False, path
    benches = {path[0] for path, action in options(subparser("bench")) if path}
    with_flag = {
        path[0] for path, action in options(subparser("bench")) if action.dest == "write_docs"
    }
    # Every benchmark that records into docs/ offers the flag (sim and live only print).
    assert with_flag == {"herding", "overhead"} and with_flag < benches


@pytest.mark.parametrize("write", [False, True])
def test_herding_writes_its_section_only_with_write_docs(
    monkeypatch: pytest.MonkeyPatch, write: bool
) -> None:
    written: list[str] = []
    monkeypatch.setattr(bench.herding, "measure", lambda *a: {"least_load": [1, 0]})
    monkeypatch.setattr(bench.herding, "write_section", lambda name, text: written.append(name))
    argv = ["bench", "herding", "--redis-url", "redis://127.0.0.1:1/0", "--trials", "2"]
    args = build_parser().parse_args([*argv, *(["--write-docs"] if write else [])])
    assert bench.herding.run(args) == 0
    assert written == (["herding"] if write else [])


@pytest.mark.parametrize("write", [False, True])
def test_overhead_writes_its_section_only_with_write_docs(
    monkeypatch: pytest.MonkeyPatch, write: bool
) -> None:
    written: list[str] = []
    row: dict[str, Any] = {"p50": 100.0, "p99": 200.0, "ping": 50.0, "calls_per_request": 3.0}
    monkeypatch.setattr(bench.decision_overhead, "cases", lambda: [(16, 1, 25)])
    monkeypatch.setattr(
        bench.decision_overhead,
        "run_case",
        lambda url, n, k, d, age: {**row, "instances": n, "nodes": k, "max_age": age},
    )
    monkeypatch.setattr(bench.decision_overhead, "plot", lambda rows: written.append("plot"))
    monkeypatch.setattr(
        bench.decision_overhead, "write_section", lambda name, text: written.append(name)
    )
    argv = ["bench", "overhead", "--redis-url", "redis://127.0.0.1:1/0", "--quick"]
    args = build_parser().parse_args([*argv, *(["--write-docs"] if write else [])])
    assert bench.decision_overhead.run(args) == 0
    assert written == (["decision", "plot"] if write else [])


def test_every_script_the_docs_name_runs_as_a_script() -> None:
    """`python bench/X.py` in a module's own docs needs a __main__ block to do anything."""
    root = Path(__file__).resolve().parents[2]
    named = [p for p in (root / "bench").glob("*.py") if f"python bench/{p.name}" in p.read_text()]
    assert named, "no bench script documents how to run it"
    for path in named:
        assert 'if __name__ == "__main__":' in path.read_text(), path.name
