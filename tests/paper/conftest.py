"""The paper-table suite: a record of paper number vs ours, printed at the end.

Tests call ``paper_record(source, item, paper, ours)``; ``pytest tests/paper``
prints every record as one table after the run.
"""

from __future__ import annotations

import pytest

_RECORDS: list[tuple[str, str, str, str]] = []


def _fmt(value) -> str:
    if isinstance(value, float):
        if abs(value) >= 1:
            return f"{value:.3f}".rstrip("0").rstrip(".")
        return f"{value:.4g}"
    return str(value)


@pytest.fixture
def paper_record():
    """``record(source, item, paper, ours)``: one row of the summary table
    (``paper`` is the published figure, or a description of the claim)."""

    def record(source: str, item: str, paper, ours) -> None:
        _RECORDS.append((source, item, _fmt(paper), _fmt(ours)))

    return record


def pytest_terminal_summary(terminalreporter):
    if not _RECORDS:
        return
    rows = sorted(set(_RECORDS))
    widths = [
        max(len(r[k]) for r in rows + [("source", "item", "paper", "ours")]) for k in range(4)
    ]
    write = terminalreporter.write_line
    terminalreporter.section("paper vs toast")
    header = ("source", "item", "paper", "ours")
    write("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        write("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))
