"""Closed-form translators solved from :class:`~toast.core.moments.Moments`.

A translator is the map ``y ≈ x @ weight + bias`` between two states, in the
row-vector convention of the papers, solved in float64 by the C core from
the cross blocks alone (no second pass over the data): least squares,
diagonal scale (ReplaceMe's Eq. 13), orthogonal Procrustes, and ReplaceMe's
residual form (Shopkhoev et al., *ReplaceMe: Network Simplification via
Depth Pruning and Transformer Block Linearization*, arXiv 2505.02819, Eq. 6
with its normal equations, Eqs. 11-12 of Appendix A.2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from toast import _core
from toast._validation import Interval, Options, check
from toast.core.errors import ILL_CONDITIONED, explain_rank_deficiency, warn_ill_conditioned
from toast.core.moments import Moments, check_state_index, checked_moments

__all__ = [
    "Translator",
    "fit_linear_gram",
    "fit_residual",
    "fit_translator",
    "gram_rank",
    "solve_gram",
]

_METHOD_NAMES = {
    _core.METHOD_NONE: "none",
    _core.METHOD_CHOLESKY: "cholesky",
    _core.METHOD_EIGH: "eigh",
    _core.METHOD_SVD: "svd",
}
_KINDS = {
    # name: (C kind, default center)
    "identity": (_core.FIT_IDENTITY, False),
    "linear": (_core.FIT_LEASTSQ, False),
    "affine": (_core.FIT_LEASTSQ, True),
    "ridge": (_core.FIT_LEASTSQ, True),
    "diagonal": (_core.FIT_DIAGONAL, False),
    "orthogonal": (_core.FIT_ORTHOGONAL, False),
}
_DEFAULT_RIDGE = 1e-3
_RIDGE = Interval(float, 0, float("inf"), closed="left")


@dataclass(frozen=True)
class Translator:
    """A fitted map ``y ≈ x @ weight + bias`` between two states."""

    kind: str
    weight: np.ndarray = field(repr=False)
    bias: np.ndarray = field(repr=False)
    condition: float
    rank: int
    method: str

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x) @ self.weight + self.bias

    @property
    def ill_conditioned(self) -> bool:
        return not self.condition < ILL_CONDITIONED


def check_ridge(ridge: Any) -> float:
    """``ridge`` as a finite float >= 0."""
    return float(check("ridge", ridge, _RIDGE))


def _warn_condition(t: Translator, what: str, moments: Moments, state: int, center: bool) -> None:
    if t.ill_conditioned:
        _, hint = gram_rank(moments, state, center)
        explained = explain_rank_deficiency(t.rank, moments.dim, moments.rows, hint)
        warn_ill_conditioned(f"{what}: {explained}", stacklevel=3)


def gram_rank(moments: Moments, state: int, center: bool) -> tuple[int, float]:
    """Numerical rank of state ``state``'s Gram matrix XᵀX (centered: its
    scatter matrix), with the solver's threshold (eigenvalues <= d·eps·λ_max
    count as zero), and a ridge worth trying: 1e-3 of its mean diagonal."""
    gram = moments.cross(state, state)
    if center:
        total = moments.sum(state)
        gram = gram - np.outer(total, total) / max(moments.rows, 1)
    eigenvalues = np.linalg.eigvalsh(gram)
    top = float(eigenvalues[-1]) if eigenvalues.size else 0.0
    rank = int(np.sum(eigenvalues > gram.shape[0] * np.finfo(np.float64).eps * top))
    return rank, _ridge_hint(gram)


def _ridge_hint(gram: np.ndarray) -> float:
    """A ridge worth trying for ``gram``: 1e-3 of its mean diagonal."""
    return 1e-3 * float(np.trace(gram)) / max(gram.shape[0], 1)


def _fit_options(
    moments: Moments, kind: str, ridge: float | None, center: bool | None
) -> tuple[int, bool, float, bool]:
    """(C kind, center, ridge, whether the default relative ridge applies)."""
    check("kind", kind, Options(_KINDS))
    code, default_center = _KINDS[kind]
    default_ridge = kind == "ridge" and ridge is None
    value = check_ridge(_DEFAULT_RIDGE if default_ridge else (0.0 if ridge is None else ridge))
    if kind == "ridge" and value == 0.0:
        raise ValueError("kind='ridge' needs ridge > 0")
    if kind == "affine" and center is False:
        raise ValueError("kind='affine' always fits a bias; use kind='linear'")
    return code, default_center if center is None else bool(center), value, default_ridge


def _fold_selection(moments: Moments, exclude_fold: int | None) -> tuple[int, int]:
    if exclude_fold is None:
        return _core.SETS_ALL, 0
    if moments.folds == 0:
        raise ValueError("exclude_fold was given but the moments have no folds")
    fold = check("exclude_fold", exclude_fold, Interval(int, 0, moments.folds - 1))
    return _core.SETS_EXCEPT, fold


def fit_translator(
    moments: Moments,
    i: int,
    j: int,
    kind: str = "affine",
    ridge: float | None = None,
    ridge_relative: bool = False,
    center: bool | None = None,
    exclude_fold: int | None = None,
) -> Translator:
    """Fits a closed-form map from state ``i`` to state ``j``.

    Kinds: ``"identity"``; ``"linear"`` (least squares, no bias);
    ``"affine"`` (least squares with bias); ``"ridge"`` (affine with
    ``ridge`` λ, default ``1e-3`` relative to the mean diagonal of XᵀX);
    ``"diagonal"`` (per-feature scale); ``"orthogonal"`` (Procrustes).
    ``center`` overrides whether a bias is fitted (diagonal and orthogonal
    default to no bias). ``exclude_fold`` fits on every fold but that one.
    Solved in float64: Cholesky, or an eigendecomposition pseudo-inverse
    when singular or ill-conditioned (minimum-norm solution); ``condition``
    reports the conditioning and an :class:`IllConditionedWarning` is issued
    above 1e10.
    """
    moments = checked_moments(moments)
    i = check_state_index(moments, "i", i)
    j = check_state_index(moments, "j", j)
    if i == j:
        raise ValueError(f"i and j must differ, got i=j={i}")
    code, center, ridge, default_ridge = _fit_options(moments, kind, ridge, center)
    sel, fold = _fold_selection(moments, exclude_fold)
    relative = True if default_ridge else bool(ridge_relative)
    weight, bias, condition, rank, method = _core.fit(
        moments, i, j, code, center, ridge, relative, sel, fold
    )
    t = Translator(kind, weight, bias, condition, rank, _METHOD_NAMES[method])
    if code == _core.FIT_LEASTSQ:
        _warn_condition(t, f"fit_translator({i}, {j}, kind={kind!r})", moments, i, center)
    return t


def fit_linear_gram(
    gram: np.ndarray,
    cross: np.ndarray,
    rows: int,
    ridge: float = 0.0,
    what: str = "fit_translator(0, 1, kind='linear')",
) -> Translator:
    """:func:`fit_translator` with ``kind="linear"`` from the two blocks it
    reads, ``XᵀX`` (``gram``) and ``XᵀY`` (``cross``) of ``rows`` rows, so
    that the moments they came from can be freed before the solve: the same
    solve, condition, rank and warning."""
    weight, condition, rank, method = solve_gram(gram, cross, ridge)
    t = Translator("linear", weight, np.zeros(weight.shape[1]), condition, rank, method)
    if t.ill_conditioned:
        explained = explain_rank_deficiency(t.rank, gram.shape[0], rows, _ridge_hint(gram))
        warn_ill_conditioned(f"{what}: {explained}", stacklevel=2)
    return t


def fit_residual(
    moments: Moments,
    m: int,
    y: int,
    target: int,
    ridge: float = 0.0,
    ridge_relative: bool = False,
    center: bool = False,
) -> Translator:
    """ReplaceMe's residual form (Eq. 6 of the ReplaceMe paper):
    ``argmin_T ‖M T + Y − L‖``, solved from ``MᵀM T = Mᵀ(L − Y)`` (Eqs. 11-12).

    ``M`` is state ``m`` (e.g. the MLP output of the last kept block), ``Y``
    state ``y`` (its attention residual) and ``L`` state ``target``; the
    moments must keep the pairs ``(m, y)`` and ``(m, target)``. Equals the
    least-squares solution of ``M T ≈ L − Y``.
    """
    moments = checked_moments(moments)
    m = check_state_index(moments, "m", m)
    y = check_state_index(moments, "y", y)
    target = check_state_index(moments, "target", target)
    weight, bias, condition, rank, method = _core.fit_residual(
        moments, m, y, target, bool(center), check_ridge(ridge), bool(ridge_relative)
    )
    t = Translator("residual", weight, bias, condition, rank, _METHOD_NAMES[method])
    _warn_condition(t, f"fit_residual({m}, {y}, {target})", moments, m, bool(center))
    return t


def solve_gram(
    A: np.ndarray, B: np.ndarray, ridge: float = 0.0
) -> tuple[np.ndarray, float, int, str]:
    """Solves ``(A + ridge I) W = B`` for symmetric PSD ``A`` with the core's
    policy (Cholesky, else eigen pseudo-inverse). Returns
    ``(W, condition, rank, method)``."""
    for name, value in (("A", A), ("B", B)):
        dtype = np.asarray(value).dtype
        if dtype.kind not in "biuf":
            raise TypeError(f"{name} must be a real numeric array, got dtype {dtype}")
    A = np.asarray(A, dtype=np.float64)
    B = np.asarray(B, dtype=np.float64)
    if A.ndim != 2 or A.shape[0] != A.shape[1]:
        raise ValueError(f"A must be a square matrix, got shape {A.shape}")
    if B.ndim != 2 or B.shape[0] != A.shape[0]:
        raise ValueError(f"B must have shape ({A.shape[0]}, m), got {B.shape}")
    if not (np.isfinite(A).all() and np.isfinite(B).all()):
        raise ValueError("A and B must not contain NaN or Inf")
    W, condition, rank, method = _core.solve_gram(A, B, check_ridge(ridge))
    return W, condition, rank, _METHOD_NAMES[method]
