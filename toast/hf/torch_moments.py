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

from toast._validation import Options, check
from toast.core.errors import non_finite_error
from toast.core.moments import PRECISIONS, ROW_STATS, Moments, Pairs, storage_layout

__all__ = ["TorchMoments"]


class TorchMoments:
    """Streaming moments of ``num_states`` states, summed on a torch device.

    Same parameters and row-to-fold rule as :class:`toast.Moments` (row r
    of the accepted rows goes to fold ``r % folds``). ``precision="mixed"``
    multiplies in float32 and sums in float64, like the core.

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
    ) -> None:
        # The core validates the shape and says where everything goes.
        layout = storage_layout(num_states, dim, folds, pairs)
        check("precision", precision, Options(PRECISIONS))
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

    def update(self, states: list[torch.Tensor], mask: torch.Tensor | None = None) -> None:
        """Adds one batch: ``num_states`` tensors of shape ``(rows, dim)`` or
        ``(batch, tokens, dim)``; ``mask`` (leading shape) drops rows."""
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
            fold = (self.rows + torch.arange(n, device=self.device)) % self.folds
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
        self._add_row_stats(z.to(torch.float64), row)
        flat = z.reshape(n, S * d)
        for i in range(S):
            width = self._panel_blocks[i] * d
            panel = flat[:, i * d : i * d + d].T @ flat[:, i * d : i * d + width]
            start = self._panel_off[i]
            row[start : start + d * width] += panel.to(torch.float64).reshape(-1)

    def _add_row_stats(self, z: torch.Tensor, row: torch.Tensor) -> None:
        dots = torch.einsum("nsd,ntd->nst", z, z)
        norms = torch.diagonal(dots, dim1=1, dim2=2)
        ni, nj = norms[:, :, None], norms[:, None, :]
        both_zero = (ni <= 0) & (nj <= 0)
        one_zero = (ni <= 0) | (nj <= 0)
        cos = (dots / (ni.clamp_min(0).sqrt() * nj.clamp_min(0).sqrt())).clamp(-1.0, 1.0)
        cos = torch.where(one_zero, 0.0, cos)
        cos = torch.where(both_zero, 1.0, cos)
        sq = (ni + nj - 2.0 * dots).clamp_min(0.0)
        by_name = {"cos": cos, "angle": torch.acos(cos) / math.pi, "dist": sq.sqrt(), "sqdist": sq}
        stats = torch.stack([by_name[name] for name in ROW_STATS])  # (RS_COUNT, n, S, S)
        stats = stats * self._upper  # only i < j is stored
        row[self._off_rowstats : self._off_blocks] += stats.sum(dim=1).reshape(-1)

    def to_moments(self) -> Moments:
        """A :class:`toast.Moments` holding the same sums (one device→host copy)."""
        moments = Moments(
            self.num_states, self.dim, folds=self.folds, pairs=self.pairs, precision=self.precision
        )
        moments._set_data(self.data.reshape(-1).cpu().numpy(), self.rows)
        return moments
