"""toast's Hadamard-basis fits against direct NumPy computations on rows:
the rotated least-squares diagonal, the ridge towards it (its GCV grid
and its limits), and LinearPatch's map and scales."""

import math

import numpy as np
import pytest

from toast.core.hadamard import hadamard
from toast.core.patch import (
    PATCH_FITS,
    fit_patch,
    fit_patch_ridge,
    linear_patch,
    patch_scales,
    rotated_diagonal,
)


def _rows(seed=0, n=400, d=12):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d))
    y = x @ (np.eye(d) + 0.3 * rng.normal(size=(d, d))) + 0.5 * rng.normal(size=(n, d))
    return x, y


def test_linear_patch_is_h_diag_ht():
    d = np.linspace(0.5, 2.0, 12)
    h = hadamard(12)
    np.testing.assert_allclose(linear_patch(d), h @ np.diag(d) @ h.T, atol=1e-14)


def test_patch_scales_average_per_sample_ratios():
    rng = np.random.default_rng(1)
    inputs, outputs = rng.uniform(0.5, 2, (5, 12)), rng.uniform(0.5, 2, (5, 12))
    expected = np.mean([outputs[s] / inputs[s] for s in range(5)], axis=0)
    np.testing.assert_allclose(patch_scales(inputs, outputs), expected, rtol=1e-15)


def test_rotated_diagonal_is_the_least_squares_diagonal_in_the_rotated_basis():
    x, y = _rows()
    h = hadamard(12)
    xr, yr = x @ h, y @ h
    d = np.array([np.dot(xr[:, c], yr[:, c]) / np.dot(xr[:, c], xr[:, c]) for c in range(12)])
    np.testing.assert_allclose(rotated_diagonal(x.T @ x, x.T @ y), h @ np.diag(d) @ h.T, atol=1e-12)


def _direct_gcv(x, y, prior, ridge):
    n, d = x.shape
    if math.isinf(ridge):
        return np.sum((y - x @ prior) ** 2) / n
    a = x.T @ x + ridge * np.eye(d)
    t = prior + np.linalg.solve(a, x.T @ (y - x @ prior))
    hat = x @ np.linalg.solve(a, x.T)
    rss = np.sum((y - x @ t) ** 2)
    return rss / (n * (1 - np.trace(hat) / n) ** 2)


def test_patch_ridge_chooses_the_grid_point_of_smallest_direct_gcv():
    x, y = _rows()
    prior = rotated_diagonal(x.T @ x, x.T @ y)
    fit = fit_patch_ridge(x.T @ x, x.T @ y, float(np.sum(y * y)), x.shape[0], prior)
    assert fit.gcv == pytest.approx(_direct_gcv(x, y, prior, fit.ridge), rel=1e-9)
    scale = np.trace(x.T @ x) / 12
    grid = [0.0, math.inf] + [scale * 10.0**k for k in range(-6, 5)]
    assert fit.gcv <= min(_direct_gcv(x, y, prior, r) for r in grid) * (1 + 1e-9)
    a = x.T @ x + fit.ridge * np.eye(12)
    expected = prior + np.linalg.solve(a, x.T @ (y - x @ prior))
    np.testing.assert_allclose(fit.weight, expected, atol=1e-10)


def test_patch_ridge_keeps_the_prior_when_the_rows_say_nothing_more():
    # y is exactly a map of LinearPatch's form: every extra parameter is noise
    rng = np.random.default_rng(2)
    x = rng.normal(size=(30, 12))
    y = x @ linear_patch(np.linspace(0.5, 2, 12)) + 0.01 * rng.normal(size=(30, 12))
    prior = rotated_diagonal(x.T @ x, x.T @ y)
    fit = fit_patch_ridge(x.T @ x, x.T @ y, float(np.sum(y * y)), 30, prior)
    assert fit.ridge > 1.0  # shrunk hard towards the prior (30 rows, 144 free parameters)


def test_patch_ridge_tends_to_least_squares_when_the_rows_determine_it():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(5000, 12))
    y = x @ rng.normal(size=(12, 12)) + 1e-3 * rng.normal(size=(5000, 12))
    prior = rotated_diagonal(x.T @ x, x.T @ y)
    fit = fit_patch_ridge(x.T @ x, x.T @ y, float(np.sum(y * y)), 5000, prior)
    np.testing.assert_allclose(fit.weight, np.linalg.lstsq(x, y, rcond=None)[0], atol=1e-4)


@pytest.mark.parametrize("kind", PATCH_FITS)
def test_fit_patch_fits_every_hadamard_kind_of_the_moments_under_its_name(kind):
    x, y = _rows()
    t = fit_patch(kind, x.T @ x, x.T @ y, float(np.sum(y * y)), x.shape[0])
    assert t.kind == kind and not t.bias.any() and not t.ill_conditioned


def test_fit_patch_refuses_a_kind_it_does_not_fit():
    x, y = _rows()
    with pytest.raises(ValueError, match="kind must be"):
        fit_patch("linear", x.T @ x, x.T @ y, 0.0, 10)


def test_bad_scales_are_refused():
    with pytest.raises(ValueError, match="finite"):
        linear_patch(np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match="samples, d"):
        patch_scales(np.ones((2, 3)), np.ones((3, 3)))
