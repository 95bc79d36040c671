"""Another commit's tree beside this checkout, for side-by-side (A/B) benchmarks.

A benchmark that compares this checkout with another commit runs both on one server,
alternating, each in a child process whose code is one tree (bench/prefix_cost.py,
bench/request_ab.py): noise on this shared machine then lands on both alike.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def git(*args: str) -> bytes:
    """Output of one git command in this checkout."""
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True).stdout


def add_against(parser: argparse.ArgumentParser) -> None:
    """The --against flag: the commit to compare with."""
    parser.add_argument("--against", default=None, help="git ref (default: merge-base main)")


def resolve_against(parser: argparse.ArgumentParser, ref: str | None) -> str:
    """The commit to compare with: `ref`, or where this branch left main (an error on
    main itself, where that is HEAD)."""
    ref = ref or git("merge-base", "HEAD", "main").decode().strip()
    if git("rev-parse", ref).strip() == git("rev-parse", "HEAD").strip():
        parser.error("nothing to compare with here (that is HEAD): --against REF")
    return ref


@contextmanager
def tree_of(ref: str) -> Iterator[str]:
    """The files of commit `ref`, extracted into a temporary directory."""
    with tempfile.TemporaryDirectory() as other:
        tarfile.open(fileobj=io.BytesIO(git("archive", ref)), mode="r:").extractall(other)
        yield other
