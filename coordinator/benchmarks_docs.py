"""Where benchmark results are recorded: docs/benchmarks.md of a source checkout.

The section format belongs to bench/mdsection.py; this module only finds that file
next to the package, so `coordinator bench ...` run from a checkout updates the same
document as the bench/ scripts, and an installed package (no docs/) just prints.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent  # the repository root in a source checkout


def checkout_root() -> Path | None:
    """The source checkout this package runs from, if it has bench/ and docs/."""
    if (CHECKOUT / "bench" / "mdsection.py").is_file() and (CHECKOUT / "docs").is_dir():
        return CHECKOUT
    return None


def write_section(name: str, markdown: str) -> Path | None:
    """Replace the <!-- name --> section of docs/benchmarks.md; None outside a checkout."""
    root = checkout_root()
    if root is None:
        print(
            "no source checkout with docs/benchmarks.md next to the package: not written",
            file=sys.stderr,
        )
        return None
    spec = importlib.util.spec_from_file_location(
        "_bench_mdsection", root / "bench" / "mdsection.py"
    )
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {root / 'bench' / 'mdsection.py'}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    doc = root / "docs" / "benchmarks.md"
    module.write_section(name, markdown, doc)
    return doc
