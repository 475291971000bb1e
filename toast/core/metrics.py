"""The block error matrix: how well state ``j`` is explained from state
``i``, for every pair ``i < j``, from :class:`~toast.core.moments.Moments`.

``E[i, j]`` scores predicting state ``j`` from state ``i``; :data:`METRICS`
says in which direction a metric marks a span as redundant.
"""

from __future__ import annotations

import warnings
from typing import Literal

import numpy as np

from toast import _core
from toast._validation import Options, check
from toast.core.errors import (
    ILL_CONDITIONED,
    InSampleWarning,
    explain_rank_deficiency,
    warn_ill_conditioned,
)
from toast.core.moments import Moments, checked_moments
from toast.core.solvers import check_ridge, gram_rank

__all__ = ["METRICS", "error_matrix"]

#: Direction in which each metric marks a span as redundant.
METRICS: dict[str, str] = {
    "linear": "lower",
    "affine": "lower",
    "mse": "lower",
    "br": "higher",
    "cosine": "lower",
    "angular": "lower",
    "euclidean": "lower",
    "cka": "higher",
}
# The core's code of each metric and estimator (TOAST_METRIC_*, TOAST_EST_*).
_METRIC_CODES = {name: getattr(_core, f"METRIC_{name.upper()}") for name in METRICS}
_ESTIMATOR_CODES = {
    name: getattr(_core, f"EST_{name.upper()}") for name in ("cv", "gcv", "in_sample")
}


def error_matrix(
    moments: Moments,
    metric: str = "linear",
    estimator: Literal["cv", "gcv", "in_sample"] = "cv",
    ridge: float = 0.0,
    ridge_relative: bool = False,
) -> np.ndarray:
    """The ``(S, S)`` matrix of a block metric for every pair ``i < j``.

    Metrics (see :data:`METRICS` for their direction): ``"linear"`` —
    ``‖Y − X W*‖_F / ‖Y‖_F`` without bias (the TOAST paper's Algorithm 2); ``"affine"`` — the
    same with a bias; ``"mse"`` — mean over rows of ``‖y − x‖²`` (TBA);
    ``"br"`` — ``−mse`` (RBA block redundancy); ``"cosine"`` — mean of
    ``1 − cos``; ``"angular"`` — mean of ``acos(cos)/π``; ``"euclidean"`` —
    mean of ``‖y − x‖``; ``"cka"`` — linear CKA similarity.

    ``estimator`` applies to the linear metrics: ``"cv"`` (K-fold held-out,
    needs ``folds >= 2``), ``"gcv"`` (generalized cross-validation from the
    eigenvalues of XᵀX, no folds needed; NaN where ``tr(H) >= n``) or
    ``"in_sample"`` (warns when rows <= dim, where the fit is exact).
    Entries on and below the diagonal, and pairs whose cross block the
    moments do not keep, are NaN.
    """
    moments = checked_moments(moments)
    check("metric", metric, Options(METRICS))
    check("estimator", estimator, Options(_ESTIMATOR_CODES))
    linear = metric in ("linear", "affine")
    if linear and estimator == "cv" and moments.folds < 2:
        raise ValueError(
            "estimator='cv' needs moments with folds >= 2 (Moments(..., folds=5)); "
            "use estimator='gcv' for a held-out estimate without folds"
        )
    if linear and estimator == "in_sample" and moments.rows <= moments.dim:
        warnings.warn(
            f"in-sample error with {moments.rows} rows <= dim {moments.dim}: the fit is "
            "exact and every error is ~0; use estimator='cv' or 'gcv'",
            InSampleWarning,
            stacklevel=2,
        )
    E, cond = _core.error_matrix(
        moments,
        _METRIC_CODES[metric],
        _ESTIMATOR_CODES[estimator],
        check_ridge(ridge),
        bool(ridge_relative),
    )
    ill = ~np.isnan(cond) & ~(cond < ILL_CONDITIONED)
    bad = np.flatnonzero(ill) if linear else np.empty(0, dtype=np.intp)
    if len(bad):
        rank, hint = gram_rank(moments, int(bad[0]), center=metric == "affine")
        warn_ill_conditioned(
            explain_rank_deficiency(rank, moments.dim, moments.rows, hint), stacklevel=2
        )
    return E
