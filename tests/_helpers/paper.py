"""The paper-vs-toast table of ``tests/paper``: rows carried on test reports."""

from __future__ import annotations

PAPER_RECORD = "paper vs toast"


def print_table(terminalreporter, rows: list[tuple[str, ...]]) -> None:
    """Every recorded row, once, as one aligned table."""
    rows = sorted(set(rows))
    header = ("source", "item", "paper", "ours")
    widths = [max(len(r[k]) for r in [*rows, header]) for k in range(4)]
    write = terminalreporter.write_line
    terminalreporter.section(PAPER_RECORD)
    write("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        write("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))
