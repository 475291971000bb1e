"""TOAST's measured choice: with ``num_blocks`` and held-out batches the
default fits its best predicted plans and keeps the one that measures best
there; the figures it compares are those of the same fits applied by
surgery."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import toast  # noqa: E402
from tests._helpers import replaceme_models as R  # noqa: E402
from toast.hf.evaluate.check import CheckSplit  # noqa: E402
from toast.hf.evaluate.quality import Evaluator  # noqa: E402
from toast.methods.translate.analysis import Analysis  # noqa: E402
from toast.methods.translate.config import ToastConfig  # noqa: E402
from toast.methods.translate.from_disk import compress_from_disk  # noqa: E402
from toast.methods.translate.rules import CHOICE_FOLDS, candidate_plans  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


def _where(plan) -> list[tuple[int, int]]:
    return [(s.start, s.stop) for s in plan]


def _analysis(errors: np.ndarray) -> Analysis:
    moments = toast.Moments(len(errors), 3)  # the candidates read the errors alone
    return Analysis(moments, errors, "linear", "gcv", "all", "model.layers")


def _table(size: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    table = np.full((size + 1, size + 1), np.inf)
    for a in range(size + 1):
        for b in range(a + 1, size + 1):
            table[a, b] = (b - a) * (1.0 + rng.random())
    return table


def test_candidates_are_the_plan_then_the_windows_of_lowest_predicted_error():
    table = _table(8)
    config = ToastConfig(num_blocks=2, candidates=4)
    plans = candidate_plans(_analysis(table), config)
    first = _analysis(table).plan(max_blocks=2)
    assert _where(plans[0]) == _where(first)
    windows = sorted(((a, a + 2) for a in range(1, 7)), key=lambda w: (table[w], w[0]))
    expected = [w for w in windows if [w] != _where(first)][:3]
    assert [_where(p) for p in plans[1:]] == [[w] for w in expected]
    assert all(math.isclose(s.error, table[s.start, s.stop]) for p in plans for s in p)


def test_candidates_respect_max_error_and_the_first_block():
    table = _table(8, seed=1)
    limit = float(np.sort([table[a, a + 3] for a in range(0, 6)])[2])
    config = ToastConfig(num_blocks=3, max_error=limit, candidates=6, include_first_block=True)
    plans = candidate_plans(_analysis(table), config)
    assert all(s.error <= limit for p in plans for s in p)
    assert len(plans) == 3  # every window of 3 blocks within the limit, none twice
    single = ToastConfig(num_blocks=3, candidates=9, single_window=True)
    windows = [_where(p)[0] for p in candidate_plans(_analysis(table), single)]
    assert all(1 <= a and b < 8 for a, b in windows)  # LLM-Streamline's range
    assert len(windows) == 4


def test_given_spans_or_one_candidate_leave_nothing_to_measure():
    table = _table(8)
    assert len(candidate_plans(_analysis(table), ToastConfig(spans=[(2, 4)]))) == 1
    assert len(candidate_plans(_analysis(table), ToastConfig(num_blocks=2, candidates=1))) == 1


def _cross_validated(model, data, plan, folds: int) -> float:
    """The plan's perplexity over every batch, each batch scored by the fit
    of the other folds' batches, built by ``toast.compress`` and surgery."""
    nll, tokens = 0.0, 0
    for k in range(folds):
        rest = [b for i, b in enumerate(data) if i % folds != k]
        built, _ = toast.compress(
            copy.deepcopy(model), rest, method="toast", spans=_where(plan),
            check_fraction=0.0, progress=False,
        )  # fmt: skip
        evaluator = Evaluator(data[k::folds], progress=False, fidelity=False)
        nll += math.log(evaluator.measure(built)) * evaluator.count
        tokens += evaluator.count
    return math.exp(nll / tokens)


def test_the_default_keeps_the_candidate_of_best_cross_validated_perplexity():
    model, data = R.decoder("llama"), R.text_loader()  # 6 batches, 4 folds
    options = {"num_blocks": 2, "progress": False}
    _, report = toast.compress(copy.deepcopy(model), data, method="toast", **options)
    measured = report.measured
    assert measured is not None and len(measured.plans) == 3
    assert (measured.metric, measured.folds) == ("perplexity", CHOICE_FOLDS)
    kept = measured.chosen
    assert measured.values[kept] == min(measured.values)
    assert _where(report.spans) == _where(measured.plans[kept])
    for plan, value in zip(measured.plans, measured.values, strict=True):
        assert math.isclose(_cross_validated(model, data, plan, CHOICE_FOLDS), value, rel_tol=1e-5)
    assert "4-fold cross-validation" in report.to_markdown() and "(kept)" in report.to_markdown()


def test_one_batch_measures_its_candidates_on_its_held_out_sequences():
    model, data = R.decoder("llama"), R.text_loader(16, 16)  # one batch of 16
    options = {"num_blocks": 2, "progress": False, "check_fraction": 0.25}
    _, report = toast.compress(copy.deepcopy(model), data, method="toast", **options)
    measured = report.measured
    assert measured is not None and measured.folds == 0
    heldout = Evaluator(list(CheckSplit(data, 0.25).check), progress=False, fidelity=False)
    for plan, value in zip(measured.plans, measured.values, strict=True):
        built, _ = toast.compress(
            copy.deepcopy(model), data, method="toast", spans=_where(plan),
            check_fraction=0.25, fallback=False, refit=False, progress=False,
        )  # fmt: skip
        assert math.isclose(heldout.measure(built), value, rel_tol=1e-5)


def test_one_candidate_keeps_the_best_predicted_plan_unmeasured():
    model, data = R.decoder("llama"), R.text_loader()
    options = {"num_blocks": 2, "check_fraction": 0.25, "progress": False, "candidates": 1}
    _, report = toast.compress(copy.deepcopy(model), data, method="toast", **options)
    assert report.measured is None
    assert _where(report.spans) == _where(report.analysis.plan(max_blocks=2))


def test_from_disk_measures_the_same_candidates_as_in_memory(tmp_path):
    model, data = R.decoder("llama"), R.text_loader()
    model.save_pretrained(tmp_path / "source")
    options = {"num_blocks": 2, "check_fraction": 0.25, "progress": False}
    report = compress_from_disk(tmp_path / "source", data, tmp_path / "disk", **options)
    _, memory = toast.compress(copy.deepcopy(model), data, method="toast", **options)
    assert memory.measured is not None and report.measured is not None
    assert [_where(p) for p in report.measured.plans] == [_where(p) for p in memory.measured.plans]
    np.testing.assert_allclose(report.measured.values, memory.measured.values, rtol=1e-4)
    assert _where(report.spans) == _where(memory.spans)


def test_an_unmeasured_choice_says_why():
    model = R.decoder("llama")
    options = {"num_blocks": 2, "progress": False}
    with pytest.warns(UserWarning, match="fewer than 2 sequences"):
        _, alone = toast.compress(copy.deepcopy(model), R.text_loader(1, 1), **options)
    assert alone.measured is None and "nothing held out" in alone.measure_note
    assert "Measured choice: none (nothing held out)" in alone.to_markdown()
    _, paper = toast.compress(copy.deepcopy(model), R.text_loader(), check_fraction=0.0, **options)
    assert paper.measured is None and "check_fraction=0" in paper.measure_note
    _, chained = toast.compress(copy.deepcopy(model), R.text_loader(), fit="sequential", **options)
    assert chained.measured is None and "chained once per candidate" in chained.measure_note
    _, given = toast.compress(copy.deepcopy(model), R.text_loader(), spans=[(2, 4)], progress=False)
    assert given.measured is None and given.measure_note == ""


def test_a_refit_that_measures_worse_than_plain_removal_falls_back_to_it():
    from toast.hf.evaluate.check import RemovalCheck
    from toast.methods.translate.rules import refits_checked
    from toast.spans import Span

    spans = [Span(1, 3, 0.1), Span(4, 6, 0.2), Span(7, 9, 0.3)]
    checks = [
        RemovalCheck(spans[0], "perplexity", 10.0, 11.0, 100, "fitted"),
        RemovalCheck(spans[1], "perplexity", 10.0, 11.0, 100, "fitted"),
        RemovalCheck(spans[2], "perplexity", 12.0, 11.0, 100, "plain removal"),
    ]
    again = [
        RemovalCheck(spans[0], "perplexity", 9.0, 11.0, 100, "fitted"),
        RemovalCheck(spans[1], "perplexity", 11.5, 11.0, 100, "plain removal"),
        RemovalCheck(spans[2], "perplexity", 11.0, 11.0, 100, "fitted"),
    ]
    fits, fell = refits_checked(["a", "b", "plain"], again, checks, "plain")
    assert fits == ["a", "plain", "plain"] and fell == [spans[1]]
