"""ReplaceMe's held-out check: the fits are measured against plain removal
on calibration batches they never saw, by hooks that compute what the
surgery computes, and a fit that loses is replaced by plain removal."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests._helpers import replaceme_models as R  # noqa: E402
from toast.hf.evaluate.quality import Evaluator, skipped_blocks  # noqa: E402
from toast.hf.model.blocks import find_blocks  # noqa: E402
from toast.methods.replaceme import estimate, replaceme  # noqa: E402
from toast.methods.replaceme.check import CheckSplit, applied  # noqa: E402
from toast.spans import Span  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

SPAN = (2, 4)


def test_the_checked_plain_score_is_that_of_plain_removal_and_the_fit_is_refitted_on_all():
    model, data = R.decoder("llama"), R.text_loader()  # 6 batches: the 4th is held out
    original = copy.deepcopy(model)
    pruned, report = replaceme(model, data, spans=[SPAN], check_fraction=0.25, fallback=False)
    (check,) = report.checks
    evaluator = Evaluator(list(CheckSplit(data, 0.25).check), progress=False)
    with skipped_blocks(find_blocks(original), [Span(*SPAN, 0.0)]):
        assert math.isclose(check.plain, evaluator.measure(original), rel_tol=1e-9)
    _, every_batch = replaceme(copy.deepcopy(original), data, spans=[SPAN], check_fraction=0.0)
    np.testing.assert_array_equal(report.transforms[0], every_batch.transforms[0])
    assert report.rows == every_batch.rows
    assert "Held-out check against plain removal" in report.to_markdown()


@pytest.mark.parametrize("placement", ["fold", "block"])
def test_the_hooks_that_measure_a_fit_compute_what_the_surgery_computes(placement):
    model, data = R.decoder("llama"), R.text_loader()
    pruned, report = replaceme(
        copy.deepcopy(model), data, spans=[SPAN], placement=placement, check_fraction=0.0
    )
    with applied(find_blocks(model), [Span(*SPAN, 0.0)], report.transforms, placement):
        for batch in data[:2]:
            torch.testing.assert_close(R.outputs(model, batch), R.outputs(pruned, batch))


def test_a_fit_that_loses_on_held_out_batches_is_replaced_by_plain_removal(monkeypatch):
    solve = estimate.solve_cut

    def ruined(*args, **kwargs):  # a transform far worse than the identity
        fitted = solve(*args, **kwargs)
        return type(fitted)(5.0 * np.eye(R.HIDDEN), fitted.condition)

    monkeypatch.setattr(estimate, "solve_cut", ruined)
    model, data = R.decoder("llama"), R.text_loader()
    plain = copy.deepcopy(model)
    pruned, report = replaceme(model, data, spans=[SPAN], check_fraction=0.25)
    (check,) = report.checks
    assert check.used == "plain removal" and check.plain < check.fitted
    assert report.transforms == [None]
    with skipped_blocks(find_blocks(plain), [Span(*SPAN, 0.0)]):
        for batch in data[:2]:
            assert torch.equal(R.outputs(pruned, batch), R.outputs(plain, batch))


def test_fewer_batches_than_a_group_hold_the_last_one_out():
    # 6 batches, check_fraction=0.1: the old rule held out none
    _, report = replaceme(R.decoder("llama"), R.text_loader(), spans=[SPAN])
    assert len(report.checks) == 1 and report.check_note == ""
    assert "Held-out check against plain removal" in report.to_markdown()


def test_nothing_to_hold_out_is_said_loudly():
    with pytest.warns(UserWarning, match="fewer than 2 sequences"):
        _, report = replaceme(R.decoder("llama"), R.text_loader(1, 1), spans=[SPAN])
    assert report.checks == [] and "nothing to hold out" in report.check_note
    assert "Held-out check: none (one calibration batch" in report.to_markdown()


def test_a_cosine_fit_that_won_goes_on_from_its_transform_on_every_batch(monkeypatch):
    calls = []
    fit_cosine = estimate.fit_cosine

    def recorded(*args, **kwargs):
        result = fit_cosine(*args, **kwargs)
        calls.append((kwargs["init"], result.transform, int(args[0].shape[0])))
        return result

    monkeypatch.setattr(estimate, "fit_cosine", recorded)
    model, data = R.decoder("llama"), R.text_loader()
    _, report = replaceme(
        model,
        data,
        spans=[SPAN],
        objective="cosine",
        check_fraction=0.25,
        fallback=False,
        placement="fold",
    )
    (first, second) = calls
    np.testing.assert_array_equal(second[0], first[1])  # starts where the checked fit ended
    assert second[2] > first[2]  # on every batch, the held-out ones included
    np.testing.assert_array_equal(report.transforms[0], second[1])


def test_sequential_cuts_are_not_checked_and_hold_nothing_out():
    model, data = R.decoder("llama"), R.text_loader(96)  # 12 batches
    spans = [(1, 2), (3, 4)]
    _, sequential = replaceme(copy.deepcopy(model), data, spans=spans, fit="sequential")
    _, every_batch = replaceme(copy.deepcopy(model), data, spans=spans, check_fraction=0.0)
    assert sequential.checks == [] and "sequential" in sequential.check_note
    assert sequential.rows == every_batch.rows


def test_plain_removal_of_the_same_cut_is_measured_once_across_checks():
    from toast.hf.evaluate.check import check_against_plain

    model, data = R.decoder("llama"), R.text_loader()
    stack, split = find_blocks(model), CheckSplit(data, 0.25)
    cut = [Span(*SPAN, 0.0)]
    d = model.config.hidden_size
    fits = [np.eye(d) * 0.9, np.eye(d) * 1.1]  # two fits of the same cut (two placements)
    measured = []

    def apply(where, transforms):
        measured.append("plain" if transforms[0] is None else "fitted")
        return applied(stack, where, transforms, "block")

    removed: dict = {}
    first = check_against_plain(model, cut, fits[:1], apply, split.check, False, removed=removed)
    second = check_against_plain(model, cut, fits[1:], apply, split.check, False, removed=removed)
    assert measured == ["fitted", "plain", "fitted"]  # the second plain removal not measured again
    assert first[0].plain == second[0].plain
    fresh = check_against_plain(model, cut, fits[1:], apply, split.check, False)
    assert fresh[0].plain == second[0].plain and fresh[0].fitted == second[0].fitted


@pytest.mark.parametrize("placement", ["fold", "block"])
def test_checks_resume_past_the_blocks_before_the_cut_and_measure_the_same(placement):
    from toast.hf.evaluate.check import check_against_plain

    model, data = R.decoder("llama"), R.text_loader()
    stack = find_blocks(model)
    spans = [Span(2, 4, 0.0), Span(3, 5, 0.0)]
    rng = np.random.default_rng(0)
    transforms = [np.eye(R.HIDDEN) + 0.05 * rng.normal(size=(R.HIDDEN, R.HIDDEN)) for _ in spans]

    def apply(where, fits):  # the transform sits on the block before the cut
        return applied(stack, where, fits, placement)

    calls = [0]
    counting = stack.blocks[0].register_forward_pre_hook(
        lambda *_: calls.__setitem__(0, calls[0] + 1)
    )
    try:
        checks = [
            check_against_plain(model, spans, transforms, apply, data, False, True, stack=where)
            for where in (None, stack)
        ]
    finally:
        counting.remove()
    assert calls[0] == 4 * len(data) + len(data)  # four passes whole, then block 0 once
    for a, b in zip(*checks, strict=True):
        assert (a.fitted, a.plain) == pytest.approx((b.fitted, b.plain), rel=1e-9)
