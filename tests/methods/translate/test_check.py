"""TOAST's held-out check: each translator is measured against plain removal
on calibration batches the analysis never saw, by hooks that compute what
the surgery computes, and one that loses becomes the identity."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import toast  # noqa: E402
from tests._helpers import replaceme_models as R  # noqa: E402
from toast.core.chunked import ChunkedMoments, pair_nbytes  # noqa: E402
from toast.hf.evaluate.check import CheckSplit  # noqa: E402
from toast.hf.evaluate.quality import Evaluator, skipped_blocks  # noqa: E402
from toast.hf.model.blocks import find_blocks  # noqa: E402
from toast.methods.translate import fitting  # noqa: E402
from toast.methods.translate.check import translated  # noqa: E402
from toast.spans import Span  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

SPAN = (2, 4)


def _compress(model, data, **options):
    options = {"spans": [SPAN], "progress": False, **options}
    return toast.compress(model, data, method="toast", **options)


def test_the_hooks_that_measure_a_translator_compute_what_the_surgery_computes():
    model, data = R.decoder("llama"), R.text_loader()
    pruned, report = _compress(copy.deepcopy(model), data, check_fraction=0.0)
    t = toast.fit_translator(report.analysis.moments, *SPAN, kind="affine")
    with translated(find_blocks(model), [Span(*SPAN, 0.0)], [t]):
        for batch in data[:2]:
            torch.testing.assert_close(R.outputs(model, batch), R.outputs(pruned, batch))


def test_the_checked_plain_score_is_that_of_plain_removal():
    model, data = R.decoder("llama"), R.text_loader()  # 6 batches: the 4th is held out
    original = copy.deepcopy(model)
    _, report = _compress(model, data, check_fraction=0.25, fallback=False)
    (check,) = report.checks
    evaluator = Evaluator(list(CheckSplit(data, 0.25).check), progress=False)
    with skipped_blocks(find_blocks(original), [Span(*SPAN, 0.0)]):
        assert math.isclose(check.plain, evaluator.measure(original), rel_tol=1e-9)
    assert check.used == "fitted"
    assert "Held-out check against plain removal" in report.to_markdown()


def test_the_analysis_sees_only_the_batches_that_are_not_held_out():
    model, data = R.decoder("llama"), R.text_loader()
    _, checked = _compress(copy.deepcopy(model), data, check_fraction=0.25)
    _, fit_part = _compress(
        copy.deepcopy(model), list(CheckSplit(data, 0.25).fit), check_fraction=0.0
    )
    assert checked.rows == fit_part.rows
    np.testing.assert_array_equal(checked.analysis.errors, fit_part.analysis.errors)


def test_a_translator_that_loses_on_held_out_batches_becomes_plain_removal(monkeypatch):
    closed_form = fitting.Fitter.closed_form

    def ruined(self, moments, i, j, *rest):  # a translator far worse than the identity
        t = closed_form(self, moments, i, j, *rest)
        d = t.weight.shape[0]
        return type(t)("affine", 5.0 * np.eye(d), np.zeros(d), 1.0, d, t.method)

    monkeypatch.setattr(fitting.Fitter, "closed_form", ruined)
    model, data = R.decoder("llama"), R.text_loader()
    plain = copy.deepcopy(model)
    pruned, report = _compress(model, data, check_fraction=0.25)
    (check,) = report.checks
    assert check.used == "plain removal" and check.plain < check.fitted
    with skipped_blocks(find_blocks(plain), [Span(*SPAN, 0.0)]):
        for batch in data[:2]:
            assert torch.equal(R.outputs(pruned, batch), R.outputs(plain, batch))


def test_fewer_batches_than_a_group_hold_the_last_one_out():
    # 6 batches, check_fraction=0.1: the old rule held out none
    _, report = _compress(R.decoder("llama"), R.text_loader())
    assert len(report.checks) == 1 and report.check_note == ""
    assert "Held-out check against plain removal" in report.to_markdown()


def test_nothing_to_hold_out_is_said_loudly():
    with pytest.warns(UserWarning, match="fewer than 2 sequences"):
        _, report = _compress(R.decoder("llama"), R.text_loader(1, 1))
    assert report.checks == [] and "nothing to hold out" in report.check_note
    assert "Held-out check: none (one calibration batch" in report.to_markdown()


def test_sequential_fits_are_not_checked_and_hold_nothing_out():
    model, data = R.decoder("llama"), R.text_loader(96)  # 12 batches
    _, sequential = _compress(copy.deepcopy(model), data, fit="sequential")
    _, every_batch = _compress(copy.deepcopy(model), data, check_fraction=0.0)
    assert sequential.checks == [] and "sequential" in sequential.check_note
    assert sequential.rows == every_batch.rows


def test_a_span_that_fell_back_saves_and_reloads_as_plain_removal(monkeypatch, tmp_path):
    closed_form = fitting.Fitter.closed_form

    def ruined(self, moments, i, j, *rest):
        t = closed_form(self, moments, i, j, *rest)
        d = t.weight.shape[0]
        return type(t)("affine", 5.0 * np.eye(d), np.zeros(d), 1.0, d, t.method)

    monkeypatch.setattr(fitting.Fitter, "closed_form", ruined)
    data = R.text_loader()
    pruned, report = _compress(R.decoder("llama"), data, check_fraction=0.25)
    assert report.checks[0].used == "plain removal"
    toast.save_pretrained(pruned, tmp_path / "saved")
    reloaded = toast.load_pretrained(tmp_path / "saved")
    for batch in data[:2]:
        assert torch.equal(R.outputs(reloaded, batch), R.outputs(pruned, batch))


def _same_outputs(a, b, data):
    for batch in data[:2]:
        torch.testing.assert_close(R.outputs(a, batch), R.outputs(b, batch), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sink", [False, True])
def test_a_kept_fit_is_fitted_again_on_every_batch(sink):
    # with a sink the massive rows of the held-out batches join the analysis's
    model, data = (
        (R.with_sink(), R.text_loader(96)) if sink else (R.decoder("llama"), R.text_loader())
    )
    checked, report = _compress(copy.deepcopy(model), data, check_fraction=0.25, fallback=False)
    every_batch, _ = _compress(copy.deepcopy(model), data, check_fraction=0.0)
    assert report.refitted and report.checks[0].used == "fitted"
    assert "fitted again on every calibration batch" in report.to_markdown()
    _same_outputs(checked, every_batch, data)


def test_refit_false_keeps_the_fit_the_check_measured():
    model, data = R.decoder("llama"), R.text_loader()
    checked, report = _compress(
        copy.deepcopy(model), data, check_fraction=0.25, fallback=False, refit=False
    )
    fit_part = list(CheckSplit(data, 0.25).fit)
    unseen, _ = _compress(copy.deepcopy(model), fit_part, check_fraction=0.0)
    assert not report.refitted and report.checks[0].used == "fitted"
    _same_outputs(checked, unseen, data)


@pytest.mark.parametrize("translator", ["patch_ridge", "linear"])
def test_a_refit_from_rows_on_disk_equals_the_in_memory_refit(translator):
    model, data = R.decoder("llama"), R.text_loader()
    options = {
        "check_fraction": 0.25,
        "translator": translator,
        "fallback": False,
        "estimator": "cv",  # the folds' statistics are what the bound is sized for
    }
    whole, _ = _compress(copy.deepcopy(model), data, **options)
    least = pair_nbytes(32, 5)  # the test decoder's width, 5 folds: one source, one target
    chunked, report = _compress(copy.deepcopy(model), data, statistics_bytes=least, **options)
    assert report.refitted and isinstance(report.analysis.moments, ChunkedMoments)
    _same_outputs(whole, chunked, data)


def test_the_refit_recheck_reads_plain_removal_from_the_first_check(monkeypatch):
    labels: list[str] = []
    measure = Evaluator.measure

    def counted(self, model, label, *args, **kwargs):
        labels.append(label)
        value = measure(self, model, label, *args, **kwargs)
        # plain removal made to lose, so that the fit is kept, refitted and checked again
        return 10.0 * value if label == "plain removal" else value

    monkeypatch.setattr(Evaluator, "measure", counted)
    _, report = _compress(R.decoder("llama"), R.text_loader(), check_fraction=0.25)
    (check,) = report.checks
    assert check.used == "fitted" and report.refitted
    assert labels.count("plain removal") == 1 and labels.count("fitted") == 2
