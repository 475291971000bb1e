"""A task objective's choice: accuracies within one paired standard error of
the best are a tie, broken by held-out perplexity; beyond it the accuracy
decides."""

from __future__ import annotations

import numpy as np

from tests._helpers import paired_stderr_ref
from toast.frontier.measure import Measurement
from toast.frontier.result import Measured
from toast.frontier.search import TIE_BREAK, _within_noise
from toast.methods.plan import Plan


def _measured(label: int, documents: dict[str, list[float]], perplexity: float) -> Measured:
    plan = Plan(("toast",), "toast", ((label, label + 2),), "affine", 100, 0.0)
    average = float(np.mean([np.mean(v) for v in documents.values()]))
    m = Measurement(
        quality=average, metric="task:x", params=100, macs=None, throughput=None, seconds=0.0,
        metrics={TIE_BREAK: perplexity, "task:x": average}, documents=documents,
    )  # fmt: skip
    return Measured(plan, m)


def _pair(n: int, disagree: int, won: int) -> list[Measured]:
    """Two candidates scored on ``n`` documents of each of two tasks: the
    same scores but on ``disagree`` documents a task, of which the first
    wins ``won``; the second has the lower perplexity."""
    rng = np.random.default_rng(1)
    tasks: tuple[dict[str, list[float]], dict[str, list[float]]] = ({}, {})
    for name in ("a", "b"):
        first = rng.integers(0, 2, n).astype(float)
        second = first.copy()
        where = rng.permutation(n)[:disagree]
        first[where], second[where] = 0.0, 1.0
        first[where[:won]], second[where[:won]] = 1.0, 0.0
        tasks[0][name], tasks[1][name] = first.tolist(), second.tolist()
    return [_measured(0, tasks[0], 40.0), _measured(4, tasks[1], 30.0)]


def test_an_accuracy_within_one_paired_error_goes_to_lower_perplexity():
    measured = _pair(50, 10, 6)
    first, second = (m.measurement for m in measured)
    assert first.quality > second.quality
    assert first.quality - second.quality <= paired_stderr_ref(first.documents, second.documents)
    notes: list[str] = []
    assert _within_noise(measured, [0, 1], 0, notes) == 1
    assert len(notes) == 1 and "within one paired standard error" in notes[0]


def test_an_accuracy_beyond_one_paired_error_decides():
    measured = _pair(4000, 320, 200)
    first, second = (m.measurement for m in measured)
    assert first.quality - second.quality > paired_stderr_ref(first.documents, second.documents)
    notes: list[str] = []
    assert _within_noise(measured, [0, 1], 0, notes) == 0
    assert notes == []


def test_candidates_without_per_document_scores_keep_the_most_accurate():
    measured = _pair(50, 10, 6)
    for m in measured:
        m.measurement.documents.clear()
    assert _within_noise(measured, [0, 1], 0, []) == 0


def test_a_candidate_not_meeting_the_target_is_never_chosen():
    measured = _pair(50, 10, 6)
    assert _within_noise(measured, [0], 0, []) == 0
