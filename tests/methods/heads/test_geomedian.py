"""The C core's centers and scores (csrc/geomedian.c) against independent
references: the geometric median against SciPy's minimisation of the sum of
distances (to 1e-6), the coordinate median and its score against the ToaSt
reference code's definition (``torch.median`` over the rows), FPGM / L1 / L2
against NumPy."""

import numpy as np
import pytest
import torch
from scipy.optimize import minimize
from scipy.spatial.distance import cdist

from toast import _core
from toast.methods.heads.median import (
    CENTERS,
    ConvergenceWarning,
    coordinate_median,
    dim_scores,
    geometric_median,
)

GM_TOL = 1e-6  # the tolerance, relative to the mean distance


def _objective(X, w=None):
    w = np.ones(len(X)) if w is None else np.asarray(w, float)

    def f(y):
        return float(w @ np.linalg.norm(X - y, axis=1))

    def g(y):
        d = np.linalg.norm(X - y, axis=1)
        return ((w / d)[:, None] * (y - X)).sum(axis=0)

    return f, g


def _scipy_median(X, w=None, x0=None):
    f, g = _objective(X, w)
    x0 = X.mean(axis=0) if x0 is None else x0
    res = minimize(f, x0, jac=g, method="BFGS", options={"gtol": 1e-12, "maxiter": 20000})
    return res.x, f


def _close(y, ref, X):
    scale = np.linalg.norm(X - ref, axis=1).mean()
    return np.linalg.norm(y - ref) / scale


# Point sets shaped like the coupled head vectors: d_k points of 2D features.
SHAPES = [(5, 2), (8, 3), (17, 6), (8, 64), (64, 128), (64, 768)]


@pytest.mark.parametrize("shape", SHAPES)
def test_weiszfeld_matches_scipy(shape):
    rng = np.random.default_rng(sum(shape))
    X = rng.standard_normal(shape) * rng.uniform(0.01, 3.0, size=shape[1])
    got = geometric_median(X, tol=1e-12, max_iter=100_000)
    ref, f = _scipy_median(X)
    assert got.converged
    assert _close(got.point, ref, X) <= GM_TOL
    assert f(got.point) <= f(ref) * (1 + 1e-12)


def test_weighted_median_matches_scipy_and_duplicates():
    rng = np.random.default_rng(3)
    X = rng.standard_normal((9, 4))
    w = rng.uniform(0.1, 2.0, size=9)
    got = geometric_median(X, w, tol=1e-12, max_iter=100_000).point
    ref, _ = _scipy_median(X, w)
    assert _close(got, ref, X) <= GM_TOL
    # Duplicated points weigh as integer weights.
    counts = np.array([1, 3, 1, 2, 1, 1, 1, 1, 4])
    dup = geometric_median(np.repeat(X, counts, axis=0), tol=1e-12, max_iter=100_000).point
    weighted = geometric_median(X, counts, tol=1e-12, max_iter=100_000).point
    assert _close(dup, weighted, X) <= 1e-9


def test_iterate_on_a_non_optimal_data_point():
    """The centroid is the data point (0, 0) but the median is elsewhere:
    plain Weiszfeld divides by zero there; the Vardi-Zhang step moves on."""
    X = np.array([[0, 0], [5, 0], [5, 1], [5, -1], [-15, 0.0]])
    got = geometric_median(X, tol=1e-13, max_iter=100_000)
    assert got.hits >= 1 and got.converged
    ref, f = _scipy_median(X, x0=np.array([1.0, 0.3]))
    assert _close(got.point, ref, X) <= GM_TOL
    assert got.point[0] > 0.1


def test_median_at_a_data_point():
    """An optimal data point: returned exactly, no step taken; Nelder-Mead on
    the (non-smooth there) objective finds no lower value."""
    X = np.array([[0.0, 0.0], [2.0, 0.0], [-1.0, 1.0], [-1.0, -1.0]])  # centroid = X[0]
    got = geometric_median(X, tol=1e-12)
    assert np.array_equal(got.point, X[0]) and got.iterations == 0 and got.hits == 1
    others = X[1:] - X[0]
    assert np.linalg.norm((others / np.linalg.norm(others, axis=1)[:, None]).sum(0)) <= 1
    f, _ = _objective(X)
    res = minimize(
        f,
        X[0] + 0.3,
        method="Nelder-Mead",
        options={"xatol": 1e-12, "fatol": 1e-15, "maxiter": 10**5},
    )
    assert res.fun >= f(got.point) - 1e-12
    assert _close(res.x, got.point, X) <= GM_TOL


def test_degenerate_sets():
    same = np.tile([1.0, 2.0, 3.0], (4, 1))
    got = geometric_median(same)
    assert np.array_equal(got.point, same[0]) and got.converged and got.iterations == 0
    one = geometric_median([[4.0, 5.0]])
    assert np.array_equal(one.point, [4.0, 5.0])
    # Collinear, odd count: the middle point.
    line = np.array([[0.0, 0.0], [1.0, 1.0], [5.0, 5.0]])
    assert np.allclose(geometric_median(line, tol=1e-14).point, [1.0, 1.0], atol=1e-9)


def test_max_iter_warns_and_returns_last_iterate():
    X = np.random.default_rng(0).standard_normal((20, 5))
    with pytest.warns(ConvergenceWarning):
        got = geometric_median(X, max_iter=2)
    assert not got.converged and got.iterations == 2
    with pytest.warns(ConvergenceWarning):
        dim_scores(X, "geomedian", max_iter=1)


def _reference_gm_score(W: torch.Tensor) -> torch.Tensor:
    """The ToaSt reference code's ``gm_score`` (toast/importance.py)."""
    return torch.sqrt(torch.sum((W - torch.median(W, dim=0).values) ** 2, dim=1))


@pytest.mark.parametrize("n", [63, 64])  # odd and even (lower median) counts
def test_coordinate_median_matches_reference_code(n):
    W = torch.randn(n, 2 * 96, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    center = coordinate_median(W.numpy())
    assert np.array_equal(center, torch.median(W, dim=0).values.numpy())
    got, _ = dim_scores(W.numpy(), "coord_median")
    want = _reference_gm_score(W).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-14, atol=0)
    keep = 6
    ours = set(np.argsort(-got, kind="stable")[:keep].tolist())
    assert ours == set(torch.topk(torch.from_numpy(want), keep).indices.tolist())


def test_other_scores_match_numpy():
    rng = np.random.default_rng(5)
    X = rng.standard_normal((3, 16, 10))
    fpgm, _ = dim_scores(X, "fpgm")
    l1, _ = dim_scores(X, "l1")
    l2, _ = dim_scores(X, "l2")
    gm, iters = dim_scores(X, "geomedian", tol=1e-12)
    assert iters.shape == (3,) and (iters > 0).all()
    for g in range(3):
        np.testing.assert_allclose(fpgm[g], cdist(X[g], X[g]).sum(axis=1), rtol=1e-13)
        np.testing.assert_allclose(l1[g], np.abs(X[g]).sum(axis=1), rtol=1e-14)
        np.testing.assert_allclose(l2[g], np.linalg.norm(X[g], axis=1), rtol=1e-14)
        center = geometric_median(X[g], tol=1e-12).point
        np.testing.assert_allclose(gm[g], np.linalg.norm(X[g] - center, axis=1), rtol=1e-13)
    single, it = dim_scores(X[1], "l2")
    assert single.shape == (16,) and np.array_equal(single, l2[1]) and it == 0


@pytest.mark.parametrize(
    "call, exc",
    [
        (lambda: geometric_median([[np.nan, 1.0]]), ValueError),
        (lambda: geometric_median(np.ones((3, 2)), [1.0, -1.0, 1.0]), ValueError),
        (lambda: geometric_median(np.ones((3, 2)), [0.0, 0.0, 0.0]), ValueError),
        (lambda: geometric_median(np.ones((3, 2)), [1.0, 1.0]), ValueError),
        (lambda: geometric_median(np.ones((3, 2), complex)), TypeError),
        (lambda: geometric_median(np.ones((0, 2))), ValueError),
        (lambda: geometric_median(np.ones(3)), ValueError),
        (lambda: geometric_median(np.ones((3, 2)), tol=-1.0), ValueError),
        (lambda: geometric_median(np.ones((3, 2)), max_iter=-1), ValueError),
        (lambda: dim_scores(np.ones((2, 2)), "median"), ValueError),
        (lambda: dim_scores(np.ones((2, 2, 2, 2))), ValueError),
        (lambda: dim_scores(np.array([[1.0, np.inf]]), "l1"), ValueError),
        (lambda: coordinate_median(np.ones((2, 0))), ValueError),
        (lambda: _core.dim_scores(np.ones((1, 2, 2)), 99), ValueError),
        (lambda: _core.dim_scores(np.ones((2, 2)), 0), ValueError),
        (lambda: _core.geometric_median(np.ones((2, 2)), np.ones(2), -1.0), ValueError),
    ],
)
def test_bad_input(call, exc):
    with pytest.raises(exc):
        call()


def test_every_kind_runs_through_the_binding():
    X = np.random.default_rng(1).standard_normal((2, 8, 4))
    for k, kind in enumerate(CENTERS):
        raw, iters, conv = _core.dim_scores(X, k)
        assert raw.shape == (2, 8) and conv.all()
        np.testing.assert_array_equal(raw, dim_scores(X, kind)[0])
