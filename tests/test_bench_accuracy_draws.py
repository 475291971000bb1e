"""benchmarks/bench_accuracy.py --over-draws: a row's difference to toast's
default over calibration draws, against NumPy on the same per-document
scores."""

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")  # the benchmark imports toast's evaluation code

from tests._helpers import load_script  # noqa: E402
from toast.hf.evaluate.harness import TaskReport  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
bench_accuracy = load_script(ROOT / "benchmarks/bench_accuracy.py", imports_beside=True)

TASKS = ("piqa", "boolq", "arc_easy")
DOCUMENTS = 40
OPTIONS = {"limit": DOCUMENTS, "skip": 10, "batch_size": 16, "calibration": "wikipedia"}


def _report(scores: np.ndarray) -> dict:
    """A report of per-document scores ``scores[task, document]``."""
    documents = {t: [float(x) for x in scores[k]] for k, t in enumerate(TASKS)}
    metrics = {t: {"acc": float(np.mean(scores[k]))} for k, t in enumerate(TASKS)}
    headline = dict.fromkeys(TASKS, "acc")
    return TaskReport(metrics, headline, {}, harness={}, documents=documents).to_dict()


def _record(draw: int, default: np.ndarray, peer: np.ndarray) -> dict:
    rows = [
        {
            "row": bench_accuracy.DEFAULT_ROW,
            "blocks": 6,
            "what": "[13:19]",
            "report": _report(default),
        },
        {"row": "Ghosted Layers (paper)", "blocks": 6, "what": "[13:19]", "report": _report(peer)},
    ]
    original = {"report": _report(np.ones((len(TASKS), DOCUMENTS)))}
    return {"options": {**OPTIONS, "draw": draw}, "rows": rows, "original": original}


def _draws(count: int, seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    default = [rng.integers(0, 2, (len(TASKS), DOCUMENTS)).astype(float) for _ in range(count)]
    peer = [rng.integers(0, 2, (len(TASKS), DOCUMENTS)).astype(float) for _ in range(count)]
    return default, peer


def test_the_mean_and_its_standard_error_over_draws_equal_numpy():
    default, peer = _draws(3)
    records = [_record(k, d, p) for k, (d, p) in enumerate(zip(default, peer, strict=True))]
    (found,) = bench_accuracy.over_draws(records)["compared"]
    every = found["every_task"]
    deltas = [100 * (p.mean() - d.mean()) for d, p in zip(default, peer, strict=True)]
    # the documents' error: per task, the variance of the draw-averaged differences
    diffs = np.mean(peer, axis=0) - np.mean(default, axis=0)
    documents = 100 * np.sqrt(np.sum(np.var(diffs, axis=1, ddof=1) / DOCUMENTS)) / len(TASKS)
    draws = np.std(deltas, ddof=1) / np.sqrt(len(deltas))
    assert every["deltas"] == pytest.approx(deltas)
    assert every["mean"] == pytest.approx(np.mean(deltas))
    assert every["se_documents"] == pytest.approx(documents)
    assert every["se_draws"] == pytest.approx(draws)
    assert every["se"] == pytest.approx(np.hypot(documents, draws))


def test_draws_that_agree_add_no_error_of_their_own():
    default, peer = _draws(1)
    records = [_record(k, default[0], peer[0]) for k in (0, 1)]
    (found,) = bench_accuracy.over_draws(records)["compared"]
    one = TaskReport.from_dict(_report(peer[0])).paired_stderr(
        TaskReport.from_dict(_report(default[0]))
    )
    assert found["every_task"]["se_draws"] == 0.0
    assert found["every_task"]["se"] == pytest.approx(100 * one)


def test_without_boolq_leaves_boolq_out():
    default, peer = _draws(2)
    peer[0][TASKS.index("boolq")] = 1.0  # a lead on BoolQ alone
    records = [_record(k, d, p) for k, (d, p) in enumerate(zip(default, peer, strict=True))]
    (found,) = bench_accuracy.over_draws(records)["compared"]
    others = [k for k, t in enumerate(TASKS) if t != "boolq"]
    deltas = [
        100 * (p[others].mean() - d[others].mean()) for d, p in zip(default, peer, strict=True)
    ]
    assert found["without_boolq"]["deltas"] == pytest.approx(deltas)


def test_records_of_another_setting_are_refused():
    default, peer = _draws(2)
    other = _record(1, default[1], peer[1])
    other["options"]["calibration"] = "docstrings"
    with pytest.raises(SystemExit, match="differ in more than their draw"):
        bench_accuracy.over_draws([_record(0, default[0], peer[0]), other])


def test_two_records_of_one_draw_are_refused():
    default, peer = _draws(2)
    records = [_record(3, d, p) for d, p in zip(default, peer, strict=True)]
    with pytest.raises(SystemExit, match="same draw"):
        bench_accuracy.over_draws(records)
