"""Python surface of the C core: moments, error matrices and translators.

Everything numeric happens in :mod:`toast._core` (C, float64, OpenBLAS);
this module validates arguments, names them in error messages, and returns
NumPy arrays and small result objects.

States are indexed ``0..S-1``; ``E[i, j]`` (``i < j``) scores predicting
state ``j`` from state ``i``. Translators use the row-vector convention of
the papers: ``y ≈ x @ weight + bias``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from toast import _core

__all__ = [
    "METRICS",
    "InSampleWarning",
    "IllConditionedWarning",
    "Moments",
    "Translator",
    "error_matrix",
    "fit_residual",
    "fit_translator",
    "solve_gram",
]

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
_METRIC_CODES = {name: code for code, name in enumerate(METRICS)}
_ESTIMATOR_CODES = {"in_sample": 0, "cv": 1, "gcv": 2}
_PRECISION_CODES = {"float64": 0, "mixed": 1}
_METHOD_NAMES = {0: "none", 1: "cholesky", 2: "eigh", 3: "svd"}
# Sets selected by a query: every fold, one fold, every fold but one.
_SETS_ALL, _SETS_ONLY, _SETS_EXCEPT = 0, 1, 2
# Kinds understood by the C solver.
_FIT_IDENTITY, _FIT_LEASTSQ, _FIT_DIAGONAL, _FIT_ORTHOGONAL = 0, 1, 2, 3
# Condition number above which a fit is reported as ill-conditioned.
ILL_CONDITIONED = 1e10

Pairs = Literal["all", "consecutive"] | int


class InSampleWarning(UserWarning):
    """In-sample error with no more rows than features: the fit is exact."""


class IllConditionedWarning(UserWarning):
    """A Gram matrix was singular or nearly so; a pseudo-inverse was used."""


def _span_of(pairs: Pairs, num_states: int) -> int:
    if isinstance(pairs, str):
        if pairs == "all":
            return max(num_states - 1, 0)
        if pairs == "consecutive":
            return 1
        raise ValueError(f"pairs must be 'all', 'consecutive' or an int >= 1, got {pairs!r}")
    if isinstance(pairs, (bool, np.bool_)) or not isinstance(pairs, (int, np.integer)):
        raise ValueError(f"pairs must be 'all', 'consecutive' or an int >= 1, got {pairs!r}")
    if pairs < 1:
        raise ValueError(f"pairs as a span length must be >= 1, got {pairs}")
    return min(int(pairs), max(num_states - 1, 0))


def _check_count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _is_torch_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _as_state(x: Any) -> Any:
    """A NumPy array or a detached CPU torch tensor, read in place by C."""
    if _is_torch_tensor(x):
        return x.detach()
    return x


def _leading_shape(x: Any) -> tuple[int, ...]:
    shape = tuple(int(s) for s in x.shape)
    return shape[:-1]


def _as_row_array(
    value: Any, name: str, lead: tuple[int, ...], kind: Literal["bool", "int"]
) -> np.ndarray:
    """Flattens a mask or fold-id array of the states' leading shape."""
    if _is_torch_tensor(value):
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    if kind == "bool" and arr.dtype != np.bool_:
        raise TypeError(f"{name} must be a boolean array, got dtype {arr.dtype}")
    if kind == "int" and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {arr.dtype}")
    rows = int(np.prod(lead))
    if arr.shape != lead and arr.shape != (rows,):
        raise ValueError(f"{name} has shape {arr.shape} but the states have leading shape {lead}")
    return np.ascontiguousarray(arr.reshape(rows), dtype=np.bool_ if kind == "bool" else np.int64)


class Moments(_core.Moments):
    """Streaming first and second moments of ``num_states`` layer states.

    For every state the row count, the column sums and the cross-product
    blocks ``X_iᵀ X_j`` are accumulated in float64, together with per-row
    pair statistics (cosine, angle, distance) for every pair. Everything is
    a sum, so batches, threads and processes combine by :meth:`merge`.

    Parameters
    ----------
    num_states:
        Number of states S (e.g. ``num_hidden_layers + 1``).
    dim:
        Feature width d, shared by every state.
    folds:
        0 for no folds, or K >= 2: rows are dealt to K folds (row ``r`` to
        fold ``r % K``) and per-fold moments are kept so that held-out
        errors need no second pass. Storage grows K-fold.
    pairs:
        Which cross blocks to keep: ``"all"``, ``"consecutive"`` (``j - i <=
        1``) or an int span ``m`` (``j - i <= m``). Diagonal blocks are
        always kept. Row statistics are kept for every pair regardless.
    precision:
        ``"float64"`` (default): products and sums in float64, so streaming
        equals one-shot to rounding. ``"mixed"``: each chunk of up to 2048
        rows is multiplied in float32 and added to float64 sums; about twice
        as fast, with relative errors around 1e-6.

    Memory: :attr:`nbytes` is the storage; an update also keeps a scratch
    workspace of up to ~100 MB between batches (so that many small batches do
    not allocate it again); :meth:`release_workspace` frees it.

    Thread safety: every method may be called from several threads; updates
    of one object are serialised (the GIL is released while they run).
    """

    def __init__(
        self,
        num_states: int,
        dim: int,
        folds: int = 0,
        pairs: Pairs = "all",
        precision: Literal["float64", "mixed"] = "float64",
    ) -> None:
        num_states = _check_count("num_states", num_states, 1)
        dim = _check_count("dim", dim, 1)
        folds = self._check_folds(folds)
        if precision not in _PRECISION_CODES:
            raise ValueError(f"precision must be 'float64' or 'mixed', got {precision!r}")
        span = _span_of(pairs, num_states)
        super().__init__(num_states, dim, folds, span, _PRECISION_CODES[precision])
        self._pairs = pairs
        self._precision = precision

    @staticmethod
    def _check_folds(folds: Any) -> int:
        if isinstance(folds, (bool, np.bool_)) or not isinstance(folds, (int, np.integer)):
            raise TypeError(f"folds must be an int, got {type(folds).__name__}")
        if folds == 1 or folds < 0:
            raise ValueError(f"folds must be 0 or >= 2, got {folds}")
        return int(folds)

    @staticmethod
    def estimate_nbytes(num_states: int, dim: int, folds: int = 0, pairs: Pairs = "all") -> int:
        """Bytes the moments would hold, computed without allocating."""
        num_states = _check_count("num_states", num_states, 1)
        dim = _check_count("dim", dim, 1)
        folds = Moments._check_folds(folds)
        return _core.estimate_nbytes(num_states, dim, folds, _span_of(pairs, num_states))

    # -- accumulation -----------------------------------------------------

    def update(
        self,
        states: Sequence[Any],
        mask: Any | None = None,
        fold: Any | None = None,
    ) -> Moments:
        """Adds one batch of rows.

        ``states`` holds ``num_states`` NumPy arrays or torch CPU tensors of
        shape ``(rows, dim)`` or ``(batch, tokens, dim)`` (float16, bfloat16,
        float32 or float64, any strides), all with the same leading shape.
        ``mask`` (boolean, leading shape) drops rows such as padding;
        ``fold`` (integers in ``[0, folds)``) overrides the fold of each row.
        A failing update leaves the moments unchanged.
        """
        if not isinstance(states, (list, tuple)):
            raise TypeError(
                f"states must be a list or tuple of {self.num_states} arrays, "
                f"got {type(states).__name__}"
            )
        if len(states) != self.num_states:
            raise ValueError(f"expected {self.num_states} states, got {len(states)}")
        states = [_as_state(x) for x in states]
        lead = None
        if mask is not None or fold is not None:
            first = states[0]
            if not hasattr(first, "shape"):
                raise TypeError(
                    f"states[0] must be a NumPy array or a torch tensor, got {type(first).__name__}"
                )
            lead = _leading_shape(first)
        if mask is not None:
            mask = _as_row_array(mask, "mask", lead, "bool")
        if fold is not None:
            if self.folds == 0:
                raise ValueError("fold ids were given but the moments have no folds")
            fold = _as_row_array(fold, "fold", lead, "int")
        self._update(states, mask, fold)
        return self

    def merge(self, other: Moments) -> Moments:
        """Adds ``other`` (same num_states, dim, folds and pairs) in place."""
        if not isinstance(other, _core.Moments):
            raise TypeError(f"can only merge Moments, got {type(other).__name__}")
        self._merge(other)
        return self

    def all_reduce(self, group: Any = None) -> Moments:
        """Sums these moments over the ranks of a torch.distributed process group,
        in place (collective; see :func:`toast.hf.distributed.all_reduce_moments`)."""
        from toast.hf.distributed import all_reduce_moments

        return all_reduce_moments(self, group=group)

    # -- reading ----------------------------------------------------------

    @property
    def pairs(self) -> Pairs:
        return self._pairs

    @property
    def precision(self) -> str:
        return self._precision

    @property
    def fold_rows(self) -> np.ndarray:
        """Rows per fold, shape ``(folds,)`` (empty without folds)."""
        return np.array([self._count(_SETS_ONLY, k) for k in range(self.folds)], dtype=np.int64)

    def _sets(self, fold: int | None) -> tuple[int, int]:
        if fold is None:
            return _SETS_ALL, 0
        if self.folds == 0:
            raise ValueError("fold was given but the moments have no folds")
        if not 0 <= fold < self.folds:
            raise ValueError(f"fold={fold} is out of range [0, {self.folds})")
        return _SETS_ONLY, int(fold)

    def has_pair(self, i: int, j: int) -> bool:
        """Whether the cross block of states ``i`` and ``j`` is kept."""
        return self._has_pair(i, j)

    def count(self, fold: int | None = None) -> int:
        """Rows in all folds, or in one fold."""
        return self._count(*self._sets(fold))

    def sum(self, i: int, fold: int | None = None) -> np.ndarray:
        """Column sums of state ``i``, shape ``(dim,)``."""
        return self._sums(i, *self._sets(fold))

    def cross(self, i: int, j: int, fold: int | None = None) -> np.ndarray:
        """``X_iᵀ X_j``, shape ``(dim, dim)``; the pair must be kept."""
        for name, v in (("i", i), ("j", j)):
            if not 0 <= v < self.num_states:
                raise ValueError(f"{name}={v} is out of range for {self.num_states} states")
        return self._cross(i, j, *self._sets(fold))

    # -- pickling and repr -------------------------------------------------

    def __reduce__(self):
        return (
            _restore_moments,
            (
                type(self),
                self.num_states,
                self.dim,
                self.folds,
                self._pairs,
                self._precision,
                self._get_data(),
                self.rows,
            ),
        )

    def __repr__(self) -> str:
        return (
            f"Moments(num_states={self.num_states}, dim={self.dim}, folds={self.folds}, "
            f"pairs={self._pairs!r}, rows={self.rows}, nbytes={self.nbytes})"
        )


def _restore_moments(cls, num_states, dim, folds, pairs, precision, data, rows):
    m = cls(num_states, dim, folds=folds, pairs=pairs, precision=precision)
    m._set_data(data, rows)
    return m


# -- translators ------------------------------------------------------------


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


_KINDS = {
    # name: (C kind, default center)
    "identity": (_FIT_IDENTITY, False),
    "linear": (_FIT_LEASTSQ, False),
    "affine": (_FIT_LEASTSQ, True),
    "ridge": (_FIT_LEASTSQ, True),
    "diagonal": (_FIT_DIAGONAL, False),
    "orthogonal": (_FIT_ORTHOGONAL, False),
}
_DEFAULT_RIDGE = 1e-3


def _check_moments(moments: Any) -> Moments:
    if not isinstance(moments, _core.Moments):
        raise TypeError(f"moments must be a toast.Moments, got {type(moments).__name__}")
    if moments.rows == 0:
        raise ValueError("the moments hold no rows: call update() first")
    return moments


def _check_state_index(moments: Moments, name: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value < moments.num_states:
        raise ValueError(f"{name}={value} is out of range for {moments.num_states} states")
    return int(value)


def _check_ridge(ridge: Any) -> float:
    ridge = float(ridge)
    if not np.isfinite(ridge) or ridge < 0:
        raise ValueError(f"ridge must be a finite number >= 0, got {ridge}")
    return ridge


def _warn_condition(t: Translator, what: str) -> None:
    if t.ill_conditioned:
        warnings.warn(
            f"{what}: the Gram matrix is ill-conditioned (condition {t.condition:.3g}, "
            f"rank {t.rank}); the {t.method} solution was used. Consider ridge=...",
            IllConditionedWarning,
            stacklevel=3,
        )


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
    moments = _check_moments(moments)
    i = _check_state_index(moments, "i", i)
    j = _check_state_index(moments, "j", j)
    if i == j:
        raise ValueError(f"i and j must differ, got i=j={i}")
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {sorted(_KINDS)}, got {kind!r}")
    code, default_center = _KINDS[kind]
    if kind == "ridge" and ridge is None:
        ridge, ridge_relative = _DEFAULT_RIDGE, True
    ridge = _check_ridge(0.0 if ridge is None else ridge)
    if kind == "ridge" and ridge == 0.0:
        raise ValueError("kind='ridge' needs ridge > 0")
    if kind == "affine" and center is False:
        raise ValueError("kind='affine' always fits a bias; use kind='linear'")
    center = default_center if center is None else bool(center)
    sel, fold = _SETS_ALL, 0
    if exclude_fold is not None:
        if moments.folds == 0:
            raise ValueError("exclude_fold was given but the moments have no folds")
        if not 0 <= exclude_fold < moments.folds:
            raise ValueError(f"exclude_fold={exclude_fold} is out of range [0, {moments.folds})")
        sel, fold = _SETS_EXCEPT, int(exclude_fold)
    weight, bias, condition, rank, method = _core.fit(
        moments, i, j, code, center, ridge, bool(ridge_relative), sel, fold
    )
    t = Translator(kind, weight, bias, condition, rank, _METHOD_NAMES[method])
    if code == _FIT_LEASTSQ:
        _warn_condition(t, f"fit_translator({i}, {j}, kind={kind!r})")
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
    """ReplaceMe's residual form: ``argmin_T ‖M T + Y − L‖``.

    ``M`` is state ``m`` (e.g. the MLP output of the last kept block), ``Y``
    state ``y`` (its attention residual) and ``L`` state ``target``; the
    moments must keep the pairs ``(m, y)`` and ``(m, target)``. Equals the
    least-squares solution of ``M T ≈ L − Y``.
    """
    moments = _check_moments(moments)
    m = _check_state_index(moments, "m", m)
    y = _check_state_index(moments, "y", y)
    target = _check_state_index(moments, "target", target)
    weight, bias, condition, rank, method = _core.fit_residual(
        moments, m, y, target, bool(center), _check_ridge(ridge), bool(ridge_relative)
    )
    t = Translator("residual", weight, bias, condition, rank, _METHOD_NAMES[method])
    _warn_condition(t, f"fit_residual({m}, {y}, {target})")
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
    W, condition, rank, method = _core.solve_gram(A, B, _check_ridge(ridge))
    return W, condition, rank, _METHOD_NAMES[method]


# -- error matrix -------------------------------------------------------------


def error_matrix(
    moments: Moments,
    metric: str = "linear",
    estimator: Literal["cv", "gcv", "in_sample"] = "cv",
    ridge: float = 0.0,
    ridge_relative: bool = False,
) -> np.ndarray:
    """The ``(S, S)`` matrix of a block metric for every pair ``i < j``.

    Metrics (see :data:`METRICS` for their direction): ``"linear"`` —
    ``‖Y − X W*‖_F / ‖Y‖_F`` without bias (TOAST Alg. 2); ``"affine"`` — the
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
    moments = _check_moments(moments)
    if metric not in _METRIC_CODES:
        raise ValueError(f"metric must be one of {list(METRICS)}, got {metric!r}")
    if estimator not in _ESTIMATOR_CODES:
        raise ValueError(f"estimator must be one of {list(_ESTIMATOR_CODES)}, got {estimator!r}")
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
        _check_ridge(ridge),
        bool(ridge_relative),
    )
    bad = np.flatnonzero(~np.isnan(cond) & ~(cond < ILL_CONDITIONED)) if linear else []
    if len(bad):
        warnings.warn(
            f"states {[int(k) for k in bad]} have ill-conditioned Gram matrices; their "
            "errors use the minimum-norm solution. Consider ridge=... (e.g. ridge=1e-6, "
            "ridge_relative=True)",
            IllConditionedWarning,
            stacklevel=2,
        )
    return E
