"""LinearPatch's one pass: for every block state, each calibration
sample's mean magnitude of the rotated channels (``mean_t |x_t H|``, the
scale's numerator and denominator), and for every pair of states at most
``max_blocks`` apart the mean cosine similarity of their tokens (the
window selection). Both from the same forward of each batch, float64, pad
tokens left out.

From a checkpoint on disk (:func:`measure_patch_statistics_from_disk`) the
blocks run one at a time over every batch, so a state arrives for every
batch before the next state: its magnitudes are formed as it arrives, and
its cosines with the ``max_blocks`` states before it read those states
back, batch by batch, from files that hold the last ``max_blocks`` states
in the blocks' dtype (the unit rows recomputed from them in float64, as
in memory). Not the shared pass's ``cosine`` table: that is the same
quantity, but it comes with the moments of every pair (``d²`` per pair,
for a number the pass here gets from dot products) and accumulates in
another order and precision, so the window could differ from the one
chosen in memory where two are nearly tied."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from toast.core.hadamard import hadamard
from toast.core.patch import linear_patch, patch_scales
from toast.hf.capture.distributed import Ranks, all_gather_rows, all_reduce_sums, ranks_of
from toast.hf.capture.sequential import DiskModel, DiskStates, stream_blocks
from toast.hf.capture.states import stream_states
from toast.hf.data.calibration import Calibration
from toast.hf.model.blocks import BlockStack

__all__ = ["PatchStatistics", "measure_patch_statistics", "measure_patch_statistics_from_disk"]


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


def _rotation(width: int, rotate: bool) -> torch.Tensor:
    """The basis the magnitudes are measured in: ``H``, or the identity."""
    basis = hadamard(width) if rotate else np.eye(width)
    return torch.from_numpy(np.array(basis))  # a writable copy


def _valid(first: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The batch's ``(batch, tokens)`` weights of its tokens: 1 kept, 0 pad."""
    if mask is None:
        return torch.ones(first.shape[:2], dtype=torch.float64)
    return mask.to(torch.float64).cpu()


def _magnitudes(x: torch.Tensor, rotation: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each sample's mean ``|x H|`` over its kept tokens (samples with none
    left out), of one float64 state: the one formula of both passes, so
    that the disk's are the in-memory ones exactly."""
    counts = valid.sum(dim=1)
    keep = counts > 0
    rotated = (x @ rotation).abs()
    return (rotated * valid[..., None]).sum(dim=1)[keep] / counts[keep, None]


def _unit_rows(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """A float64 state's tokens scaled to unit length, pad tokens zeroed,
    flattened (a dot product of two is the sum of the kept tokens' cosines)."""
    units = torch.nn.functional.normalize(x, dim=-1).reshape(-1, x.shape[-1])
    units[valid.reshape(-1) == 0] = 0.0
    return units.reshape(-1)


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
            self.rotation = _rotation(first.shape[-1], self.rotate)
        valid = _valid(first, mask)
        per_state = []
        # every state's unit rows, masked rows zeroed, one state after another: the
        # kept tokens' cosines of every two states summed are then one product
        # (a pair at a time read the states S x max_blocks times, 3x slower here)
        units = torch.empty(len(states), valid.numel(), first.shape[-1], dtype=torch.float64)
        for k, x in enumerate(states):
            x = x.to(device="cpu", dtype=torch.float64)
            per_state.append(_magnitudes(x, self.rotation, valid))
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
    return _statistics(acc.magnitudes, acc.cosines, acc.rows, max_blocks, rotate)


def _statistics(
    magnitudes: list[np.ndarray], cosines: np.ndarray, rows: int, max_blocks: int, rotate: bool
) -> PatchStatistics:
    """The statistics from a pass's sums: the per-sample magnitudes joined,
    the cosine sums up to ``max_blocks`` apart averaged over the tokens."""
    if not rows:
        raise ValueError("the calibration data gave no token (every sample was padding?)")
    states = cosines.shape[0]
    similarity = np.full((states, states), np.nan)
    near = np.triu(np.ones((states, states), dtype=bool), 1) & ~np.triu(
        np.ones((states, states), dtype=bool), max_blocks + 1
    )
    similarity[near] = cosines[near] / rows
    return PatchStatistics(np.concatenate(magnitudes), similarity, rows, rotate)


class _DiskAccumulator:
    """The same sums from a sweep over a checkpoint's blocks
    (``on_state`` of :func:`stream_blocks`: every batch of state 0, then
    of state 1, ...): each state's magnitudes as it arrives, and its
    cosines with the ``max_blocks`` states before it, read back from the
    files that keep them (a state's file is closed, which frees it, once
    no later state pairs with it)."""

    def __init__(
        self, states: int, max_blocks: int, rotate: bool, buffer_dir: str | os.PathLike | None
    ) -> None:
        self.states, self.max_blocks, self.rotate = states, max_blocks, rotate
        self.buffer_dir = buffer_dir
        self.rotation: torch.Tensor | None = None
        self.valid: list[torch.Tensor] = []  # each batch's token weights, from state 0
        self.magnitudes: list[np.ndarray] = []  # each batch's (samples, states, width)
        self.cosines = np.zeros((states, states))
        self.stores: dict[int, DiskStates] = {}
        self.rows = 0

    def __call__(
        self, state: int, batch: int, hidden: torch.Tensor, mask: torch.Tensor | None
    ) -> None:
        x = hidden.to(device="cpu", dtype=torch.float64)
        if self.rotation is None:
            self.rotation = _rotation(x.shape[-1], self.rotate)
        if state == 0:
            valid = _valid(x, mask)
            self.valid.append(valid)
            kept = int((valid.sum(dim=1) > 0).sum())
            self.magnitudes.append(np.empty((kept, self.states, x.shape[-1])))
            self.rows += int(valid.sum())
        valid = self.valid[batch]
        self.magnitudes[batch][:, state] = _magnitudes(x, self.rotation, valid).numpy()
        if batch == 0 and state - self.max_blocks - 1 in self.stores:  # paired with no later one
            self.stores.pop(state - self.max_blocks - 1).close()
        units = _unit_rows(x, valid)
        for before in range(max(state - self.max_blocks, 0), state):
            earlier = self.stores[before].read(batch).to(dtype=torch.float64)
            self.cosines[before, state] += float(_unit_rows(earlier, valid) @ units)
        if state < self.states - 1:
            if batch == 0:
                self.stores[state] = DiskStates(self.buffer_dir, hidden.dtype)
            self.stores[state].append(hidden)

    def close(self) -> None:
        for store in self.stores.values():
            store.close()
        self.stores.clear()


def measure_patch_statistics_from_disk(
    disk: DiskModel,
    data: Iterable,
    calibration: Calibration,
    max_blocks: int,
    rotate: bool = True,
    buffer_dir: str | os.PathLike | None = None,
) -> PatchStatistics:
    """:func:`measure_patch_statistics` on the checkpoint ``disk``, block by
    block, never loaded (see the module docstring): the same magnitudes
    (the same float64 formula on the same states), the cosines to the
    rounding of their sums. Besides the sweep's own two, the states of
    the last ``max_blocks`` blocks wait in files with no name in
    ``buffer_dir`` (default the system's temporary directory), freed on
    every exit."""
    acc = _DiskAccumulator(disk.num_blocks + 1, max_blocks, rotate, buffer_dir)
    try:
        stream_blocks(
            disk, data, acc, calibration, buffer_dir=buffer_dir, desc="LinearPatch statistics"
        )
    finally:
        acc.close()
    return _statistics(acc.magnitudes, acc.cosines, acc.rows, max_blocks, rotate)
