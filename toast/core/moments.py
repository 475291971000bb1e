"""Streaming moments of layer states: :class:`Moments` over the C core.

Everything numeric happens in :mod:`toast._core` (C, float64, OpenBLAS);
this module validates arguments, names them in error messages, and returns
NumPy arrays. States are indexed ``0..S-1``. The storage layout is the
core's (``toast._core.moments_layout``); nothing here restates it.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from toast import _core
from toast._validation import Interval, Options, Predicate, check

__all__ = [
    "MIXED_CHUNK_ROWS",
    "PRECISIONS",
    "ROW_STATS",
    "Moments",
    "Pairs",
    "pair_span",
    "checked_moments",
    "storage_layout",
]

PRECISIONS: dict[str, int] = {
    "float64": _core.PRECISION_FLOAT64,
    "mixed": _core.PRECISION_MIXED,
}
#: Rows per chunk of an update at most (the core's TOAST_CHUNK_MAX_ROWS): in
#: mixed precision each chunk's products are formed in float32.
MIXED_CHUNK_ROWS: int = _core.CHUNK_MAX_ROWS

#: The per-row pair statistics kept for every pair, in the core's storage
#: order (TOAST_RS_*): cosine, angle / pi, distance, squared distance.
ROW_STATS: tuple[str, ...] = tuple(
    sorted(("cos", "angle", "dist", "sqdist"), key=lambda n: getattr(_core, f"RS_{n.upper()}"))
)

Pairs = Literal["all", "consecutive"] | int

_PAIRS = (Options(("all", "consecutive")), Interval(int, 1, None))
_COUNT = Interval(int, 1, None)


def _is_fold_count(value: Any) -> bool:
    """0 (no folds) or K >= 2: one fold would leave nothing to train on."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return False
    return int(value) == 0 or int(value) >= 2


_FOLDS = Predicate(_is_fold_count, "0 or an int >= 2")


def pair_span(pairs: Pairs, num_states: int) -> int:
    """The largest ``j - i`` whose cross block ``pairs`` keeps."""
    pairs = check("pairs", pairs, *_PAIRS)
    if pairs == "all":
        return max(num_states - 1, 0)
    if pairs == "consecutive":
        return 1
    return min(int(pairs), max(num_states - 1, 0))


def _check_folds(folds: Any) -> int:
    return int(check("folds", folds, _FOLDS))


def storage_layout(
    num_states: int, dim: int, folds: int = 0, pairs: Pairs = "all"
) -> dict[str, Any]:
    """The core's storage layout of moments of this shape, without allocating
    them: offsets (in doubles) of the count, sums, row statistics and cross
    block panels within one of the ``nsets`` sets (``toast._core.moments_layout``)."""
    num_states = check("num_states", num_states, _COUNT)
    dim = check("dim", dim, _COUNT)
    folds = _check_folds(folds)
    return _core.moments_layout(num_states, dim, folds, pair_span(pairs, num_states))


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
        always kept (of the sources, see below).
    precision:
        ``"float64"`` (default): products and sums in float64, so streaming
        equals one-shot to rounding. ``"mixed"``: each chunk of up to
        :data:`MIXED_CHUNK_ROWS` (4096) rows is multiplied in float32 and
        added to float64 sums; about twice as fast, with relative errors
        around 1e-6.
    row_stats:
        Whether updates form the per-row pair statistics (cosine, angle,
        distances) that the row metrics of :func:`toast.error_matrix` read.
        ``False`` when only least-squares fits will be asked for.
    sources:
        Form the cross blocks ``X_iᵀ X_j`` only for ``i < sources`` (default
        every state). A fit of state ``j`` from state ``i`` reads ``X_iᵀ
        X_i`` and ``X_iᵀ X_j``, never ``X_jᵀ X_j``: ``Moments(2, d,
        sources=1, row_stats=False)`` forms exactly what a least-squares fit
        of state 1 from state 0 needs (ReplaceMe's), about half the
        multiply-adds of all pairs. Blocks not formed raise on reading.
    diagonals:
        With ``sources``, also form the diagonal block ``X_jᵀ X_j`` of every
        later state: what the error matrix reads of a target (its trace), so
        that the errors of the sources' pairs need no panel of the targets.

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
        row_stats: bool = True,
        sources: int | None = None,
        diagonals: bool = False,
    ) -> None:
        num_states = check("num_states", num_states, _COUNT)
        dim = check("dim", dim, _COUNT)
        folds = _check_folds(folds)
        check("precision", precision, Options(PRECISIONS))
        check("row_stats", row_stats, bool)
        if sources is not None:
            sources = check("sources", sources, Interval(int, 1, num_states))
        check("diagonals", diagonals, bool)
        span = pair_span(pairs, num_states)
        super().__init__(
            num_states,
            dim,
            folds,
            span,
            PRECISIONS[precision],
            row_stats,
            sources or 0,
            diagonals,
        )
        self._pairs = pairs
        self._precision = precision

    @staticmethod
    def estimate_nbytes(num_states: int, dim: int, folds: int = 0, pairs: Pairs = "all") -> int:
        """Bytes the moments would hold, computed without allocating."""
        num_states = check("num_states", num_states, _COUNT)
        dim = check("dim", dim, _COUNT)
        folds = _check_folds(folds)
        return _core.estimate_nbytes(num_states, dim, folds, pair_span(pairs, num_states))

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
        lead: tuple[int, ...] = ()
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

    def select(self, states: Sequence[int], sources: int | None = None) -> Moments:
        """The moments of ``states`` alone (ascending; moment ``k`` is state
        ``states[k]``), every fold summed and no row statistics: what
        :meth:`update` would have formed from those states' rows with
        ``Moments(len(states), dim, row_stats=False, sources=sources)``, so
        that moments of the same states from other rows :meth:`merge` into
        it. Every pair of the chosen states must be kept (the blocks from
        ``sources`` on, which that form does not hold, are not read)."""
        chosen = [check_state_index(self, "states", s) for s in states]
        if not chosen or chosen != sorted(set(chosen)):
            raise ValueError(f"states must be distinct and ascending, got {list(states)}")
        out = Moments(len(chosen), self.dim, precision=self._precision, row_stats=False,
                      sources=sources)  # fmt: skip
        lay, d = out.layout(), self.dim
        data = np.zeros(lay["storage_len"])
        data[lay["off_count"]] = self.count()
        for a, s in enumerate(chosen):
            data[lay["off_sums"] + a * d : lay["off_sums"] + (a + 1) * d] = self.sum(s)
        for a, s in enumerate(chosen[: out.sources]):
            blocks = lay["panel_blocks"][a]
            start = lay["panel_offsets"][a]
            panel = data[start : start + d * blocks * d].reshape(d, blocks * d)
            for b in range(blocks):
                panel[:, b * d : (b + 1) * d] = self.cross(s, chosen[a + b])
        out._set_data(data, self.rows)
        return out

    # -- reading ----------------------------------------------------------

    @property
    def pairs(self) -> Pairs:
        return self._pairs

    @property
    def precision(self) -> str:
        return self._precision

    @property
    def row_stats(self) -> bool:
        """Whether updates form the per-row pair statistics."""
        return bool(self._rowstats)

    @property
    def sources(self) -> int:
        """Cross blocks ``X_iᵀ X_j`` are formed for ``i < sources``."""
        return int(self._sources)

    @property
    def diagonals(self) -> bool:
        """Whether the diagonal blocks of the states past :attr:`sources` are formed."""
        return bool(self._diagonals)

    @property
    def fold_rows(self) -> np.ndarray:
        """Rows per fold, shape ``(folds,)`` (empty without folds)."""
        return np.array(
            [self._count(_core.SETS_ONLY, k) for k in range(self.folds)], dtype=np.int64
        )

    def _sets(self, fold: int | None) -> tuple[int, int]:
        if fold is None:
            return _core.SETS_ALL, 0
        if self.folds == 0:
            raise ValueError("fold was given but the moments have no folds")
        return _core.SETS_ONLY, check("fold", fold, Interval(int, 0, self.folds - 1))

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
        i, j = check_state_index(self, "i", i), check_state_index(self, "j", j)
        return self._cross(i, j, *self._sets(fold))

    # -- pickling and repr -------------------------------------------------

    def __reduce__(self):
        return (
            restore_moments,
            (
                type(self),
                self.num_states,
                self.dim,
                self.folds,
                self._pairs,
                self._precision,
                self._get_data(),
                self.rows,
                self.row_stats,
                self.sources,
                self.diagonals,
            ),
        )

    def layout(self) -> dict[str, Any]:
        """Where each quantity lives in :meth:`_get_data`'s storage (the
        core's layout: offsets in doubles, see ``toast._core.moments_layout``)."""
        return super().layout()

    def __repr__(self) -> str:
        return (
            f"Moments(num_states={self.num_states}, dim={self.dim}, folds={self.folds}, "
            f"pairs={self._pairs!r}, rows={self.rows}, nbytes={self.nbytes}"
            + ("" if self.row_stats else ", row_stats=False")
            + ("" if self.sources == self.num_states else f", sources={self.sources}")
            + (", diagonals=True" if self.diagonals else "")
            + ")"
        )


def restore_moments(
    cls,
    num_states,
    dim,
    folds,
    pairs,
    precision,
    data,
    rows,
    row_stats=True,
    sources=None,
    diagonals=False,
):
    """Rebuilds pickled :class:`Moments` (the entry point of ``__reduce__``)."""
    m = cls(
        num_states,
        dim,
        folds=folds,
        pairs=pairs,
        precision=precision,
        row_stats=row_stats,
        sources=sources,
        diagonals=diagonals,
    )
    m._set_data(data, rows)
    return m


# The name pickles written before restore_moments was public refer to.
_restore_moments = restore_moments


def checked_moments(moments: Any) -> Moments:
    """``moments`` if it is a :class:`Moments` holding rows; else raises."""
    if not isinstance(moments, _core.Moments):
        raise TypeError(f"moments must be a toast.Moments, got {type(moments).__name__}")
    if moments.rows == 0:
        raise ValueError("the moments hold no rows: call update() first")
    return moments


def check_state_index(moments: Any, name: str, value: Any) -> int:
    """``value`` as a state index of ``moments`` (an int in [0, S - 1])."""
    return check(name, value, Interval(int, 0, moments.num_states - 1))
