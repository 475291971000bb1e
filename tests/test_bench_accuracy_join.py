"""benchmarks/bench_accuracy.py --join: records that split the rows or sizes
among them become one record of every row, and only records that can be
joined are."""

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")  # the benchmark imports toast's evaluation code

from tests._helpers import load_script  # noqa: E402
from toast.hf.evaluate.harness import TaskReport  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
bench_accuracy = load_script(ROOT / "benchmarks/bench_accuracy.py", imports_beside=True)

TASKS = ("piqa", "boolq")
OPTIONS = {"limit": 20, "skip": 10, "batch_size": 16, "calibration": "wikipedia"}
PEER = "Prune&Comp (paper)"


def _report(scores: np.ndarray) -> dict:
    documents = {t: [float(x) for x in scores[k]] for k, t in enumerate(TASKS)}
    metrics = {t: {"acc": float(np.mean(scores[k]))} for k, t in enumerate(TASKS)}
    return TaskReport(metrics, dict.fromkeys(TASKS, "acc"), {}, harness={},
                      documents=documents).to_dict()  # fmt: skip


def _row(name: str, blocks: int, seed: int) -> dict:
    scores = np.random.default_rng(seed).integers(0, 2, (len(TASKS), 20)).astype(float)
    return {"row": name, "blocks": blocks, "what": "[12:20]", "report": _report(scores)}


def _record(rows: list[dict], options: dict | None = None, original_seed: int = 0) -> dict:
    scores = np.random.default_rng(original_seed).integers(0, 2, (len(TASKS), 20)).astype(float)
    return {
        "options": dict(options or OPTIONS), "rows": rows, "original": {"report": _report(scores)},
        "wall_seconds": 10.0,
    }  # fmt: skip


def test_joined_records_hold_every_row_of_each_once_by_size():
    a = _record([_row(bench_accuracy.DEFAULT_ROW, 8, 1), _row(PEER, 8, 2)])
    b = _record([_row(PEER, 4, 3), _row(bench_accuracy.DEFAULT_ROW, 4, 4)])
    joined = bench_accuracy.joined_sizes([a, b])
    # by size, then in the benchmark's order of rows (the peers before toast's)
    assert [(r["row"], r["blocks"]) for r in joined["rows"]] == [
        (PEER, 4), (bench_accuracy.DEFAULT_ROW, 4), (PEER, 8), (bench_accuracy.DEFAULT_ROW, 8),
    ]  # fmt: skip
    by_key = {(r["row"], r["blocks"]): r for r in [*a["rows"], *b["rows"]]}
    assert all(r == by_key[(r["row"], r["blocks"])] for r in joined["rows"])


def test_a_row_copied_into_two_records_is_joined_once():
    shared = _row(PEER, 8, 1)
    a = _record([shared, _row(bench_accuracy.DEFAULT_ROW, 8, 2)])
    b = _record([dict(shared), _row(PEER, 4, 3)])
    joined = bench_accuracy.joined_sizes([a, b])
    assert [(r["row"], r["blocks"]) for r in joined["rows"]] == [
        (PEER, 4), (PEER, 8), (bench_accuracy.DEFAULT_ROW, 8),
    ]  # fmt: skip


def test_join_refuses_a_row_measured_twice():
    a = _record([_row(PEER, 8, 1)])
    b = _record([_row(PEER, 8, 2)])
    with pytest.raises(SystemExit, match="in two records"):
        bench_accuracy.joined_sizes([a, b])


def test_join_refuses_another_calibration():
    a = _record([_row(PEER, 8, 1)])
    b = _record([_row(PEER, 4, 2)], {**OPTIONS, "calibration": "docstrings"})
    with pytest.raises(SystemExit, match="another setting"):
        bench_accuracy.joined_sizes([a, b])


def test_join_refuses_an_original_scored_on_other_documents():
    a = _record([_row(PEER, 8, 1)])
    b = _record([_row(PEER, 4, 2)], original_seed=5)
    with pytest.raises(SystemExit, match="other documents"):
        bench_accuracy.joined_sizes([a, b])


def _scored(row: str, blocks: int, scores: np.ndarray) -> dict:
    return {"row": row, "blocks": blocks, "what": "[12:20]", "report": _report(scores)}


def test_a_row_ahead_by_more_than_its_paired_error_is_named_and_one_within_is_not():
    rng = np.random.default_rng(0)
    default = rng.integers(0, 2, (len(TASKS), 20)).astype(float)
    better = default.copy()
    better[:, :6] = 1.0  # right wherever the default is, and on six more documents a task
    record = _record([
        _scored(bench_accuracy.DEFAULT_ROW, 8, default), _scored(PEER, 8, better),
        _scored(PEER, 4, default), _scored(bench_accuracy.DEFAULT_ROW, 4, default),
    ])  # fmt: skip
    a, b = TaskReport.from_dict(_report(better)), TaskReport.from_dict(_report(default))
    diff, se = 100 * (a.average - b.average), 100 * a.paired_stderr(b)
    assert diff > se > 0
    text = bench_accuracy.leads(record)
    assert f"| {PEER} | +0.0 ± 0.0 | {diff:+.1f} ± {se:.1f} |" in text
    assert text.endswith(f"more than one paired standard error: {PEER} at 8.")


def test_a_row_measured_again_is_judged_by_its_figure_over_the_draws():
    rng = np.random.default_rng(0)
    default = rng.integers(0, 2, (len(TASKS), 20)).astype(float)
    better = default.copy()
    better[:, :6] = 1.0
    record = _record([_scored(bench_accuracy.DEFAULT_ROW, 8, default), _scored(PEER, 8, better)])
    over = {
        "options": {**OPTIONS, "limit": 125}, "draws": [0, 1, 2],
        "compared": [{"row": PEER, "blocks": 8, "every_task": {"mean": 0.3, "se": 0.4}}],
    }  # fmt: skip
    record["confirmed"] = bench_accuracy.confirmations(over)
    text = bench_accuracy.leads(record)
    assert "**+0.3 ± 0.4** over 3 draws, documents 10–134" in text
    assert text.endswith("more than one paired standard error: none.")


def test_a_pooled_records_rows_confirm_with_their_paired_error():
    rng = np.random.default_rng(1)
    default, peer = (rng.integers(0, 2, (len(TASKS), 20)).astype(float) for _ in range(2))
    pooled = _record([_scored(bench_accuracy.DEFAULT_ROW, 6, default), _scored(PEER, 6, peer)])
    (found,) = bench_accuracy.confirmations(pooled)
    diffs = peer - default  # per task, the variance of the per-document differences
    se = 100 * np.sqrt(np.sum(np.var(diffs, axis=1, ddof=1) / 20)) / len(TASKS)
    assert found["mean"] == pytest.approx(100 * (peer.mean() - default.mean()))
    assert found["se"] == pytest.approx(se)
    assert (found["draws"], found["documents"]) == (1, "10–29")
