"""Moments accumulated with torch on the activations' own device.

When a model runs on a GPU, copying every batch of activations to the host
would dominate calibration. :class:`TorchMoments` keeps the same sums as
:class:`toast.Moments` (row count, column sums, per-row pair statistics and
the cross blocks ``X_iᵀ X_j``) as one float64 tensor on the device, laid out
exactly as the C core lays out its storage (read from the core through
:func:`toast.core.moments.storage_layout`, never restated here), so
that :meth:`TorchMoments.to_moments` hands the d×d results to the C solvers
with a single copy. On the CPU it is the reference the C path is tested
against (``capture_moments(..., backend="torch")``).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from toast._validation import Interval, Options, check
from toast.core.errors import non_finite_error
from toast.core.moments import PRECISIONS, ROW_STATS, Moments, Pairs, storage_layout

__all__ = ["TorchMoments"]


class TorchMoments:
    """Streaming moments of ``num_states`` states, summed on a torch device.

    Same parameters and row-to-fold rule as :class:`toast.Moments` (row r
    of the accepted rows goes to fold ``r % folds``). ``precision="mixed"``
    multiplies in float32 and sums in float64, like the core; ``row_stats``
    and ``sources`` skip what is not asked for, as there.

    Not thread-safe: one update at a time.
    """

    def __init__(
        self,
        num_states: int,
        dim: int,
        folds: int = 0,
        pairs: Pairs = "all",
        precision: Literal["float64", "mixed"] = "float64",
        device: torch.device | str = "cpu",
        row_stats: bool = True,
        sources: int | None = None,
    ) -> None:
        # The core validates the shape and says where everything goes.
        layout = storage_layout(num_states, dim, folds, pairs)
        check("precision", precision, Options(PRECISIONS))
        check("row_stats", row_stats, bool)
        if sources is not None:
            check("sources", sources, Interval(int, 1, layout["num_states"]))
        self.row_stats, self.sources = row_stats, sources or layout["num_states"]
        self.num_states, self.dim, self.folds = layout["num_states"], layout["dim"], layout["folds"]
        self.pairs, self.precision = pairs, precision
        self.span = layout["span"]
        self.device = torch.device(device)
        S = self.num_states
        self._panel_blocks = list(layout["panel_blocks"])
        self._panel_off = list(layout["panel_offsets"])
        self._off_count = layout["off_count"]
        self._off_sums = layout["off_sums"]
        self._off_rowstats = layout["off_rowstats"]
        self._off_blocks = layout["off_blocks"]
        self.data = torch.zeros(
            layout["nsets"], layout["set_len"], dtype=torch.float64, device=self.device
        )
        self.rows = 0
        upper = torch.triu(torch.ones(S, S, dtype=torch.bool, device=self.device), diagonal=1)
        self._upper = upper

    @property
    def nbytes(self) -> int:
        return self.data.numel() * 8

    def update(
        self,
        states: list[torch.Tensor],
        mask: torch.Tensor | None = None,
        first_row: int | None = None,
    ) -> None:
        """Adds one batch: ``num_states`` tensors of shape ``(rows, dim)`` or
        ``(batch, tokens, dim)``; ``mask`` (leading shape) drops rows.
        ``first_row``: the number of the batch's first accepted row in the
        folds' dealing (default: the rows added so far; a sharded pass gives
        one process's number, see :class:`toast.hf.capture.row_numbers.RowNumbers`)."""
        if len(states) != self.num_states:
            raise ValueError(f"expected {self.num_states} states, got {len(states)}")
        lead = tuple(states[0].shape[:-1])
        for k, s in enumerate(states):
            if tuple(s.shape) != (*lead, self.dim):
                raise ValueError(
                    f"states[{k}] has shape {tuple(s.shape)}; expected {(*lead, self.dim)}"
                )
        work = torch.float32 if self.precision == "mixed" else torch.float64
        # (rows, S, d): one row holds every state, as the core packs it.
        z = torch.stack([s.reshape(-1, self.dim) for s in states], dim=1).to(
            device=self.device, dtype=work
        )
        if mask is not None:
            z = z[mask.reshape(-1).to(self.device, torch.bool)]
        if not bool(torch.isfinite(z).all()):
            bad = int((~torch.isfinite(z)).flatten(2).any(dim=2).any(dim=0).nonzero()[0])
            raise non_finite_error(f"states[{bad}] contains NaN or Inf", bad)
        n = z.shape[0]
        if n == 0:
            return
        if self.folds:
            start = self.rows if first_row is None else first_row
            fold = (start + torch.arange(n, device=self.device)) % self.folds
            for f in range(self.folds):
                self._add(z[fold == f], f)
        else:
            self._add(z, 0)
        self.rows += n

    def _add(self, z: torch.Tensor, f: int) -> None:
        n = z.shape[0]
        if n == 0:
            return
        S, d = self.num_states, self.dim
        row = self.data[f]
        row[self._off_count] += n
        row[self._off_sums : self._off_rowstats] += z.sum(dim=0, dtype=torch.float64).reshape(-1)
        if self.row_stats:
            self._add_row_stats(z.to(torch.float64), row)
        flat = z.reshape(n, S * d)
        for i in range(self.sources):
            width = self._panel_blocks[i] * d
            panel = flat[:, i * d : i * d + d].T @ flat[:, i * d : i * d + width]
            panel[:, :d] = panel[:, :d].triu()  # as the core: X_iᵀX_i's upper triangle
            start = self._panel_off[i]
            row[start : start + d * width] += panel.to(torch.float64).reshape(-1)

    def _add_row_stats(self, z: torch.Tensor, row: torch.Tensor) -> None:
        dots = torch.einsum("nsd,ntd->nst", z, z)
        norms = torch.diagonal(dots, dim1=1, dim2=2)
        stats = torch.stack(_row_stats(dots, norms[:, :, None], norms[:, None, :]))  # (RS, n, S, S)
        stats = stats * self._upper  # only i < j is stored
        row[self._off_rowstats : self._off_blocks] += stats.sum(dim=1).reshape(-1)

    def to_moments(self) -> Moments:
        """A :class:`toast.Moments` holding the same sums (one device→host copy)."""
        moments = Moments(
            self.num_states,
            self.dim,
            folds=self.folds,
            pairs=self.pairs,
            precision=self.precision,
            row_stats=self.row_stats,
            sources=self.sources,
        )
        moments._set_data(self.data.reshape(-1).cpu().numpy(), self.rows)
        return moments


class WindowedMoments(TorchMoments):
    """:class:`TorchMoments` with pairs ``j - i <= span`` filled one state at
    a time, for passes that see state 0 of every batch, then state 1 of
    every batch, and so on (block by block from disk): only the ``span``
    previous states are needed alongside the new one.

    :meth:`add_state` adds state ``j``'s sums and its cross blocks and row
    statistics with states ``j - span .. j``. Every sum is the one
    :meth:`TorchMoments.update` forms from whole batches (rows go to folds by
    the same ``r % folds`` rule, counted per state). The row statistics of
    pairs further apart than ``span`` would need both states at once: they
    are NaN, so every metric reads NaN there, as the linear metrics already
    do for the cross blocks the moments do not keep.
    """

    def __init__(
        self,
        num_states: int,
        dim: int,
        folds: int = 0,
        pairs: Pairs = "consecutive",
        precision: Literal["float64", "mixed"] = "float64",
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(num_states, dim, folds, pairs, precision, device)
        self._state_rows = [0] * self.num_states

    def add_state(
        self, index: int, window: list[torch.Tensor], mask: torch.Tensor | None = None
    ) -> None:
        """Adds one batch of state ``index``: ``window`` holds that batch of
        states ``index - len(window) + 1 .. index`` (at most ``span + 1``,
        all of them that exist), each ``(rows, dim)`` or ``(batch, tokens,
        dim)``; ``mask`` (leading shape) drops rows, as for every state."""
        first = max(index - self.span, 0)
        if len(window) != index - first + 1:
            raise ValueError(
                f"state {index} pairs with states {first}..{index}: expected "
                f"{index - first + 1} tensors, got {len(window)}"
            )
        work = torch.float32 if self.precision == "mixed" else torch.float64
        z = [s.reshape(-1, self.dim).to(device=self.device, dtype=work) for s in window]
        if mask is not None:
            keep = mask.reshape(-1).to(self.device, torch.bool)
            z = [s[keep] for s in z]
        if not bool(torch.isfinite(z[-1]).all()):
            raise non_finite_error(f"states[{index}] contains NaN or Inf", index)
        n = z[-1].shape[0]
        if n == 0:
            return
        start = self._state_rows[index]
        if self.folds:
            fold = (start + torch.arange(n, device=self.device)) % self.folds
            for f in range(self.folds):
                self._add_state(index, first, [s[fold == f] for s in z], f)
        else:
            self._add_state(index, first, z, 0)
        self._state_rows[index] += n
        if index == 0:
            self.rows += n

    def _add_state(self, j: int, first: int, z: list[torch.Tensor], f: int) -> None:
        new = z[-1]
        n = new.shape[0]
        if n == 0:
            return
        d, S = self.dim, self.num_states
        row = self.data[f]
        if j == 0:
            row[self._off_count] += n
        row[self._off_sums + j * d : self._off_sums + (j + 1) * d] += new.sum(
            dim=0, dtype=torch.float64
        )
        new64 = new.to(torch.float64)
        for i, old in zip(range(first, j + 1), z, strict=True):
            width = self._panel_blocks[i] * d
            panel = row[self._panel_off[i] : self._panel_off[i] + d * width].view(d, width)
            block = (old.T @ new).to(torch.float64)
            panel[:, (j - i) * d : (j - i + 1) * d] += block if i < j else block.triu()
            if i < j:
                stats = _pair_row_stats(old.to(torch.float64), new64)
                for k, value in enumerate(stats):
                    row[self._off_rowstats + (k * S + i) * S + j] += value

    def to_moments(self) -> Moments:
        """A :class:`toast.Moments` with the kept sums; the row statistics of
        pairs beyond the span NaN (see the class docstring)."""
        if self._state_rows != [self.rows] * self.num_states:
            raise ValueError(f"every state needs the same rows: states saw {self._state_rows} rows")
        S = self.num_states
        far = torch.triu(torch.ones(S, S, dtype=torch.bool, device=self.device), self.span + 1)
        with torch.inference_mode():  # the pass may have made data an inference tensor
            stats = self.data[:, self._off_rowstats : self._off_blocks]
            stats.view(-1, len(ROW_STATS), S, S)[:, :, far] = math.nan
        return super().to_moments()


def _row_stats(dots: torch.Tensor, ni: torch.Tensor, nj: torch.Tensor) -> list[torch.Tensor]:
    """The per-row pair statistics in :data:`ROW_STATS` order from the rows'
    dot products and squared norms (broadcast together), by the core's
    rules: a zero row has cosine 0 with any other, 1 with another zero row."""
    cos = (dots / (ni.clamp_min(0).sqrt() * nj.clamp_min(0).sqrt())).clamp(-1.0, 1.0)
    cos = torch.where((ni <= 0) | (nj <= 0), 0.0, cos)
    cos = torch.where((ni <= 0) & (nj <= 0), 1.0, cos)
    sq = (ni + nj - 2.0 * dots).clamp_min(0.0)
    by_name = {"cos": cos, "angle": torch.acos(cos) / math.pi, "dist": sq.sqrt(), "sqdist": sq}
    return [by_name[name] for name in ROW_STATS]


def _pair_row_stats(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Sums over rows of the row statistics of the pair of row sets ``x``, ``y``."""
    stats = _row_stats((x * y).sum(dim=1), (x * x).sum(dim=1), (y * y).sum(dim=1))
    return [s.sum() for s in stats]
