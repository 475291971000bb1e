"""Massive rows recorded during a pass, and the closed-form translator fitted
as if the rows a span would have to make massive kept their input."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from toast.core import Moments, fit_translator  # noqa: E402
from toast.hf.capture.massive import MassiveRows, massive  # noqa: E402

D, N = 6, 200


def _states(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    xi = rng.standard_normal((N, D))
    xj = xi @ (np.eye(D) + 0.3 * rng.standard_normal((D, D))) + 0.5
    xj[::50] += 400.0 * np.eye(D)[2]  # a sink every 50 rows, made between i and j
    return xi, xj


def _recorded(xi: np.ndarray, xj: np.ndarray, mask=None) -> MassiveRows:
    recorder = MassiveRows()
    recorder([torch.from_numpy(xi)[None], torch.from_numpy(xj)[None]], mask)
    return recorder


def test_massive_flags_the_rows_far_above_the_median_norm():
    _, xj = _states()
    flags = massive(torch.from_numpy(xj)).numpy()
    assert np.flatnonzero(flags).tolist() == [0, 50, 100, 150]


def test_the_recorder_keeps_every_state_of_the_massive_rows_only():
    xi, xj = _states()
    recorder = _recorded(xi, xj)
    np.testing.assert_array_equal(recorder.states[:, 0], xi[::50])
    np.testing.assert_array_equal(recorder.states[:, 1], xj[::50])
    assert recorder.created(0, 1).tolist() == [True] * 4
    assert not recorder.created(1, 0).any()


def test_the_recorder_skips_masked_rows():
    xi, xj = _states()
    mask = torch.ones(1, N, dtype=torch.bool)
    mask[0, 50] = False
    assert len(_recorded(xi, xj, mask).states) == 3


@pytest.mark.parametrize(("center", "ridge", "relative"), [(True, 0.0, False), (False, 1e-3, True)])
def test_the_plain_fit_equals_the_fit_on_rows_whose_sink_targets_are_their_inputs(
    center, ridge, relative
):
    xi, xj = _states()
    moments = Moments(2, D, folds=0)
    moments.update([xi, xj])
    got = _recorded(xi, xj).plain_fit(moments, 0, 1, center, ridge, relative)
    replaced = xj.copy()
    replaced[::50] = xi[::50]
    reference = Moments(2, D, folds=0)
    reference.update([xi, replaced])
    kind = "affine" if center else "linear"
    want = fit_translator(reference, 0, 1, kind=kind, ridge=ridge, ridge_relative=relative)
    np.testing.assert_allclose(got.weight, want.weight, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(got.bias, want.bias, rtol=1e-9, atol=1e-9)


def test_no_plain_fit_without_rows_to_create():
    xi, xj = _states()
    moments = Moments(2, D, folds=0)
    moments.update([xi, xj])
    assert _recorded(xi, xi).plain_fit(moments, 0, 1, True, 0.0, False) is None


def test_rows_recorded_batch_by_batch_equal_one_recording_of_them_all():
    xi, xj = _states()
    whole = _recorded(xi, xj)
    parts = MassiveRows()
    for lo in range(0, N, 50):  # a sink per batch
        parts(
            [torch.from_numpy(xi[lo : lo + 50])[None], torch.from_numpy(xj[lo : lo + 50])[None]],
            None,
        )
    np.testing.assert_array_equal(parts.states, whole.states)
    np.testing.assert_array_equal(parts.flags, whole.flags)


def test_narrow_states_are_kept_in_float32_and_give_the_float64_recordings_fits():
    xi, xj = _states()
    narrow = [torch.from_numpy(x).to(torch.bfloat16)[None] for x in (xi, xj)]
    kept, wide = MassiveRows(), MassiveRows()
    kept(narrow, None)
    wide([x.double() for x in narrow], None)
    assert kept.states.dtype == np.float32 and wide.states.dtype == np.float64
    np.testing.assert_array_equal(kept.states.astype(np.float64), wide.states)
    rows = [x.double().numpy()[0] for x in narrow]
    moments = Moments(2, D).update(rows)
    for a, b in zip(
        kept.plain_moments(moments, 0, 1, 1.0), wide.plain_moments(moments, 0, 1, 1.0), strict=True
    ):
        np.testing.assert_array_equal(a, b)
