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


def _capture(model, counted: list[int]):
    """The capture a configured TOAST runs in memory, counting the batches
    it forwards."""
    from toast.hf.capture.states import capture_moments

    def capture(batches, states, observe, bound=None):
        # the bound is configured TOAST's (rows on disk above it); these moments are small
        batches = list(batches)
        counted.append(len(batches))
        return capture_moments(
            model, batches, states=states, folds=0, observe=observe, progress=False
        )[0]

    return capture


def test_fold_groups_sum_to_each_training_sets_moments():
    from toast.hf.capture.massive import MassiveRows
    from toast.methods.translate.rules import BatchFold, fold_groups

    model, data = R.decoder("llama"), R.text_loader()  # 6 batches
    states, counted = [1, 2, 4], []
    capture = _capture(model, counted)
    groups = fold_groups(data, CHOICE_FOLDS, states, capture, True, 1 << 30)
    assert groups is not None and counted == [2, 2, 1, 1]  # each batch forwarded once
    for k in range(CHOICE_FOLDS):
        summed, rows = groups.training(k)
        recorder = MassiveRows()
        direct = capture(BatchFold(data, CHOICE_FOLDS, k, held=False), states, recorder)
        assert summed.rows == direct.rows
        for i in range(len(states)):
            np.testing.assert_allclose(summed.sum(i), direct.sum(i), rtol=1e-12)
            for j in range(i, len(states)):
                np.testing.assert_allclose(summed.cross(i, j), direct.cross(i, j), rtol=1e-12)
        assert rows is not None and rows.states.shape == recorder.states.shape
        if rows.states.size:  # the same rows, in fold order rather than batch order
            flat = rows.states.reshape(len(rows.states), -1)
            again = recorder.states.reshape(len(recorder.states), -1)
            np.testing.assert_array_equal(flat[np.lexsort(flat.T)], again[np.lexsort(again.T)])


def test_cross_validation_forwards_each_batch_once_where_the_folds_fit_the_bound():
    from toast.hf.model.blocks import find_blocks
    from toast.methods.translate.analysis import analyze
    from toast.methods.translate.check import measure_plans, translated
    from toast.methods.translate.rules import cross_validated

    model, data = R.decoder("llama"), R.text_loader()  # 6 batches, folds of 2, 2, 1, 1
    analysis = analyze(model, data, estimator="gcv", progress=False)
    stack = find_blocks(model)

    def measure(plans, fits, batches):
        return measure_plans(model, plans, fits, lambda w, f: translated(stack, w, f), batches)

    figures = {}
    for bound, expected in (("auto", [2, 2, 1, 1]), (1, [4, 4, 5, 5])):
        config = ToastConfig(num_blocks=2, statistics_bytes=bound)
        plans = candidate_plans(analysis, config)
        counted: list[int] = []
        found = cross_validated(plans, config, analysis, data, _capture(model, counted), measure)
        assert found is not None and counted == expected
        figures[bound] = found.values
    # the folds' sums add up to the training sets' to rounding: the same figures
    np.testing.assert_allclose(figures["auto"], figures[1], rtol=1e-9)


def test_fold_groups_join_the_other_folds_moments_and_massive_rows():
    from toast.hf.capture.massive import MassiveRows
    from toast.methods.translate.rules import FoldGroups

    rng = np.random.default_rng(0)
    rows = [[rng.normal(size=(5 + k, 4)) for _ in range(2)] for k in range(3)]
    moments = [toast.Moments(2, 4).update(states) for states in rows]
    massive = [MassiveRows(rng.normal(size=(k, 2, 4)), rng.random((k, 2)) > 0.5) for k in (1, 0, 2)]
    summed, joined = FoldGroups(moments, massive).training(1)
    x = np.concatenate([rows[0][0], rows[2][0]])
    y = np.concatenate([rows[0][1], rows[2][1]])
    assert summed.rows == len(x)
    np.testing.assert_allclose(summed.cross(0, 1), x.T @ y, rtol=1e-12)
    np.testing.assert_allclose(summed.sum(1), y.sum(axis=0), rtol=1e-12)
    assert joined is not None
    np.testing.assert_array_equal(
        joined.states, np.concatenate([massive[0].states, massive[2].states])
    )
    np.testing.assert_array_equal(
        joined.flags, np.concatenate([massive[0].flags, massive[2].flags])
    )


def test_candidates_after_the_first_resume_past_the_blocks_they_share():
    from toast.hf.model.blocks import find_blocks
    from toast.methods.translate.check import measure_plans, translated
    from toast.spans import Span

    model, data = R.decoder("llama"), R.text_loader()
    stack = find_blocks(model)
    plans = [[Span(3, 5, 0.0)], [Span(2, 4, 0.0)], [Span(4, 6, 0.0)]]
    fits = [[None] for _ in plans]  # plain removal: what runs is the blocks

    def apply(where, chosen):
        return translated(stack, where, chosen)

    calls = [0]
    handle = stack.blocks[0].register_forward_pre_hook(
        lambda *_: calls.__setitem__(0, calls[0] + 1)
    )
    try:
        whole = measure_plans(model, plans, fits, apply, data)
        first = calls[0]
        resumed = measure_plans(model, plans, fits, apply, data, stack=stack)
    finally:
        handle.remove()
    assert first == 3 * len(data)
    assert calls[0] - first == len(data)  # block 0 ran on the first pass alone
    np.testing.assert_allclose(resumed.values, whole.values, rtol=1e-6)


def test_a_bound_too_small_for_the_analysis_and_a_capture_keeps_the_candidates_pairs_alone():
    from toast.core.chunked import PairMoments, resolve_bound
    from toast.methods.translate.analysis import analyze
    from toast.methods.translate.fitting import Fitter
    from toast.methods.translate.rules import room_beside

    model, data = R.decoder("llama"), R.text_loader()
    analysis = analyze(model, data, estimator="gcv", progress=False)
    config = ToastConfig(num_blocks=2)
    plans = candidate_plans(analysis, config)
    whole = analysis.moments
    before = [Fitter(config).closed_forms(plan, analysis) for plan in plans]
    states = sorted({x for p in plans for s in p for x in (s.start, s.stop)})
    room = room_beside(config, analysis, plans, states)  # the default bound: both fit
    bound = resolve_bound(config.statistics_bytes, whole.dim, 0)
    assert analysis.moments is whole and room == bound - whole.nbytes
    tight = ToastConfig(num_blocks=2, statistics_bytes=whole.nbytes + 1)
    room = room_beside(tight, analysis, plans, states)
    assert isinstance(analysis.moments, PairMoments) and analysis.moments.nbytes < whole.nbytes
    assert room == whole.nbytes + 1 - analysis.moments.nbytes
    assert sorted(analysis.moments.spans) == sorted({(s.start, s.stop) for p in plans for s in p})
    after = [Fitter(config).closed_forms(plan, analysis) for plan in plans]
    for old, new in zip(before, after, strict=True):
        for a, b in zip(old, new, strict=True):
            np.testing.assert_allclose(b.weight, a.weight, rtol=1e-9, atol=1e-12)
            np.testing.assert_allclose(b.bias, a.bias, rtol=1e-9, atol=1e-12)
