"""LinearPatch's one pass: for every block state, each calibration
sample's mean magnitude of the rotated channels (``mean_t |x_t H|``, the
scale's numerator and denominator), and for every pair of states at most
``max_blocks`` apart the mean cosine similarity of their tokens (the
window selection). Both from the same forward of each batch, float64, pad
tokens left out."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from toast.core.hadamard import hadamard
from toast.core.patch import linear_patch, patch_scales
from toast.hf.capture.distributed import Ranks, all_gather_rows, all_reduce_sums, ranks_of
from toast.hf.capture.states import stream_states
from toast.hf.data.calibration import Calibration
from toast.hf.model.blocks import BlockStack

__all__ = ["PatchStatistics", "measure_patch_statistics"]


@dataclass
class PatchStatistics:
    """``magnitudes[s, k, c]``: sample ``s``'s mean ``|x H|`` of channel ``c``
    at state ``k`` (state ``k`` = the input of block ``k``; the last, the
    output of the last block before the final norm); ``similarity[i, j]``:
    the mean cosine of the tokens of states ``i`` and ``j`` (NaN beyond
    ``max_blocks`` apart and on or below the diagonal); ``rows``: tokens."""

    magnitudes: np.ndarray = field(repr=False)
    similarity: np.ndarray = field(repr=False)
    rows: int
    rotate: bool = True

    @property
    def num_blocks(self) -> int:
        return self.similarity.shape[0] - 1

    def scales(self, start: int, stop: int) -> np.ndarray:
        """``d`` of the window ``blocks[start:stop]``."""
        return patch_scales(self.magnitudes[:, start], self.magnitudes[:, stop])

    def patch(self, start: int, stop: int) -> np.ndarray:
        """The window's map ``H diag(d) Hᵀ`` (``diag(d)`` without rotation)."""
        d = self.scales(start, stop)
        return linear_patch(d) if self.rotate else np.diag(d)

    def windows(self, n: int) -> list[tuple[int, int]]:
        """Windows of ``n`` blocks the paper's selection ranges over (start
        ≥ 1, stop < the last state), most similar first."""
        found = [
            (s, s + n)
            for s in range(1, self.num_blocks - n)
            if np.isfinite(self.similarity[s, s + n])
        ]
        return sorted(found, key=lambda w: (-self.similarity[w], w))


class _Accumulator:
    """Sums one batch at a time (``consume`` of :func:`stream_states`)."""

    def __init__(self, states: int, max_blocks: int, rotate: bool) -> None:
        self.rotate = rotate
        self.rotation: torch.Tensor | None = None  # the width is known at the first batch
        self.magnitudes: list[np.ndarray] = []
        self.cosines = np.zeros((states, states))
        self.max_blocks = max_blocks
        self.rows = 0

    def __call__(self, states: list[torch.Tensor], mask: torch.Tensor | None) -> int:
        first = states[0]
        if self.rotation is None:
            width = first.shape[-1]
            basis = hadamard(width) if self.rotate else np.eye(width)
            self.rotation = torch.from_numpy(np.array(basis))  # a writable copy
        valid = (
            torch.ones(first.shape[:2], dtype=torch.float64)
            if mask is None
            else mask.to(torch.float64).cpu()
        )
        counts = valid.sum(dim=1)
        keep = counts > 0
        per_state = []
        # every state's unit rows, masked rows zeroed, one state after another: the
        # kept tokens' cosines of every two states summed are then one product
        # (a pair at a time read the states S x max_blocks times, 3x slower here)
        units = torch.empty(len(states), valid.numel(), first.shape[-1], dtype=torch.float64)
        for k, x in enumerate(states):
            x = x.to(device="cpu", dtype=torch.float64)
            rotated = (x @ self.rotation).abs()
            per_state.append((rotated * valid[..., None]).sum(dim=1)[keep] / counts[keep, None])
            units[k] = torch.nn.functional.normalize(x, dim=-1).reshape(-1, x.shape[-1])
        self.magnitudes.append(torch.stack(per_state, dim=1).numpy())
        if mask is not None:
            units[:, valid.reshape(-1) == 0] = 0.0
        flat = units.reshape(len(states), -1)
        # the pairs up to max_blocks apart, i < j (the band the windows read)
        self.cosines += np.triu(np.tril((flat @ flat.T).numpy(), self.max_blocks), 1)
        self.rows += int(valid.sum())
        return self.rows

    def reduce_over(self, ranks: Ranks) -> None:
        """The sums over the ranks of a sharded pass (collective): the cosine
        sums and token count reduced, the per-sample magnitudes gathered (in
        rank order; the scales average them, so only rounding differs from
        one process's order)."""
        mine = np.concatenate(self.magnitudes) if self.magnitudes else None
        has, dim = all_reduce_sums([0.0, 0.0] if mine is None else [1.0, mine.shape[-1]], ranks)
        if has == 0:
            return
        if mine is None:  # a rank given no batch: no sample, of the others' width
            mine = np.zeros((0, self.cosines.shape[0], round(dim / has)))
        self.magnitudes = [all_gather_rows(mine, ranks)]
        total = all_reduce_sums(np.append(self.cosines.ravel(), self.rows), ranks)
        self.cosines[...] = total[:-1].reshape(self.cosines.shape)
        self.rows = int(total[-1])


def measure_patch_statistics(
    model: nn.Module,
    data: Iterable,
    stack: BlockStack,
    calibration: Calibration,
    max_blocks: int,
    rotate: bool = True,
) -> PatchStatistics:
    """One pass over ``data`` (bounded by ``calibration``): every state's
    per-sample rotated magnitudes and the similarity of every pair of
    states up to ``max_blocks`` apart."""
    states = stack.num_blocks + 1
    acc = _Accumulator(states, max_blocks, rotate)
    stream_states(
        model, data, acc, calibration, stack=stack, tokens="all", desc="LinearPatch statistics",
        shard=True,
    )  # fmt: skip
    ranks = ranks_of(calibration)
    if ranks is not None:  # each rank saw its share of the batches: every rank's sums
        acc.reduce_over(ranks)
    if not acc.rows:
        raise ValueError("the calibration data gave no token (every sample was padding?)")
    similarity = np.full((states, states), np.nan)
    near = np.triu(np.ones((states, states), dtype=bool), 1) & ~np.triu(
        np.ones((states, states), dtype=bool), max_blocks + 1
    )
    similarity[near] = acc.cosines[near] / acc.rows
    return PatchStatistics(np.concatenate(acc.magnitudes), similarity, acc.rows, rotate)
