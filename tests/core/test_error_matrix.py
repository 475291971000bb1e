"""toast.error_matrix against a NumPy reference that keeps the activations and
solves every pair directly (lstsq / explicit hat matrices / per-row formulas)."""

import pickle
import warnings

import numpy as np
import pytest

import toast
from tests._helpers import assert_rel, lstsq, lstsq_affine, make_states, ridge_ref

ALL_METRICS = ["linear", "affine", "mse", "br", "cosine", "angular", "euclidean", "cka"]
CROSS_METRICS = ["linear", "affine", "cka"]
SCALAR_METRICS = ["mse", "br", "cosine", "angular", "euclidean"]


# --------------------------------------------------------------------------
# references
# --------------------------------------------------------------------------


def fit_ref(X, Y, affine, lam=0.0):
    """(W, b) of the least-squares / ridge map Y ≈ X W + b."""
    if lam == 0.0:
        if affine:
            return lstsq_affine(X, Y)
        return lstsq(X, Y), np.zeros(Y.shape[1])
    return ridge_ref(X, Y, lam, center=affine)


def rss(X, Y, W, b):
    return float(((Y - X @ W - b) ** 2).sum())


def in_sample_ref(X, Y, affine, lam=0.0):
    W, b = fit_ref(X, Y, affine, lam)
    return np.sqrt(rss(X, Y, W, b)) / np.linalg.norm(Y)


def cv_ref(X, Y, K, affine, lam=0.0):
    fold = np.arange(X.shape[0]) % K
    num = den = 0.0
    for k in range(K):
        tr, te = fold != k, fold == k
        W, b = fit_ref(X[tr], Y[tr], affine, lam)
        num += rss(X[te], Y[te], W, b)
        den += float((Y[te] ** 2).sum())
    return np.sqrt(num / den)


def gcv_ref(X, Y, lam, affine):
    """sqrt(RSS)/||Y|| / (1 - tr(H)/n) with the hat matrix built explicitly."""
    n, d = X.shape
    W, b = fit_ref(X, Y, affine, lam)
    if affine:
        Xc = X - X.mean(0)
        H = Xc @ np.linalg.solve(Xc.T @ Xc + lam * np.eye(d), Xc.T) + np.full((n, n), 1 / n)
    else:
        H = X @ np.linalg.solve(X.T @ X + lam * np.eye(d), X.T)
    return np.sqrt(rss(X, Y, W, b)) / np.linalg.norm(Y) / (1 - np.trace(H) / n)


def scalar_ref(metric, X, Y):
    if metric in ("mse", "br"):
        v = np.mean(((Y - X) ** 2).sum(1))
        return v if metric == "mse" else -v
    if metric == "euclidean":
        return np.mean(np.linalg.norm(Y - X, axis=1))
    cos = (X * Y).sum(1) / (np.linalg.norm(X, axis=1) * np.linalg.norm(Y, axis=1))
    if metric == "cosine":
        return np.mean(1 - cos)
    if metric == "angular":
        return np.mean(np.arccos(np.clip(cos, -1, 1)) / np.pi)
    if metric == "cka":
        Xc, Yc = X - X.mean(0), Y - Y.mean(0)
        return np.linalg.norm(Xc.T @ Yc) ** 2 / (
            np.linalg.norm(Xc.T @ Xc) * np.linalg.norm(Yc.T @ Yc)
        )
    raise AssertionError(metric)


def upper_pairs(S):
    return [(i, j) for i in range(S) for j in range(i + 1, S)]


def states_and_moments(seed=1, S=4, n=600, d=12, folds=0, pairs="all", mean=1.0):
    X = make_states(seed, S, n, d, noise=0.3, mean=mean)
    m = toast.Moments(S, d, folds=folds, pairs=pairs)
    # two updates so that streaming is exercised as well
    m.update([x[: n // 3] for x in X]).update([x[n // 3 :] for x in X])
    return X, m


# --------------------------------------------------------------------------
# linear / affine error estimators
# --------------------------------------------------------------------------


@pytest.mark.parametrize("metric", ["linear", "affine"])
def test_in_sample_equals_lstsq_residual(metric):
    X, m = states_and_moments()
    E = toast.error_matrix(m, metric=metric, estimator="in_sample")
    for i, j in upper_pairs(len(X)):
        assert_rel(E[i, j], in_sample_ref(X[i], X[j], metric == "affine"), 1e-7, f"E[{i},{j}]")


@pytest.mark.parametrize("metric", ["linear", "affine"])
def test_in_sample_absolute_ridge(metric):
    X, m = states_and_moments(seed=2)
    lam = 40.0
    E = toast.error_matrix(m, metric=metric, estimator="in_sample", ridge=lam)
    for i, j in upper_pairs(len(X)):
        assert_rel(E[i, j], in_sample_ref(X[i], X[j], metric == "affine", lam), 1e-7)


@pytest.mark.parametrize("metric", ["linear", "affine"])
def test_in_sample_on_a_singular_gram_equals_min_norm_residual(metric):
    # a duplicated column makes every Gram singular: the core's eigen path
    # (not the one-solve Cholesky shortcut) gives the in-sample error
    X = make_states(4, 4, 300, 8, noise=0.3, mean=1.0)
    X = [np.concatenate([x, x[:, :1]], axis=1) for x in X]
    m = toast.Moments(4, 9, folds=0)
    m.update(X)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the ill-conditioning warning is the point
        E = toast.error_matrix(m, metric=metric, estimator="in_sample")
    for i, j in upper_pairs(len(X)):
        assert_rel(E[i, j], in_sample_ref(X[i], X[j], metric == "affine"), 1e-6, f"E[{i},{j}]")


def test_in_sample_relative_ridge_linear():
    X, m = states_and_moments(seed=3)
    r = 0.05
    E = toast.error_matrix(m, metric="linear", estimator="in_sample", ridge=r, ridge_relative=True)
    d = X[0].shape[1]
    for i, j in upper_pairs(len(X)):
        lam = r * np.trace(X[i].T @ X[i]) / d
        assert_rel(E[i, j], in_sample_ref(X[i], X[j], False, lam), 1e-7)


def test_in_sample_relative_ridge_affine_uses_centered_gram_trace():
    # affine fits regularise the centered Gram, so (as for fit_translator)
    # λ_eff = r · trace(XcᵀXc) / d; data with a mean offset tell the two apart
    X, m = states_and_moments(seed=31, mean=3.0)
    r = 0.05
    E = toast.error_matrix(m, metric="affine", estimator="in_sample", ridge=r, ridge_relative=True)
    d = X[0].shape[1]
    for i, j in upper_pairs(len(X)):
        Xc = X[i] - X[i].mean(0)
        lam = r * np.trace(Xc.T @ Xc) / d
        assert_rel(E[i, j], in_sample_ref(X[i], X[j], True, lam), 1e-7)


def test_gcv_relative_ridge_linear():
    X, m = states_and_moments(seed=32, n=200, d=16)
    r = 0.1
    E = toast.error_matrix(m, metric="linear", estimator="gcv", ridge=r, ridge_relative=True)
    d = X[0].shape[1]
    for i, j in upper_pairs(len(X)):
        lam = r * np.trace(X[i].T @ X[i]) / d
        assert_rel(E[i, j], gcv_ref(X[i], X[j], lam, False), 1e-7)


@pytest.mark.parametrize("metric", ["linear", "affine"])
@pytest.mark.parametrize("K", [2, 5])
def test_cv_equals_fold_wise_reference(metric, K):
    X, m = states_and_moments(seed=4, folds=K)
    E = toast.error_matrix(m, metric=metric, estimator="cv")
    for i, j in upper_pairs(len(X)):
        assert_rel(E[i, j], cv_ref(X[i], X[j], K, metric == "affine"), 1e-7, f"E[{i},{j}]")


def test_cv_is_the_default_estimator():
    X, m = states_and_moments(seed=5, folds=3)
    E = toast.error_matrix(m)  # metric="linear", estimator="cv"
    for i, j in upper_pairs(len(X)):
        assert_rel(E[i, j], cv_ref(X[i], X[j], 3, False), 1e-7)


def test_cv_absolute_ridge():
    X, m = states_and_moments(seed=6, folds=4)
    lam = 25.0
    E = toast.error_matrix(m, metric="linear", estimator="cv", ridge=lam)
    for i, j in upper_pairs(len(X)):
        assert_rel(E[i, j], cv_ref(X[i], X[j], 4, False, lam), 1e-7)


@pytest.mark.parametrize("metric", ["linear", "affine"])
@pytest.mark.parametrize("lam", [0.0, 30.0])
def test_gcv_equals_hat_matrix_reference(metric, lam):
    X, m = states_and_moments(seed=7, n=200, d=16)
    E = toast.error_matrix(m, metric=metric, estimator="gcv", ridge=lam)
    for i, j in upper_pairs(len(X)):
        assert_rel(E[i, j], gcv_ref(X[i], X[j], lam, metric == "affine"), 1e-7, f"E[{i},{j}]")


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_gcv_is_nan_when_trace_reaches_rows():
    # rows == d and no ridge: tr(H) = d = n
    X, m = states_and_moments(seed=8, S=3, n=10, d=10)
    E = toast.error_matrix(m, metric="linear", estimator="gcv", ridge=0.0)
    assert np.all(np.isnan(E))


@pytest.mark.parametrize("metric", ["linear", "affine"])
@pytest.mark.parametrize("estimator", ["in_sample", "cv", "gcv"])
def test_exactly_linear_data_has_near_zero_error(metric, estimator):
    rng = np.random.default_rng(9)
    n, d = 400, 16
    X = rng.standard_normal((n, d)) + rng.standard_normal(d)
    Y = X @ rng.standard_normal((d, d))
    if metric == "affine":
        Y = Y + 3 * rng.standard_normal(d)
    m = toast.Moments(2, d, folds=4).update([X, Y])
    E = toast.error_matrix(m, metric=metric, estimator=estimator)
    assert 0 <= E[0, 1] < 1e-6


@pytest.mark.parametrize("metric", ["linear", "affine"])
def test_independent_noise_has_cv_error_near_one(metric):
    # out-of-sample least squares on pure noise: sqrt(1 + d/(n_train-d)) ≈ 1.07
    rng = np.random.default_rng(10)
    n, d = 320, 32
    X, Y = rng.standard_normal((n, d)), rng.standard_normal((n, d))
    m = toast.Moments(2, d, folds=5).update([X, Y])
    E = toast.error_matrix(m, metric=metric, estimator="cv")
    assert 0.9 < E[0, 1] < 1.2


def test_in_sample_error_is_optimistic_on_noise():
    rng = np.random.default_rng(11)
    n, d = 320, 32
    X, Y = rng.standard_normal((n, d)), rng.standard_normal((n, d))
    m = toast.Moments(2, d, folds=5).update([X, Y])
    e_in = toast.error_matrix(m, metric="linear", estimator="in_sample")[0, 1]
    e_cv = toast.error_matrix(m, metric="linear", estimator="cv")[0, 1]
    assert e_in < 1.0 < e_cv


@pytest.mark.filterwarnings("ignore::toast.core.IllConditionedWarning")  # 10 rows of width 12
@pytest.mark.parametrize("n", [10, 12])
def test_in_sample_warns_when_rows_not_above_dim(n):
    X, m = states_and_moments(seed=12, S=2, n=n, d=12)
    with pytest.warns(toast.core.InSampleWarning):
        toast.error_matrix(m, metric="linear", estimator="in_sample")


def test_in_sample_does_not_warn_with_enough_rows():
    X, m = states_and_moments(seed=13, S=2, n=100, d=12)
    with warnings.catch_warnings():
        warnings.simplefilter("error", toast.core.InSampleWarning)
        toast.error_matrix(m, metric="linear", estimator="in_sample")


def test_in_sample_warning_is_user_warning():
    assert issubclass(toast.core.InSampleWarning, UserWarning)


@pytest.mark.parametrize("metric", ["linear", "affine"])
def test_cv_without_folds_raises(metric):
    X, m = states_and_moments(seed=14, folds=0)
    with pytest.raises(ValueError):
        toast.error_matrix(m, metric=metric, estimator="cv")


# --------------------------------------------------------------------------
# distance / similarity metrics
# --------------------------------------------------------------------------


@pytest.mark.parametrize("metric", SCALAR_METRICS + ["cka"])
def test_metric_equals_direct_formula(metric):
    X, m = states_and_moments(seed=15, n=500, d=16)
    E = toast.error_matrix(m, metric=metric)
    for i, j in upper_pairs(len(X)):
        assert_rel(E[i, j], scalar_ref(metric, X[i], X[j]), 1e-10, f"E[{i},{j}]")


def test_br_is_negative_mse():
    X, m = states_and_moments(seed=16)
    mse = toast.error_matrix(m, metric="mse")
    br = toast.error_matrix(m, metric="br")
    iu = np.triu_indices(len(X), 1)
    assert_rel(br[iu], -mse[iu], 1e-14)


def test_cka_is_one_for_scaled_rotated_shifted_copy():
    # linear CKA is invariant to orthogonal maps, isotropic scaling and shifts
    rng = np.random.default_rng(17)
    n, d = 300, 10
    X = rng.standard_normal((n, d))
    Q = np.linalg.qr(rng.standard_normal((d, d)))[0]
    Y = 3.0 * X @ Q + rng.standard_normal(d)
    m = toast.Moments(2, d).update([X, Y])
    assert_rel(toast.error_matrix(m, metric="cka")[0, 1], 1.0, 1e-10)


@pytest.mark.parametrize("metric", SCALAR_METRICS)
def test_scalar_metrics_respect_mask(metric):
    X = make_states(18, 3, 400, 8, mean=1.0)
    mask = np.random.default_rng(180).random(400) < 0.5
    m = toast.Moments(3, 8).update(X, mask=mask)
    E = toast.error_matrix(m, metric=metric)
    for i, j in upper_pairs(3):
        assert_rel(E[i, j], scalar_ref(metric, X[i][mask], X[j][mask]), 1e-10)


@pytest.mark.parametrize("metric", ALL_METRICS)
def test_merged_halves_give_same_matrix(metric):
    X, whole = states_and_moments(seed=19, folds=3)
    a = toast.Moments(4, 12, folds=3).update([x[:300] for x in X])
    b = toast.Moments(4, 12, folds=3).update([x[300:] for x in X])
    a.merge(b)
    E1 = toast.error_matrix(whole, metric=metric)
    E2 = toast.error_matrix(a, metric=metric)
    iu = np.triu_indices(4, 1)
    assert_rel(E2[iu], E1[iu], 1e-10)


@pytest.mark.parametrize("metric", ALL_METRICS)
def test_pickled_moments_give_same_matrix(metric):
    X, m = states_and_moments(seed=20, folds=3)
    r = pickle.loads(pickle.dumps(m))
    E1 = toast.error_matrix(m, metric=metric)
    E2 = toast.error_matrix(r, metric=metric)
    assert np.array_equal(E1, E2, equal_nan=True)


# --------------------------------------------------------------------------
# NaN layout, pair subsets, estimator handling
# --------------------------------------------------------------------------


@pytest.mark.parametrize("metric", ALL_METRICS)
def test_nan_on_and_below_diagonal_finite_above(metric):
    X, m = states_and_moments(seed=21, folds=3)
    E = toast.error_matrix(m, metric=metric)
    S = len(X)
    assert E.shape == (S, S) and E.dtype == np.float64
    lower = np.tril(np.ones((S, S), dtype=bool))
    assert np.all(np.isnan(E[lower]))
    assert np.all(np.isfinite(E[~lower]))


@pytest.mark.parametrize("metric", CROSS_METRICS)
@pytest.mark.parametrize("pairs,span", [("consecutive", 1), (2, 2)])
def test_cross_metrics_nan_for_unstored_pairs(metric, pairs, span):
    X, m = states_and_moments(seed=22, S=5, folds=3, pairs=pairs)
    _, full = states_and_moments(seed=22, S=5, folds=3)
    E = toast.error_matrix(m, metric=metric)
    E_full = toast.error_matrix(full, metric=metric)
    for i, j in upper_pairs(5):
        if j - i <= span:
            assert_rel(E[i, j], E_full[i, j], 1e-10)
        else:
            assert np.isnan(E[i, j]), (i, j)


@pytest.mark.parametrize("metric", SCALAR_METRICS)
def test_scalar_metrics_available_for_all_pairs_with_consecutive(metric):
    X, m = states_and_moments(seed=23, S=5, pairs="consecutive")
    E = toast.error_matrix(m, metric=metric)
    for i, j in upper_pairs(5):
        assert_rel(E[i, j], scalar_ref(metric, X[i], X[j]), 1e-10, f"E[{i},{j}]")


@pytest.mark.parametrize("metric", SCALAR_METRICS + ["cka"])
def test_estimator_ignored_for_non_regression_metrics(metric):
    # no folds, default estimator "cv": fine for metrics that are not fits
    X, m = states_and_moments(seed=24, folds=0)
    E_default = toast.error_matrix(m, metric=metric)
    E_in = toast.error_matrix(m, metric=metric, estimator="in_sample")
    assert np.array_equal(E_default, E_in, equal_nan=True)


def test_unknown_metric_raises():
    _, m = states_and_moments(seed=25, folds=3)
    with pytest.raises(ValueError):
        toast.error_matrix(m, metric="manhattan")


def test_unknown_estimator_raises():
    _, m = states_and_moments(seed=26, folds=3)
    with pytest.raises(ValueError):
        toast.error_matrix(m, metric="linear", estimator="bootstrap")


def test_negative_ridge_raises():
    _, m = states_and_moments(seed=27, folds=3)
    with pytest.raises(ValueError):
        toast.error_matrix(m, metric="linear", ridge=-1.0)


def test_metrics_table_directions():
    assert toast.core.METRICS == {
        "linear": "lower",
        "affine": "lower",
        "mse": "lower",
        "br": "higher",
        "cosine": "lower",
        "angular": "lower",
        "euclidean": "lower",
        "cka": "higher",
    }
