"""The paired standard error of two task averages scored on the same documents."""

from __future__ import annotations

import numpy as np

from tests._helpers import paired_stderr_ref
from toast.hf.evaluate.paired import paired_stderr


def _scores(rng: np.random.Generator, n: int) -> list[float]:
    return [float(v) for v in rng.integers(0, 2, n)]


def test_paired_stderr_equals_numpy_on_the_per_document_differences():
    rng = np.random.default_rng(0)
    mine = {"a": _scores(rng, 30), "b": _scores(rng, 12)}
    theirs = {"a": _scores(rng, 30), "b": _scores(rng, 12)}
    expected = paired_stderr_ref(mine, theirs)
    found = paired_stderr(mine, theirs)
    assert found is not None and np.isclose(found, expected, rtol=1e-12, atol=0)


def test_paired_stderr_of_identical_scores_is_zero():
    scores = {"a": [1.0, 0.0, 1.0, 1.0]}
    assert paired_stderr(scores, scores) == 0.0


def test_paired_stderr_is_none_when_documents_differ_in_number_or_are_missing():
    assert paired_stderr({"a": [1.0, 0.0]}, {"a": [1.0, 0.0, 1.0]}) is None
    assert paired_stderr({"a": [1.0, 0.0]}, {"b": [1.0, 0.0]}) is None
    assert paired_stderr({"a": [1.0]}, {"a": [0.0]}) is None
    assert paired_stderr({}, {}) is None


def test_paired_stderr_averages_over_the_tasks_asked_only():
    mine = {"a": [1.0, 0.0, 1.0], "b": [1.0, 1.0, 1.0]}
    theirs = {"a": [0.0, 0.0, 1.0], "b": [0.0, 0.0, 0.0]}
    alone = paired_stderr(mine, theirs, ["a"])
    assert alone is not None
    assert np.isclose(alone, np.sqrt(np.var([1.0, 0.0, 0.0], ddof=1) / 3))
