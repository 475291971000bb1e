"""A bounded, seeded sample of activation rows in a disk-backed buffer.

Closed-form methods need only moments. Trained translators (and other
methods that cannot work from moments) need the rows themselves; these are
drawn as a uniform sample of at most ``capacity`` token rows by reservoir
sampling (so the sample is uniform over every row the loader produced,
whatever its length) and kept in a memory-mapped file with no name (freed
when the process ends, however it ends) whose size is printed before it is
allocated. RAM use stays bounded by one batch plus the pages
the OS chooses to cache.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from toast._scratch import scratch_file, scratch_place
from toast._validation import Interval, check, format_size
from toast.hf.capture.states import Tokens, stream_states
from toast.hf.data.calibration import Calibration
from toast.hf.model.blocks import BlockStack

__all__ = ["RowSample", "capture_rows"]


class RowSample:
    """Up to ``capacity`` rows of ``num_states`` states, sampled uniformly.

    Row ``r`` of :attr:`rows` holds the ``num_states`` states of one token,
    so ``sample.state(k)[r]`` and ``sample.state(l)[r]`` are a matching pair.
    The buffer is a float32 (or ``dtype``) memory-mapped file with no name in
    ``directory`` (default: the system's temporary directory,
    :func:`toast._scratch.scratch_file`), freed by :meth:`close`, when the
    object is collected, or when the process dies.

    Parameters
    ----------
    num_states, dim:
        States per row and their width.
    capacity:
        The most rows kept. Rows beyond it replace kept ones by reservoir
        sampling (Algorithm R) with a generator seeded by ``seed``.
    verbose:
        Print the buffer's size and place before allocating it.

    Not thread-safe: one :meth:`add` at a time (the sampling generator and
    the buffer are shared state).
    """

    def __init__(
        self,
        num_states: int,
        dim: int,
        capacity: int,
        *,
        dtype: Any = np.float32,
        directory: str | os.PathLike | None = None,
        seed: int = 0,
        verbose: bool = True,
    ) -> None:
        positive = Interval(int, 1, None)
        self.num_states = check("num_states", num_states, positive)
        self.dim = check("dim", dim, positive)
        self.capacity = check("capacity", capacity, positive)
        self.dtype = np.dtype(dtype)
        nbytes = self.capacity * self.num_states * self.dim * self.dtype.itemsize
        if verbose:
            print(
                f"toast: disk-backed row buffer of {format_size(nbytes)} ({self.capacity:,} rows x "
                f"{self.num_states} states x {self.dim} x {self.dtype.name}) in "
                f"{scratch_place(directory)}",
                file=sys.stderr,
            )
        self._file = scratch_file(directory)
        try:
            self._buf = np.memmap(
                self._file,
                dtype=self.dtype,
                mode="w+",
                shape=(self.capacity, self.num_states, self.dim),
            )
        except BaseException:
            self._file.close()
            raise
        self._rng = np.random.default_rng(seed)
        self.seen = 0

    @property
    def rows(self) -> int:
        """Rows held: ``min(seen, capacity)``."""
        return min(self.seen, self.capacity)

    def state(self, k: int) -> np.ndarray:
        """The held rows of state ``k``, shape ``(rows, dim)`` (a view of the file)."""
        if not 0 <= k < self.num_states:
            raise ValueError(f"state {k} is out of range [0, {self.num_states})")
        return self._buf[: self.rows, k]

    def add(self, states: Sequence[torch.Tensor | np.ndarray]) -> None:
        """Offers rows ``(n, dim)`` of every state to the sample."""
        if len(states) != self.num_states:
            raise ValueError(f"expected {self.num_states} states, got {len(states)}")
        x = np.stack([_host(s) for s in states], axis=1)
        if x.ndim != 3 or x.shape[2] != self.dim:
            raise ValueError(f"rows must have shape (n, {self.dim}); got {x.shape[::2]}")
        n = x.shape[0]
        fill = min(max(self.capacity - self.seen, 0), n)
        if fill:
            self._buf[self.seen : self.seen + fill] = x[:fill]
        if n > fill:
            # Algorithm R: row t (0-based, over all rows seen) replaces a
            # uniformly chosen slot j <= t when j < capacity.
            t = self.seen + fill + np.arange(n - fill, dtype=np.int64)
            slot = self._rng.integers(0, t + 1)
            take = np.flatnonzero(slot < self.capacity)
            if take.size:
                # Within one batch a later row overwrites an earlier one in the
                # same slot, as the sequential algorithm would.
                slots = slot[take]
                _, last_rev = np.unique(slots[::-1], return_index=True)
                last = take.size - 1 - last_rev
                self._buf[slots[last]] = x[fill:][take[last]]
        self.seen += n

    def close(self) -> None:
        """Frees the buffer file."""
        buf = getattr(self, "_buf", None)
        if buf is not None:
            mm = getattr(buf, "_mmap", None)
            del self._buf, buf  # the mapping closes once no array refers to it
            if mm is not None:
                mm.close()
        file = getattr(self, "_file", None)
        if file is not None:
            file.close()

    def __enter__(self) -> RowSample:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"RowSample(num_states={self.num_states}, dim={self.dim}, rows={self.rows}, "
            f"seen={self.seen}, capacity={self.capacity})"
        )


def _host(x: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float32).numpy()
    return np.asarray(x, dtype=np.float32).reshape(-1, np.shape(x)[-1])


def capture_rows(
    model: nn.Module,
    loader: Iterable,
    states: Sequence[int],
    *,
    capacity: int = 50_000,
    tokens: Tokens = "all",
    directory: str | os.PathLike | None = None,
    calibration: Calibration | None = None,
    stack: BlockStack | None = None,
    **options: Any,
) -> RowSample:
    """A :class:`RowSample` of the chosen states' rows over ``loader``.

    Same loader, token and calibration options as :func:`toast.hf.capture_moments`;
    padding rows are never sampled. ``capacity`` bounds the rows kept (and
    the buffer: ``capacity x len(states) x dim x 4`` bytes on disk).
    """
    cal = Calibration.from_options(calibration, **options)
    holder: dict[str, RowSample] = {}

    def consume(rows: list[torch.Tensor], mask: torch.Tensor | None) -> int:
        flat = [r.reshape(-1, r.shape[-1]) for r in rows]
        if mask is not None:
            keep = mask.reshape(-1).bool()
            flat = [r[keep] for r in flat]
        if "s" not in holder:
            holder["s"] = RowSample(
                len(flat),
                int(flat[0].shape[-1]),
                capacity,
                directory=directory,
                seed=cal.seed,
                verbose=cal.progress,
            )
        holder["s"].add(flat)
        return holder["s"].seen

    try:
        stream_states(
            model,
            loader,
            consume,
            cal,
            stack=stack,
            states=states,
            tokens=tokens,
            desc="sampling rows",
        )
    except BaseException:
        if "s" in holder:
            holder["s"].close()
        raise
    if "s" not in holder or holder["s"].rows == 0:
        raise ValueError("the loader yielded no rows (empty loader, or every token masked out)")
    return holder["s"]
