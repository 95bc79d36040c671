"""Replace one marked section of docs/benchmarks.md, leaving the others alone."""

from __future__ import annotations

from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADER = (
    "# Benchmarks\n\n"
    "Every section below is written by a script in `bench/`; the command that "
    "regenerates it is given with it. Machine: 2 cores, shared and noisy, so the "
    "tables report medians and ratios measured side by side in one run.\n"
)


def write_section(name: str, markdown: str, doc: Path = DOC) -> None:
    """Put `markdown` between <!-- name:start --> and <!-- name:end --> in the doc."""
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
