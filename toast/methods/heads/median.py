"""Python wrappers of the C core's centers and scores (``csrc/geomedian.c``).

- :func:`geometric_median` — Weiszfeld's algorithm with Vardi & Zhang's
  modification (an iterate that lands on a data point is handled), from the
  centroid; stops when a step is at most ``tol`` times the mean distance
  from the iterate to the points (default ``1e-10``), or after ``max_iter``
  steps (default 1000; a :class:`ConvergenceWarning` then says so).
- :func:`coordinate_median` — the lower median of every column (the ToaSt
  reference code's "geometric median", ``torch.median(W, dim=0)``).
- :func:`dim_scores` — per-point importance: distance to the geometric
  median (``"geomedian"``) or to the coordinate median (``"coord_median"``),
  FPGM's sum of distances to the other points (``"fpgm"``), ``"l1"`` and
  ``"l2"`` norms. Larger means more important (farther from the center).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from toast import _core
from toast._validation import Interval, Options, Predicate, check

__all__ = [
    "CENTERS",
    "GM_MAX_ITER",
    "GM_TOL",
    "ConvergenceWarning",
    "GeometricMedian",
    "coordinate_median",
    "dim_scores",
    "geometric_median",
]

#: Defaults of the Weiszfeld stopping rule (TOAST_GM_TOL, TOAST_GM_MAX_ITER).
GM_TOL = 1e-10
GM_MAX_ITER = 1000

#: Score kinds, in the C core's order.
CENTERS = ("geomedian", "coord_median", "fpgm", "l1", "l2")


class ConvergenceWarning(UserWarning):
    """Weiszfeld's iteration hit ``max_iter`` before meeting ``tol``."""


@dataclass(frozen=True)
class GeometricMedian:
    """A geometric median and how it was reached."""

    point: np.ndarray
    iterations: int
    converged: bool
    hits: int  # steps where the iterate sat on a data point (Vardi-Zhang)


def _real(name: str, value: Any) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"{name} must be a real numeric array, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.float64)


_TOL = Predicate(
    lambda v: Interval(float, 0, None).accepts(v) and bool(np.isfinite(v)), "a finite number >= 0"
)


def _check_iteration(tol: float, max_iter: int) -> None:
    check("tol", tol, _TOL)
    check("max_iter", max_iter, Interval(int, 0, None))


def geometric_median(
    points: Any,
    weights: Any = None,
    *,
    tol: float = GM_TOL,
    max_iter: int = GM_MAX_ITER,
) -> GeometricMedian:
    """The point minimising ``Σ w_i ‖x_i − y‖₂`` over the rows ``x_i`` of
    ``points`` (``(n, p)``); ``weights`` default to 1."""
    X = _real("points", points)
    if X.ndim != 2 or X.shape[0] < 1 or X.shape[1] < 1:
        raise ValueError(f"points must have shape (n, p) with n, p >= 1, got {X.shape}")
    w = None if weights is None else _real("weights", weights)
    _check_iteration(tol, max_iter)
    y, iterations, converged, hits = _core.geometric_median(X, w, float(tol), int(max_iter))
    if not converged and max_iter > 0:
        warnings.warn(
            f"Weiszfeld stopped after max_iter={max_iter} steps before the relative step "
            f"fell below tol={tol}",
            ConvergenceWarning,
            stacklevel=2,
        )
    return GeometricMedian(y, int(iterations), bool(converged), int(hits))


def coordinate_median(points: Any) -> np.ndarray:
    """The lower median of every column of ``points`` (``(n, p)``)."""
    X = _real("points", points)
    if X.ndim != 2 or X.shape[0] < 1 or X.shape[1] < 1:
        raise ValueError(f"points must have shape (n, p) with n, p >= 1, got {X.shape}")
    return _core.coordinate_median(X)


def dim_scores(
    points: Any,
    kind: str = "geomedian",
    *,
    tol: float = GM_TOL,
    max_iter: int = GM_MAX_ITER,
    warn: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Scores of the rows of ``points``: ``(n, p)`` or a batch
    ``(groups, n, p)`` of independent sets. Returns ``(scores, iterations)``
    with shapes ``(n,)`` / ``()`` or ``(groups, n)`` / ``(groups,)``
    (Weiszfeld steps; 0 for the other kinds)."""
    check("kind", kind, Options(CENTERS))
    X = _real("points", points)
    single = X.ndim == 2
    if single:
        X = X[None]
    if X.ndim != 3 or min(X.shape) < 1:
        raise ValueError(f"points must have shape (n, p) or (groups, n, p), got {X.shape}")
    _check_iteration(tol, max_iter)
    scores, iterations, converged = _core.dim_scores(
        X, CENTERS.index(kind), float(tol), int(max_iter)
    )
    if warn and not converged.all() and max_iter > 0:
        warnings.warn(
            f"Weiszfeld did not converge in {max_iter} steps for "
            f"{int((~converged).sum())} of {len(converged)} point sets (tol={tol})",
            ConvergenceWarning,
            stacklevel=2,
        )
    if single:
        return scores[0], iterations[0]
    return scores, iterations
