"""The round-trip matrix of the save/load tests, printed after the run.

Tests call ``roundtrip_record(method, family, save, load, result)``;
``pytest tests/io`` prints every record as one table (one row per method,
family and save route; one column per load route), as ``tests/paper``
prints its table.
"""

from __future__ import annotations

import pytest

_CELLS: dict[tuple[str, str, str], dict[str, str]] = {}
LOADS = ("toast load", "transformers", "trust_remote_code")


@pytest.fixture
def roundtrip_record():
    """``record(method, family, save, load, result)``: one cell of the matrix."""

    def record(method: str, family: str, save: str, load: str, result: str) -> None:
        _CELLS.setdefault((method, family, save), {})[load] = result

    return record


def pytest_terminal_summary(terminalreporter):
    if not _CELLS:
        return
    header = ("method", "family", "save", *LOADS)
    rows = [(*key, *(cells.get(load, "-") for load in LOADS)) for key, cells in _CELLS.items()]
    rows.sort()
    widths = [max(len(r[k]) for r in [*rows, header]) for k in range(len(header))]
    write = terminalreporter.write_line
    terminalreporter.section("save / load round trips")
    write("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        write("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))
