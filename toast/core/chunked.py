"""Moments within a memory bound: :class:`ChunkedMoments` keeps every
state's rows on disk and forms the error matrix a chunk of source states
at a time.

The cross blocks of ``S`` states of width ``d`` with span ``m`` need about
``S (m + 1) d²`` doubles per fold set; above a byte bound the rows of every
state wait instead in a buffer on disk (float32, one file per state, each
unlinked at creation, so nothing is left behind whatever ends the process)
and the error matrix is formed for ``c`` consecutive source states at once:
those sources and the ``m`` states after them are replayed, in the order
they came, into one smaller :class:`~toast.core.moments.Moments` that forms
the sources' panels and the targets' diagonal blocks only (``sources=c,
diagonals=True``), then freed. A replay adds the same rows in the same
order (fold ``r % K`` of accepted row ``r``), so each chunk's blocks are the
whole moments' blocks to rounding and the errors equal theirs (bit for bit
where measured). Fits read the moments of their two states only
(:meth:`ChunkedMoments.pair`).
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal

import numpy as np

from toast._validation import Interval, check
from toast.core.errors import non_finite_error
from toast.core.metrics import error_matrix
from toast.core.moments import Moments, Pairs, pair_span, storage_layout

__all__ = [
    "AUTO_BYTES",
    "JOIN_BYTES",
    "ChunkedMoments",
    "PairMoments",
    "chunk_plan",
    "chunk_sources",
    "chunk_targets",
    "formed_nbytes",
    "pair_moments_nbytes",
    "pair_nbytes",
    "resolve_bound",
    "workspace_nbytes",
]

#: Rows replayed per update at most, in bytes of float32 rows of the chunk's
#: states: small updates are bound by memory traffic, not arithmetic.
JOIN_BYTES = 256 << 20

#: ``d × d`` float64 matrices the core's error matrix works in beside the
#: moments (metrics.c: the Gram, its copy, the right-hand side, the fit,
#: its product and scratch; solve.c: the factor and the eigensolver's 2).
WORKSPACE_MATRICES = 9


def workspace_nbytes(dim: int) -> int:
    """Bytes of the core's error-matrix workspace for width ``dim``."""
    return WORKSPACE_MATRICES * dim * dim * 8


def formed_nbytes(states: int, sources: int, span: int, dim: int, folds: int) -> int:
    """Bytes a replay's moments touch: the ``sources`` states' panels (span
    ``span``) and the other states' diagonal blocks in every fold set, with
    the counts, sums and row statistics (the blocks never formed are never
    written, so they take no memory)."""
    lay = storage_layout(states, dim, folds, max(span, 1))  # validated
    blocks = sum(min(span, states - 1 - i) + 1 for i in range(sources)) + states - sources
    return 8 * lay["nsets"] * (lay["off_blocks"] + blocks * dim * dim)


def pair_nbytes(dim: int, folds: int) -> int:
    """The least bound any error matrix needs: one source and one target
    state (``folds`` sets) and the workspace."""
    return formed_nbytes(2, 1, 1, dim, folds) + workspace_nbytes(dim)


#: The default bound on the moments held in memory (``"auto"``): 1 GiB, or
#: the least the held-out errors of one pair need when wider (:func:`auto_bound`).
AUTO_BYTES = 1 << 30


def resolve_bound(bound: int | str, dim: int, folds: int) -> int:
    """``bound`` in bytes: an int as given; ``"auto"`` is :data:`AUTO_BYTES`,
    or :func:`pair_nbytes` of the folds when that is more (width 4,096 with
    5 folds: 3.2 GiB), so the default never refuses."""
    if bound == "auto":
        return max(AUTO_BYTES, pair_nbytes(dim, folds))
    return check("statistics_bytes", bound, Interval(int, 1, None))


def chunk_sources(num_states: int, dim: int, folds: int, span: int, bound: int) -> int:
    """The most consecutive source states whose chunk (the sources and the
    ``span`` states after them, :func:`formed_nbytes`) fits ``bound``
    bytes with the workspace; 0 when one source with every target does not."""
    room = bound - workspace_nbytes(dim)
    best = 0
    for c in range(1, num_states):
        states = min(c + span, num_states)
        if formed_nbytes(states, min(c, states - 1), span, dim, folds) > room:
            break
        best = c
    return best


def chunk_targets(dim: int, folds: int, span: int, bound: int) -> int:
    """The most targets (at most ``span``) one source is replayed with
    within ``bound`` bytes; 0 when not even one fits."""
    room = bound - workspace_nbytes(dim)
    best = 0
    for g in range(1, span + 1):
        if formed_nbytes(g + 1, 1, g, dim, folds) > room:
            break
        best = g
    return best


def chunk_plan(
    num_states: int, dim: int, folds: int, span: int, bound: int
) -> list[tuple[list[int], int]]:
    """The replays that form every error within ``bound`` bytes, as
    ``(states, sources)``: ``c`` consecutive sources with the ``span``
    states after them (:func:`chunk_sources`) or, when one source with all
    its targets does not fit, one source with a group of its targets
    (:func:`chunk_targets`). Raises when one source and one target do not
    fit, naming the least bound."""
    c = chunk_sources(num_states, dim, folds, span, bound)
    if c:
        plan = []
        for a in range(0, num_states - 1, c):
            states = list(range(a, min(a + c + span, num_states)))
            plan.append((states, min(c, len(states) - 1)))
        return plan
    g = chunk_targets(dim, folds, span, bound)
    if not g:
        least = pair_nbytes(dim, folds)
        raise ValueError(
            f"statistics_bytes={bound:,} cannot hold the moments of one source and one "
            f"target state of width {dim} ({folds} folds) with the error workspace: give "
            f"statistics_bytes >= {least:,} ({least / 2**30:.2f} GiB)"
            + (
                f", or estimator='gcv' (no folds: >= {pair_nbytes(dim, 0):,} bytes)"
                if folds
                else ""
            )
        )
    plan = []
    for i in range(num_states - 1):
        targets = list(range(i + 1, min(i + span, num_states - 1) + 1))
        groups = -(-len(targets) // g)  # as even as the groups can be
        size = -(-len(targets) // groups)
        plan += [([i, *targets[t : t + size]], 1) for t in range(0, len(targets), size)]
    return plan


class _StateFile:
    """One state's float32 rows in an unlinked temporary file."""

    def __init__(self, dim: int, directory: str | os.PathLike | None) -> None:
        self.dim = dim
        self.file = tempfile.TemporaryFile(dir=_folder(directory), buffering=0)  # unlinked
        self.rows = 0

    def append(self, rows: np.ndarray) -> None:
        data = np.ascontiguousarray(rows, dtype=np.float32)
        view = memoryview(data.tobytes())
        while view:
            view = view[self.file.write(view) :]
        self.rows += data.shape[0]

    def read(self, start: int, stop: int) -> np.ndarray:
        width = 4 * self.dim
        want = (stop - start) * width
        data = os.pread(self.file.fileno(), want, start * width)
        if len(data) != want:
            raise OSError(f"the row buffer returned {len(data)} of {want} bytes")
        return np.frombuffer(data, dtype=np.float32).reshape(stop - start, self.dim)

    def close(self) -> None:
        self.file.close()


class ChunkedMoments:
    """The rows of ``num_states`` states on disk, read back a chunk of
    states at a time into :class:`Moments` (see the module docstring).

    Updates take what :meth:`Moments.update` takes (states of shape
    ``(rows, dim)`` or ``(batch, tokens, dim)``, a boolean ``mask``), keep
    only the masked rows and never explicit fold ids (the replay deals rows
    to folds as the whole moments would). ``bound`` is the bytes one chunk's
    moments may hold; ``directory`` where the buffer lives (the system's
    temporary directory by default).
    """

    def __init__(
        self,
        num_states: int,
        dim: int,
        folds: int = 0,
        pairs: Pairs = "all",
        precision: Literal["float64", "mixed"] = "float64",
        bound: int = 1 << 30,
        directory: str | os.PathLike | None = None,
    ) -> None:
        # validates every argument as the whole moments would, without allocating
        Moments.estimate_nbytes(num_states, dim, folds, pairs)
        self.bound = check("bound", bound, Interval(int, 1, None))
        chunk_plan(num_states, dim, 0, pair_span(pairs, num_states), bound)  # refuses too small
        self.num_states, self.dim, self.folds = num_states, dim, folds
        self.pairs: Pairs = pairs
        self.precision: Literal["float64", "mixed"] = precision
        self.span = pair_span(pairs, num_states)
        self._files = [_StateFile(dim, directory) for _ in range(num_states)]

    @property
    def rows(self) -> int:
        return self._files[0].rows

    @property
    def nbytes(self) -> int:
        """Bytes of the row buffer on disk."""
        return 4 * self.rows * self.dim * self.num_states

    def chunk(self, folds: int | None = None) -> list[tuple[list[int], int]]:
        """The replays of :meth:`error_matrices` (:func:`chunk_plan` of the
        bound) with ``folds`` sets (default the buffer's folds)."""
        folds = self.folds if folds is None else folds
        return chunk_plan(self.num_states, self.dim, folds, self.span, self.bound)

    def fits_folds(self) -> bool:
        """Whether the held-out (``cv``) errors fit the bound: one source and
        one target with every fold set (:func:`pair_nbytes`)."""
        return pair_nbytes(self.dim, self.folds) <= self.bound

    def update(self, states: Sequence[Any], mask: Any | None = None) -> ChunkedMoments:
        """Adds one batch of rows (the masked ones) to the buffer."""
        if len(states) != self.num_states:
            raise ValueError(f"expected {self.num_states} states, got {len(states)}")
        # every state checked before anything is written, as the whole moments refuse it
        kept = [self._kept(k, x, mask) for k, x in enumerate(states)]
        for file, x in zip(self._files, kept, strict=True):
            file.append(x)
        return self

    def _kept(self, state: int, rows: Any, mask: Any | None) -> np.ndarray:
        """The rows of ``state`` the mask keeps, refused when NaN or Inf."""
        x = _host(rows).reshape(-1, self.dim)
        if mask is not None:
            x = x[_host(mask).reshape(-1).astype(bool)]
        if not np.isfinite(x).all():
            raise non_finite_error(f"states[{state}] contains NaN or Inf", state)
        return x

    def append_state(self, state: int, rows: Any, mask: Any | None = None) -> ChunkedMoments:
        """Adds one batch of rows (the masked ones) of one ``state`` alone,
        for a pass that yields a state of every batch before the next state
        (block by block from disk): each state's rows are written once,
        straight into its file. Every state must get the same rows in the
        same batch order (:meth:`complete` checks the counts); NaN or Inf
        raises :class:`~toast.core.errors.NonFiniteError` naming ``state``
        before anything of it is written."""
        if not 0 <= state < self.num_states:
            raise ValueError(f"state {state} is not one of the {self.num_states} states")
        self._files[state].append(self._kept(state, rows, mask))
        return self

    def complete(self) -> ChunkedMoments:
        """Checks that every state has as many rows as the first (after
        :meth:`append_state`): a replay pairs row ``r`` of every state."""
        counts = {f.rows for f in self._files}
        if len(counts) > 1:
            raise ValueError(
                f"the states' row buffers hold {sorted(counts)} rows: every state must be "
                "given the same rows"
            )
        return self

    def row_count(self, state: int) -> int:
        """Rows of ``state`` in the buffer so far."""
        return self._files[state].rows

    def row_range(self, state: int, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of ``state`` as they were added (float32)."""
        return self._files[state].read(start, stop)

    def replay(
        self,
        states: Sequence[int],
        sources: int | None = None,
        row_stats: bool = True,
        folds: int | None = None,
    ) -> Moments:
        """:class:`Moments` of ``states`` (consecutive or not) from the buffer:
        the rows in the order they came, joined into updates of up to
        :data:`JOIN_BYTES`; with ``sources`` only those states' panels and the
        other states' diagonal blocks are formed; ``folds=0`` keeps no folds."""
        n = len(states)
        span = min(self.span, n - 1) if states == list(range(states[0], states[-1] + 1)) else n - 1
        moments = Moments(
            n,
            self.dim,
            folds=self.folds if folds is None else folds,
            pairs=max(span, 1),
            precision=self.precision,
            row_stats=row_stats,
            sources=sources,
            diagonals=sources is not None and sources < n,
        )
        for start, stop in self._joined(n):
            moments.update([self._files[s].read(start, stop) for s in states])
        return moments

    def _joined(self, states: int) -> Iterator[tuple[int, int]]:
        step = max(1, JOIN_BYTES // (4 * self.dim * states))
        for start in range(0, self.rows, step):
            yield start, min(start + step, self.rows)

    def pair(self, i: int, j: int) -> Moments:
        """The moments of states ``i`` and ``j`` alone (a fit of ``j`` from
        ``i`` reads them at ``(0, 1)``), no folds: the source's Gram and its
        cross block with the target only (what a closed-form fit reads;
        ``X_jᵀ X_j`` and the row statistics are never formed), two thirds of
        the memory and about half the multiply-adds of both states' moments."""
        moments = Moments(2, self.dim, precision=self.precision, row_stats=False, sources=1)
        for start, stop in self._joined(2):
            moments.update([self._files[s].read(start, stop) for s in (i, j)])
        return moments

    def error_matrices(
        self,
        requests: Sequence[tuple[str, str, float]],
        on_replay: Callable[[int, int], None] | None = None,
    ) -> list[np.ndarray]:
        """``error_matrix(moments, metric, estimator, ridge)`` of the whole
        moments for each request, from one replay of every chunk
        (:meth:`chunk`; fold sets only when a request is held out, row
        statistics only when a row metric asks); NaN for pairs further
        apart than the span. Each warning once. ``on_replay(done, total)``
        is called after each replay (a wide model's take minutes each)."""
        S = self.num_states
        held_out = any(m in ("linear", "affine") and e == "cv" for m, e, _ in requests)
        row_stats = any(m not in ("linear", "affine", "cka") for m, _, _ in requests)
        folds = self.folds if held_out else 0
        tables = [np.full((S, S), np.nan) for _ in requests]
        seen: dict[str, warnings.WarningMessage] = {}
        plan = self.chunk(folds)
        for done, (states, sources) in enumerate(plan, 1):
            chunk = self.replay(states, sources=sources, row_stats=row_stats, folds=folds)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for table, (metric, estimator, ridge) in zip(tables, requests, strict=True):
                    part = error_matrix(chunk, metric, estimator, ridge)  # type: ignore[arg-type]
                    table[np.ix_(states[:sources], states)] = part[:sources]
            for w in caught:
                seen.setdefault(str(w.message), w)
            del chunk
            if on_replay is not None:
                on_replay(done, len(plan))
        for w in seen.values():
            warnings.warn(w.message, stacklevel=2)
        far = np.triu(np.ones((S, S), dtype=bool), self.span + 1)
        for table in tables:
            table[far] = np.nan
        return tables

    def traces(self) -> np.ndarray:
        """``tr(X_jᵀ X_j)`` of every state, as the whole moments' diagonal blocks give it."""
        out = np.zeros(self.num_states)
        for j in range(self.num_states):
            for start, stop in self._joined(1):
                x = self._files[j].read(start, stop).astype(np.float64)
                out[j] += float(np.einsum("ij,ij->", x, x))
        return out

    def close(self) -> None:
        """Frees the buffer (also done when the object is collected)."""
        for file in self._files:
            file.close()

    def __del__(self) -> None:
        for file in getattr(self, "_files", ()):
            file.close()

    def __repr__(self) -> str:
        return (
            f"ChunkedMoments(num_states={self.num_states}, dim={self.dim}, folds={self.folds}, "
            f"pairs={self.pairs!r}, rows={self.rows}, bound={self.bound})"
        )


def pair_moments_nbytes(dim: int) -> int:
    """Bytes one span's kept moments hold (:meth:`ChunkedMoments.pair`:
    the source's Gram and its cross block, with the sums)."""
    return Moments.estimate_nbytes(2, dim, 0, "all") * 2 // 3


class PairMoments:
    """The two-state moments of chosen pairs of states (a fit of ``j`` from
    ``i`` reads :meth:`pair` ``(i, j)`` at ``(0, 1)``), kept after a
    :class:`ChunkedMoments` buffer is gone: what a closed-form fit of those
    spans needs, small and picklable (``3 d²`` doubles a pair)."""

    def __init__(
        self,
        chunked: ChunkedMoments,
        pairs: Iterable[tuple[int, int]],
        traces: np.ndarray | None = None,
    ) -> None:
        self.num_states, self.dim, self.rows = chunked.num_states, chunked.dim, chunked.rows
        self.folds = 0
        self._pairs = {(int(i), int(j)): chunked.pair(i, j) for i, j in sorted(set(pairs))}
        self._traces = traces

    @classmethod
    def from_moments(cls, moments: Moments, pairs: Iterable[tuple[int, int]]) -> PairMoments:
        """The chosen pairs of in-memory ``moments`` in :meth:`ChunkedMoments.pair`'s
        form (each a copy of the source's Gram and its cross block, with the
        sums), with every state's trace: what the closed-form fits of those
        spans read, where the whole moments hold every pair within their
        span. Every pair must be kept by ``moments``."""
        out = cls.__new__(cls)
        out.num_states, out.dim, out.rows = moments.num_states, moments.dim, moments.rows
        out.folds = 0
        chosen = sorted({(int(i), int(j)) for i, j in pairs})
        out._pairs = {(i, j): moments.select([i, j], sources=1) for i, j in chosen}
        diagonal = [float(np.trace(moments.cross(j, j))) for j in range(moments.num_states)]
        out._traces = np.asarray(diagonal)
        return out

    def traces(self) -> np.ndarray:
        """``tr(X_jᵀ X_j)`` of every state, when the buffer's were given
        (what a fit that scores its own residuals reads)."""
        if self._traces is None:
            raise ValueError("these pair moments were kept without the states' traces")
        return self._traces

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self._pairs.values())

    @property
    def spans(self) -> list[tuple[int, int]]:
        """The pairs of states ``(i, j)`` whose moments were kept."""
        return list(self._pairs)

    def pair(self, i: int, j: int) -> Moments:
        """The moments of states ``i`` and ``j`` (kept pairs only)."""
        if (i, j) not in self._pairs:
            raise KeyError(
                f"the moments of states ({i}, {j}) were not kept: the calibration kept "
                f"{sorted(self._pairs)} (the spans its plans use)"
            )
        return self._pairs[(i, j)]

    def __repr__(self) -> str:
        return f"PairMoments(dim={self.dim}, rows={self.rows}, pairs={len(self._pairs)})"


def _folder(directory: str | os.PathLike | None) -> str | None:
    return None if directory is None else os.fspath(directory)


def _host(x: Any) -> np.ndarray:
    """A NumPy view of an array or a CPU torch tensor (bfloat16 as float32)."""
    if type(x).__module__.startswith("torch"):
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.numpy()
    return np.asarray(x)
