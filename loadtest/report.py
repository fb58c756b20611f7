"""What the benchmarks share: where results go, one percentile rule, and the writer of
``docs/benchmarks.md``'s sections."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Sequence, TypeVar

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "loadtest" / "results"
T = TypeVar("T")


def percentile(xs: Sequence[float], q: float, empty: T = None) -> float | T:
    """The ``q`` quantile (0..1) of ``xs`` by the nearest-rank rule (the value at index
    ``floor(q·n)``, the last for q = 1), or ``empty`` when there is no value."""
    if not xs:
        return empty
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A markdown table of ``header`` and ``rows`` (cells as ``str`` gives them)."""
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def write_benchmark_doc(section: str, command: str, table: str, notes: str = "") -> None:
    """Replace (or append) ``## <section>`` in docs/benchmarks.md with the table."""
    doc = ROOT / "docs" / "benchmarks.md"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    machine = f"{platform.node() or 'this machine'}: {platform.machine()}, " \
              f"{os.cpu_count()} cores, {platform.python_version()}"
    block = (f"## {section}\n\nCommand: `{command}`  \nMachine: {machine}; "
             f"{time.strftime('%Y-%m-%d')}\n\n{table}\n" + (f"\n{notes}\n" if notes else "") + "\n")
    marker = f"## {section}\n"
    if marker in text:
        start = text.index(marker)
        nxt = text.find("\n## ", start + len(marker))
        text = text[:start] + block + (text[nxt + 1:] if nxt != -1 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    doc.parent.mkdir(exist_ok=True)
    doc.write_text(text)
