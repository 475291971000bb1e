"""The cut chosen on held-out batches: the windows of smallest distance are
fitted in one pass and each measured against its plain removal; the cut is
the best-measured one."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests._helpers import replaceme_models as R  # noqa: E402
from toast.hf.evaluate.quality import Evaluator, skipped_blocks  # noqa: E402
from toast.hf.model.blocks import find_blocks  # noqa: E402
from toast.methods.replaceme import profile_distances, replaceme  # noqa: E402
from toast.methods.replaceme.check import CheckSplit  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


def _run(model, calib, **options):
    return replaceme(copy.deepcopy(model), calib, num_blocks=2, progress=False, **options)


def test_the_candidates_are_the_windows_of_smallest_distance():
    model, calib = R.decoder("llama"), R.text_loader(96)
    # the predicted-error windows joining them: tests/methods/replaceme/test_selection.py
    _, report = _run(model, calib, candidates=3, predicted_candidates=0)
    profile = profile_distances(model, CheckSplit(calib, 0.1).fit, progress=False)
    ranked = profile.ranked(2, 3)
    assert [(c.span.start, c.span.stop) for c in report.candidates] == [
        (s.start, s.stop) for s in ranked
    ]


def test_the_cut_is_the_candidate_that_measured_best():
    _, report = _run(R.with_sink(), R.text_loader(96), candidates=4)
    results = [c.result for c in report.candidates]
    chosen = next(c for c in report.candidates if c.span == report.spans[0])
    assert chosen.result == min(results)
    assert report.checks == [chosen]


def test_a_candidates_plain_removal_is_measured_as_an_independent_evaluator_measures_it():
    model, calib = R.with_sink(), R.text_loader(96)
    _, report = _run(model, calib, candidates=4)
    evaluator = Evaluator(CheckSplit(calib, 0.1).check, progress=False)
    stack = find_blocks(model)
    for c in report.candidates:
        with skipped_blocks(stack, [c.span]):
            assert evaluator.measure(model) == pytest.approx(c.plain, rel=1e-6)


def test_each_candidate_measures_what_a_run_with_that_cut_alone_measures():
    model, calib = R.with_sink(), R.text_loader(96)
    _, report = _run(model, calib, candidates=3)
    for c in report.candidates:
        cut = [(c.span.start, c.span.stop)]
        _, alone = _run(model, calib, spans=cut, placement=report.placement)
        (check,) = alone.checks
        assert check.fitted == pytest.approx(c.fitted, rel=1e-5)
        assert check.plain == pytest.approx(c.plain, rel=1e-6)


def test_one_candidate_lets_the_distance_choose():
    model, calib = R.with_sink(), R.text_loader(96)
    _, report = _run(model, calib, candidates=1)
    profile = profile_distances(model, CheckSplit(calib, 0.1).fit, progress=False)
    (distance_choice,) = profile.select(2)
    assert report.spans[0] == distance_choice
    assert report.candidates == []


def test_no_candidates_are_measured_without_held_out_batches():
    _, report = _run(R.decoder("llama"), R.text_loader(96), candidates=4, check_fraction=0.0)
    assert report.candidates == []
    assert len(report.spans) == 1


def test_the_report_names_every_candidate_and_marks_the_cut():
    _, report = _run(R.with_sink(), R.text_loader(96), candidates=3)
    text = report.to_markdown()
    assert "chosen on held-out batches among the 3 windows" in text
    for c in report.candidates:
        assert f"blocks[{c.span.start}:{c.span.stop}]: fitted" in text
    assert text.count(": the cut, with") == 1


def test_the_distances_and_the_predicted_windows_come_from_one_pass_as_from_two():
    from toast.hf.data.calibration import Calibration
    from toast.methods.replaceme.config import DISTANCES, ReplaceMeConfig
    from toast.methods.replaceme.cuts import choose_cuts, predicted_windows

    model, calib = R.decoder("llama"), R.text_loader(48)
    stack = find_blocks(model)
    config = ReplaceMeConfig(num_blocks=2, calibration=Calibration(progress=False))
    assert config.predicted_candidates > 0  # the default measures predicted windows too
    calls = []
    handle = model.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        _, profile = choose_cuts(model, calib, config, stack)
    finally:
        handle.remove()
    assert len(calls) == len(calib)  # one forward a batch
    apart = profile_distances(model, calib, progress=False)
    assert (profile.rows, profile.token_rows) == (apart.rows, apart.token_rows)
    for name in DISTANCES:
        torch.testing.assert_close(
            torch.as_tensor(profile.matrix(name)), torch.as_tensor(apart.matrix(name)),
            rtol=0, atol=0, equal_nan=True,
        )  # fmt: skip
    assert profile.predicted == predicted_windows(model, calib, config, stack)
