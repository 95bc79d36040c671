"""Where benchmark results are recorded: marked sections of docs/benchmarks.md.

Every benchmark prints its tables; writing them into the checkout's docs is opt-in
(`--write-docs`), so a user's run never rewrites files they did not ask for.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent  # the repository root in a source checkout
DOC = CHECKOUT / "docs" / "benchmarks.md"
HEADER = (
    "# Benchmarks\n\n"
    "Every section below is written by a script in `bench/`; the command that "
    "regenerates it is given with it. Machine: 2 cores, shared and noisy, so the "
    "tables report medians and ratios measured side by side in one run. Trace runs "
    "name the trace file they read; the README's Benchmarks section says where the "
    "public traces come from.\n"
)


def add_write_docs(parser: argparse.ArgumentParser, doc: str = "docs/benchmarks.md") -> None:
    """The `--write-docs` flag: results go into the checkout's docs only when asked."""
    parser.add_argument(
        "--write-docs",
        action="store_true",
        help=f"also write the result into {doc} of this source checkout; without it the "
        "result is only printed (default: %(default)s)",
    )


def checkout_root() -> Path | None:
    """The source checkout this package runs from, if it has docs/."""
    return CHECKOUT if (CHECKOUT / "docs").is_dir() else None


def write_section(name: str, markdown: str, doc: Path | None = None) -> Path | None:
    """Put `markdown` between <!-- name:start --> and <!-- name:end --> of the doc.

    Returns the file written, or None when there is no checkout to write into.
    """
    if doc is None:
        if checkout_root() is None:
            print("no source checkout with docs/ next to the package: not written", file=sys.stderr)
            return None
        doc = DOC
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = doc.read_text() if doc.exists() else HEADER
    block = f"{start}\n{markdown.rstrip()}\n{end}"
    if start in text and end in text:
        head, _, rest = text.partition(start)
        _, _, tail = rest.partition(end)
        text = head + block + tail
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    return doc
