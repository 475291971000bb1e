"""The paper-table suite: a record of paper number vs ours, printed at the end.

Tests call ``paper_record(source, item, paper, ours)``; ``pytest tests/paper``
prints every record as one table after the run. The records travel with the
test's report (``user_properties``), so that the process that prints the
summary has them also when workers ran the tests (``pytest -n``): the table is
printed by ``tests/conftest.py``.
"""

from __future__ import annotations

import pytest

from tests._helpers.paper import PAPER_RECORD


def _fmt(value) -> str:
    if isinstance(value, float):
        if abs(value) >= 1:
            return f"{value:.3f}".rstrip("0").rstrip(".")
        return f"{value:.4g}"
    return str(value)


@pytest.fixture
def paper_record(request):
    """``record(source, item, paper, ours)``: one row of the summary table
    (``paper`` is the published figure, or a description of the claim)."""

    def record(source: str, item: str, paper, ours) -> None:
        row = [source, item, _fmt(paper), _fmt(ours)]
        request.node.user_properties.append((PAPER_RECORD, row))

    return record
