"""bench/against.py: the other commit's tree the A/B benchmarks run beside this one."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest

from bench.against import ROOT, resolve_against, tree_of

pytestmark = pytest.mark.skipif(
    subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0,
    reason="not a git checkout",
)


def test_the_tree_of_a_commit_holds_its_files() -> None:
    with tree_of("HEAD") as other:
        tree = Path(other)
        assert (tree / "pyproject.toml").read_bytes() == subprocess.run(
            ["git", "show", "HEAD:pyproject.toml"], cwd=ROOT, capture_output=True, check=True
        ).stdout
    assert not tree.exists()  # removed afterwards


def test_comparing_with_head_itself_is_refused() -> None:
    parser = argparse.ArgumentParser()
    with pytest.raises(SystemExit):
        resolve_against(parser, "HEAD")
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, check=True, text=True
    ).stdout.strip()
    with pytest.raises(SystemExit):
        resolve_against(parser, head[:12])
