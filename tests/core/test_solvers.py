"""toast.fit_translator / fit_residual / solve_gram against NumPy/SciPy
references computed from the stored activations (float64 data)."""

import dataclasses
import re
import warnings

import numpy as np
import pytest
import scipy.linalg

import toast
from tests._helpers import (
    assert_rel,
    lstsq,
    lstsq_affine,
    pinv_sym,
    ridge_ref,
)

TOL = 1e-8
METHODS = {"cholesky", "eigh", "svd", "none"}


def pair_data(seed, n=500, d=16, noise=0.5, mean=1.0):
    """X and Y = X A + noise (+ offsets), so bias and centering matter."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d)) + mean * rng.standard_normal(d)
    A = rng.standard_normal((d, d)) / np.sqrt(d)
    Y = X @ A + noise * rng.standard_normal((n, d)) + mean * rng.standard_normal(d)
    return X, Y


def moments2(X, Y, folds=0):
    return toast.Moments(2, X.shape[1], folds=folds).update([X, Y])


def fit(X, Y, **kw):
    return toast.fit_translator(moments2(X, Y), 0, 1, **kw)


def centered(X):
    return X - X.mean(0)


# --------------------------------------------------------------------------
# each kind against its closed form
# --------------------------------------------------------------------------


def test_linear_equals_lstsq():
    X, Y = pair_data(1)
    t = fit(X, Y, kind="linear")
    assert_rel(t.weight, lstsq(X, Y), TOL)
    assert np.all(t.bias == 0)


def test_affine_equals_lstsq_with_bias_column():
    X, Y = pair_data(2)
    t = fit(X, Y, kind="affine")
    W, b = lstsq_affine(X, Y)
    assert_rel(t.weight, W, TOL)
    assert_rel(t.bias, b, TOL)


def test_default_kind_is_affine():
    X, Y = pair_data(3)
    t = toast.fit_translator(moments2(X, Y), 0, 1)
    W, b = lstsq_affine(X, Y)
    assert t.kind == "affine"
    assert_rel(t.weight, W, TOL)
    assert_rel(t.bias, b, TOL)


@pytest.mark.parametrize("lam", [0.5, 50.0])
def test_ridge_absolute_equals_centered_closed_form(lam):
    X, Y = pair_data(4)
    t = fit(X, Y, kind="ridge", ridge=lam, ridge_relative=False)
    W, b = ridge_ref(X, Y, lam, center=True)
    assert_rel(t.weight, W, TOL)
    assert_rel(t.bias, b, TOL)


def test_ridge_relative_scales_by_centered_gram_trace():
    # kind="ridge" is centered, so the regularised Gram is the centered one
    # and λ_eff = r · trace(XcᵀXc) / d. The data have a large mean offset so
    # the uncentered trace would give a clearly different answer.
    X, Y = pair_data(5, mean=3.0)
    r, d = 0.05, X.shape[1]
    t = fit(X, Y, kind="ridge", ridge=r, ridge_relative=True)
    Xc = centered(X)
    lam = r * np.trace(Xc.T @ Xc) / d
    W, b = ridge_ref(X, Y, lam, center=True)
    assert_rel(t.weight, W, TOL)
    assert_rel(t.bias, b, TOL)


def test_ridge_default_is_relative_1e_3():
    X, Y = pair_data(6)
    d = X.shape[1]
    t = fit(X, Y, kind="ridge")
    Xc = centered(X)
    lam = 1e-3 * np.trace(Xc.T @ Xc) / d
    W, b = ridge_ref(X, Y, lam, center=True)
    assert_rel(t.weight, W, TOL)
    assert_rel(t.bias, b, TOL)


def test_ridge_bias_is_not_penalised():
    # a huge ridge shrinks W towards 0 but the bias still absorbs the mean
    X, Y = pair_data(7, mean=2.0)
    t = fit(X, Y, kind="ridge", ridge=1e12, ridge_relative=False)
    W, b = ridge_ref(X, Y, 1e12, center=True)
    assert_rel(t.bias, b, TOL)
    assert_rel(t.bias, Y.mean(0) - X.mean(0) @ W, TOL)
    assert np.linalg.norm(t.weight) < 1e-6


def test_affine_with_absolute_ridge_equals_centered_closed_form():
    X, Y = pair_data(8)
    t = fit(X, Y, kind="affine", ridge=3.0, ridge_relative=False)
    W, b = ridge_ref(X, Y, 3.0, center=True)
    assert_rel(t.weight, W, TOL)
    assert_rel(t.bias, b, TOL)


def test_linear_with_absolute_ridge_equals_uncentered_closed_form():
    X, Y = pair_data(9)
    t = fit(X, Y, kind="linear", ridge=7.0, ridge_relative=False)
    W, _ = ridge_ref(X, Y, 7.0, center=False)
    assert_rel(t.weight, W, TOL)
    assert np.all(t.bias == 0)


def test_linear_with_relative_ridge_scales_by_gram_trace():
    X, Y = pair_data(10, mean=2.0)
    r, d = 0.02, X.shape[1]
    t = fit(X, Y, kind="linear", ridge=r, ridge_relative=True)
    W, _ = ridge_ref(X, Y, r * np.trace(X.T @ X) / d, center=False)
    assert_rel(t.weight, W, TOL)


def test_diagonal_uncentered_per_feature_scale():
    X, Y = pair_data(11)
    t = fit(X, Y, kind="diagonal")
    w = (X * Y).sum(0) / (X * X).sum(0)
    assert_rel(np.diag(t.weight), w, TOL)
    assert np.all(t.weight[~np.eye(X.shape[1], dtype=bool)] == 0)
    assert np.all(t.bias == 0)


def test_diagonal_centered_per_feature_scale_and_bias():
    X, Y = pair_data(12, mean=2.0)
    t = fit(X, Y, kind="diagonal", center=True)
    Xc, Yc = centered(X), centered(Y)
    w = (Xc * Yc).sum(0) / (Xc * Xc).sum(0)
    assert_rel(np.diag(t.weight), w, TOL)
    assert np.all(t.weight[~np.eye(X.shape[1], dtype=bool)] == 0)
    assert_rel(t.bias, Y.mean(0) - X.mean(0) * w, TOL)


def test_orthogonal_equals_scipy_procrustes():
    X, Y = pair_data(13)
    t = fit(X, Y, kind="orthogonal")
    R = scipy.linalg.orthogonal_procrustes(X, Y)[0]
    assert_rel(t.weight, R, TOL)
    assert np.all(t.bias == 0)


def test_orthogonal_centered_equals_procrustes_on_centered_data():
    X, Y = pair_data(14, mean=2.0)
    t = fit(X, Y, kind="orthogonal", center=True)
    R = scipy.linalg.orthogonal_procrustes(centered(X), centered(Y))[0]
    assert_rel(t.weight, R, TOL)
    assert_rel(t.bias, Y.mean(0) - X.mean(0) @ R, TOL)


def test_orthogonal_weight_is_orthogonal():
    X, Y = pair_data(15)
    W = fit(X, Y, kind="orthogonal").weight
    d = X.shape[1]
    assert_rel(W.T @ W, np.eye(d), 1e-10)


def test_identity_gives_identity_and_zero_bias():
    X, Y = pair_data(16)
    t = fit(X, Y, kind="identity")
    assert np.array_equal(t.weight, np.eye(X.shape[1]))
    assert np.array_equal(t.bias, np.zeros(X.shape[1]))


@pytest.mark.parametrize(
    "kind", ["identity", "linear", "affine", "ridge", "diagonal", "orthogonal"]
)
def test_translator_fields(kind):
    X, Y = pair_data(17)
    d = X.shape[1]
    t = fit(X, Y, kind=kind)
    assert isinstance(t, toast.core.Translator)
    assert t.kind == kind
    assert t.weight.shape == (d, d) and t.weight.dtype == np.float64
    assert t.bias.shape == (d,) and t.bias.dtype == np.float64
    assert t.method in METHODS
    assert isinstance(t.rank, int)
    assert isinstance(t.condition, float)


@pytest.mark.parametrize("kind", ["linear", "affine", "diagonal", "orthogonal"])
def test_translator_call_applies_weight_and_bias(kind):
    X, Y = pair_data(18, mean=2.0)
    t = fit(X, Y, kind=kind)
    Z = np.random.default_rng(180).standard_normal((37, X.shape[1]))
    assert_rel(t(Z), Z @ t.weight + t.bias, 1e-13)


def test_translator_is_frozen():
    X, Y = pair_data(19)
    t = fit(X, Y, kind="linear")
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.kind = "affine"


def test_translator_between_non_adjacent_states_of_many():
    # states 1 -> 3 of a 4-state Moments equals lstsq on those two states
    rng = np.random.default_rng(20)
    d = 12
    states = [rng.standard_normal((400, d)) for _ in range(4)]
    states[3] = states[1] @ rng.standard_normal((d, d)) + 0.1 * states[3]
    m = toast.Moments(4, d).update(states)
    t = toast.fit_translator(m, 1, 3, kind="affine")
    W, b = lstsq_affine(states[1], states[3])
    assert_rel(t.weight, W, TOL)
    assert_rel(t.bias, b, TOL)


def test_translator_from_later_to_earlier_state():
    # nothing in the API restricts i < j: fit_translator(m, 3, 1) predicts
    # state 1 from state 3
    rng = np.random.default_rng(41)
    d = 10
    states = [rng.standard_normal((300, d)) for _ in range(4)]
    m = toast.Moments(4, d).update(states)
    t = toast.fit_translator(m, 3, 1, kind="affine")
    W, b = lstsq_affine(states[3], states[1])
    assert_rel(t.weight, W, TOL)
    assert_rel(t.bias, b, TOL)


@pytest.mark.parametrize("kind", ["linear", "affine"])
@pytest.mark.parametrize("k", [0, 2])
def test_exclude_fold_fits_on_other_folds(kind, k):
    K, n = 3, 600
    X, Y = pair_data(21, n=n)
    t = toast.fit_translator(moments2(X, Y, folds=K), 0, 1, kind=kind, exclude_fold=k)
    keep = np.arange(n) % K != k
    if kind == "linear":
        assert_rel(t.weight, lstsq(X[keep], Y[keep]), TOL)
    else:
        W, b = lstsq_affine(X[keep], Y[keep])
        assert_rel(t.weight, W, TOL)
        assert_rel(t.bias, b, TOL)


# --------------------------------------------------------------------------
# ReplaceMe residual form
# --------------------------------------------------------------------------


def three_states(seed, n=500, d=14):
    rng = np.random.default_rng(seed)
    M = rng.standard_normal((n, d)) + rng.standard_normal(d)
    Yst = M @ rng.standard_normal((d, d)) / np.sqrt(d) + 0.3 * rng.standard_normal((n, d))
    L = Yst + M @ rng.standard_normal((d, d)) / np.sqrt(d) + 0.2 * rng.standard_normal((n, d))
    return [M, Yst, L]


@pytest.mark.parametrize("mi,yi,ti", [(0, 1, 2), (1, 0, 2), (0, 2, 1)])
def test_fit_residual_equals_lstsq_of_difference(mi, yi, ti):
    states = three_states(22)
    m = toast.Moments(3, states[0].shape[1]).update(states)
    t = toast.core.fit_residual(m, mi, yi, ti)
    M, Yst, L = states[mi], states[yi], states[ti]
    assert t.kind == "residual"
    assert_rel(t.weight, lstsq(M, L - Yst), TOL)
    assert np.all(t.bias == 0)


def test_fit_residual_centered_has_bias():
    states = three_states(23)
    m = toast.Moments(3, states[0].shape[1]).update(states)
    t = toast.core.fit_residual(m, 0, 1, 2, center=True)
    W, b = lstsq_affine(states[0], states[2] - states[1])
    assert_rel(t.weight, W, TOL)
    assert_rel(t.bias, b, TOL)


def test_fit_residual_ridge():
    states = three_states(24)
    m = toast.Moments(3, states[0].shape[1]).update(states)
    t = toast.core.fit_residual(m, 0, 1, 2, ridge=20.0)
    W, _ = ridge_ref(states[0], states[2] - states[1], 20.0, center=False)
    assert_rel(t.weight, W, TOL)


# --------------------------------------------------------------------------
# conditioning, rank deficiency, method reporting
# --------------------------------------------------------------------------


def ill_conditioned(seed, n=400, d=24, smin=1e-5, noise=1e-4):
    """X = U diag(s) Vᵀ with s from 1 down to smin: cond(XᵀX) = smin**-2."""
    rng = np.random.default_rng(seed)
    U = np.linalg.qr(rng.standard_normal((n, d)))[0]
    V = np.linalg.qr(rng.standard_normal((d, d)))[0]
    s = np.logspace(0, np.log10(smin), d)
    X = (U * s) @ V.T
    Y = X @ rng.standard_normal((d, d)) + noise * rng.standard_normal((n, d))
    return X, Y, U, s, V


def test_well_conditioned_fit_uses_cholesky_with_full_rank():
    X, Y = pair_data(25)
    t = fit(X, Y, kind="linear")
    assert t.method == "cholesky"
    assert t.rank == X.shape[1]


def test_condition_is_of_centered_gram_for_affine():
    # With a large mean offset cond(XᵀX) is far above cond(XcᵀXc); the
    # reported number must track the centered one (an estimate may differ
    # from the exact 2-norm condition by a factor of order d).
    X, Y = pair_data(26, mean=20.0)
    d = X.shape[1]
    t = fit(X, Y, kind="affine")
    Xc = centered(X)
    exact = np.linalg.cond(Xc.T @ Xc)
    assert np.linalg.cond(X.T @ X) > 10 * d * exact * 10  # the data discriminate
    assert exact / (10 * d) <= t.condition <= exact * 10 * d


@pytest.mark.filterwarnings("ignore::toast.core.IllConditionedWarning")  # the point of the test
def test_ill_conditioned_fit_reports_large_condition():
    X, Y, *_ = ill_conditioned(27)  # cond(XᵀX) = 1e10
    t = fit(X, Y, kind="linear")
    assert t.condition >= 1e9


def test_ill_conditioned_ridge_equals_svd_closed_form():
    X, Y, U, s, V = ill_conditioned(28)
    lam = 1e-6
    t = fit(X, Y, kind="linear", ridge=lam, ridge_relative=False)
    W = V @ np.diag(s / (s**2 + lam)) @ U.T @ Y
    assert_rel(t.weight, W, TOL)
    # the regularised Gram has condition (1 + λ) / (1e-10 + λ) ≈ 1e6
    exact = (1 + lam) / (s[-1] ** 2 + lam)
    d = X.shape[1]
    assert exact / (10 * d) <= t.condition <= exact * 10 * d


@pytest.mark.filterwarnings("ignore::toast.core.IllConditionedWarning")  # the point of the test
def test_ill_conditioned_fitted_values_equal_lstsq():
    # W itself is not well determined along the weakest singular direction
    # (its component there is u_minᵀY / s_min, which amplifies rounding in
    # XᵀX by 1e5), so compare the fitted values X @ W, the projection of Y,
    # which are well determined. Note: forming the pseudo-inverse explicitly,
    # (Q diag(1/w) Qᵀ) XᵀY, loses ~1e-7 here; applying Qᵀ to XᵀY first, then
    # scaling and rotating back, keeps ~3e-11 (NumPy simulation), so 1e-8 is
    # attainable by a careful solver.
    X, Y, *_ = ill_conditioned(29)
    t = fit(X, Y, kind="linear")
    assert_rel(X @ t.weight, X @ lstsq(X, Y), TOL)


@pytest.mark.filterwarnings("ignore::toast.core.IllConditionedWarning")  # the point of the test
def test_fewer_rows_than_features_gives_min_norm_solution():
    rng = np.random.default_rng(30)
    n, d = 20, 32
    X = rng.standard_normal((n, d))
    Y = rng.standard_normal((n, d))
    t = fit(X, Y, kind="linear")
    assert_rel(t.weight, np.linalg.pinv(X) @ Y, TOL)
    assert t.rank == n
    assert t.condition == np.inf or t.condition >= 1e12
    assert t.method == "eigh"


@pytest.mark.filterwarnings("ignore::toast.core.IllConditionedWarning")  # the point of the test
def test_affine_fewer_rows_than_features_gives_min_norm_solution():
    rng = np.random.default_rng(31)
    n, d = 20, 32
    X = rng.standard_normal((n, d)) + rng.standard_normal(d)
    Y = rng.standard_normal((n, d)) + rng.standard_normal(d)
    t = fit(X, Y, kind="affine")
    W = np.linalg.pinv(centered(X)) @ centered(Y)
    assert_rel(t.weight, W, TOL)
    assert_rel(t.bias, Y.mean(0) - X.mean(0) @ W, TOL)
    assert t.rank == n - 1  # centering removes one dimension


@pytest.mark.filterwarnings("ignore::toast.core.IllConditionedWarning")  # the point of the test
def test_duplicated_feature_gives_min_norm_solution():
    rng = np.random.default_rng(32)
    n, d = 300, 16
    X = rng.standard_normal((n, d))
    X[:, 5] = X[:, 3]
    Y = X @ rng.standard_normal((d, d)) + rng.standard_normal((n, d))
    t = fit(X, Y, kind="linear")
    W = lstsq(X, Y)
    assert_rel(t.weight, W, TOL)
    # minimum norm splits the weight equally between the duplicates
    assert_rel(t.weight[5], t.weight[3], 1e-8)
    assert t.rank == d - 1
    assert t.method == "eigh"


# --------------------------------------------------------------------------
# solve_gram
# --------------------------------------------------------------------------


def spd(seed, d=20, cond=1e3):
    rng = np.random.default_rng(seed)
    Q = np.linalg.qr(rng.standard_normal((d, d)))[0]
    w = np.logspace(0, -np.log10(cond), d)
    A = (Q * w) @ Q.T
    return (A + A.T) / 2, rng.standard_normal((d, 5))


def test_solve_gram_spd_matches_scipy():
    A, B = spd(33)
    W, condition, rank, method = toast.core.solve_gram(A, B)
    assert_rel(W, scipy.linalg.solve(A, B, assume_a="pos"), TOL)
    assert rank == A.shape[0]
    assert method == "cholesky"


@pytest.mark.parametrize("target", [1e1, 1e4, 1e8])
def test_solve_gram_condition_tracks_true_condition(target):
    A, B = spd(34, cond=target)
    d = A.shape[0]
    _, condition, _, _ = toast.core.solve_gram(A, B)
    exact = np.linalg.cond(A)
    assert exact / (10 * d) <= condition <= exact * 10 * d


def test_solve_gram_singular_matches_pseudo_inverse():
    rng = np.random.default_rng(35)
    d, r = 20, 12
    G = rng.standard_normal((d, r))
    A = G @ G.T
    A = (A + A.T) / 2
    B = rng.standard_normal((d, 4))
    W, condition, rank, method = toast.core.solve_gram(A, B)
    assert_rel(W, pinv_sym(A, 1e-10) @ B, TOL)
    assert rank == r
    assert condition == np.inf or condition >= 1e12
    assert method == "eigh"


@pytest.mark.parametrize("singular", [False, True])
def test_solve_gram_ridge_adds_lambda_identity(singular):
    rng = np.random.default_rng(36)
    d = 16
    G = rng.standard_normal((d, 8 if singular else 40))
    A = G @ G.T
    A = (A + A.T) / 2
    B = rng.standard_normal((d, 3))
    lam = 0.7
    W, _, rank, _ = toast.core.solve_gram(A, B, ridge=lam)
    assert_rel(W, scipy.linalg.solve(A + lam * np.eye(d), B, assume_a="pos"), TOL)
    assert rank == d


def test_solve_gram_does_not_modify_inputs():
    A, B = spd(37)
    A0, B0 = A.copy(), B.copy()
    toast.core.solve_gram(A, B, ridge=0.1)
    assert np.array_equal(A, A0)
    assert np.array_equal(B, B0)


@pytest.mark.parametrize(
    "make",
    [
        lambda A, B: (A[:, :-1], B),  # A not square
        lambda A, B: (A, B[:-1]),  # B rows != d
        lambda A, B: (A.ravel(), B),  # A 1-D
    ],
    ids=["a_not_square", "b_rows_mismatch", "a_one_dimensional"],
)
def test_solve_gram_rejects_bad_shapes(make):
    A, B = spd(38)
    A2, B2 = make(A, B)
    with pytest.raises(ValueError):
        toast.core.solve_gram(A2, B2)


def test_solve_gram_rejects_negative_ridge():
    A, B = spd(39)
    with pytest.raises(ValueError):
        toast.core.solve_gram(A, B, ridge=-1.0)


# --------------------------------------------------------------------------
# bad arguments
# --------------------------------------------------------------------------


def _moments_for_errors(folds=0, pairs="all"):
    rng = np.random.default_rng(40)
    S, d = 4, 6
    states = [rng.standard_normal((60, d)) for _ in range(S)]
    return toast.Moments(S, d, folds=folds, pairs=pairs).update(states)


BAD_FITS = [
    # id, moments kwargs, fit args, fit kwargs, match
    ("same_state", {}, (1, 1), {}, None),
    ("i_out_of_range", {}, (4, 1), {}, re.escape("i must be an int in [0, 3]; got 4")),
    ("j_out_of_range", {}, (0, 4), {}, re.escape("j must be an int in [0, 3]; got 4")),
    ("unknown_kind", {}, (0, 1), {"kind": "quadratic"}, None),
    ("negative_ridge", {}, (0, 1), {"kind": "ridge", "ridge": -0.1}, None),
    ("pair_not_stored", {"pairs": "consecutive"}, (0, 2), {"kind": "linear"}, None),
    ("exclude_fold_too_large", {"folds": 3}, (0, 1), {"exclude_fold": 3}, None),
    ("exclude_fold_negative", {"folds": 3}, (0, 1), {"exclude_fold": -1}, None),
    ("exclude_fold_without_folds", {}, (0, 1), {"exclude_fold": 0}, None),
]


@pytest.mark.parametrize(
    "mkw,args,kwargs,match", [c[1:] for c in BAD_FITS], ids=[c[0] for c in BAD_FITS]
)
def test_fit_translator_rejects_bad_arguments(mkw, args, kwargs, match):
    m = _moments_for_errors(**mkw)
    with pytest.raises(ValueError, match=match):
        toast.fit_translator(m, *args, **kwargs)


def test_fit_residual_rejects_out_of_range_state():
    m = _moments_for_errors()
    with pytest.raises(ValueError, match=re.escape("target must be an int in [0, 3]; got 4")):
        toast.core.fit_residual(m, 0, 1, 4)


def test_fit_residual_rejects_unstored_pair():
    m = _moments_for_errors(pairs="consecutive")
    with pytest.raises(ValueError):
        toast.core.fit_residual(m, 0, 1, 3)


@pytest.mark.parametrize("bad", ["A", "B"])
def test_solve_gram_rejects_complex_input(bad):
    A = np.eye(3)
    B = np.ones((3, 2))
    args = {"A": A, "B": B}
    args[bad] = args[bad].astype(np.complex128)
    with pytest.raises(TypeError, match=f"{bad} must be a real numeric array"):
        toast.core.solve_gram(args["A"], args["B"])


@pytest.mark.parametrize(("n", "ridge"), [(500, 0.0), (500, 0.3), (8, 0.0)])
def test_the_linear_fit_from_its_two_blocks_equals_the_fit_from_the_moments(n, ridge):
    from toast.core.solvers import fit_linear_gram, fit_translator

    X, Y = pair_data(3, n=n)
    m = toast.Moments(2, X.shape[1])
    m.update([X, Y])
    with warnings.catch_warnings(record=True) as from_moments:
        warnings.simplefilter("always")
        expected = fit_translator(m, 0, 1, kind="linear", ridge=ridge)
    with warnings.catch_warnings(record=True) as from_blocks:
        warnings.simplefilter("always")
        got = fit_linear_gram(m.cross(0, 0), m.cross(0, 1), m.rows, ridge)
    np.testing.assert_array_equal(got.weight, expected.weight)
    np.testing.assert_array_equal(got.bias, expected.bias)
    assert (got.condition, got.rank, got.method) == (
        expected.condition,
        expected.rank,
        expected.method,
    )
    assert [str(w.message) for w in from_blocks] == [str(w.message) for w in from_moments]
