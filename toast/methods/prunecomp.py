"""Prune&Comp (Chen et al., "Prune&Comp: Free Lunch for Layer-Pruned LLMs
via Iterative Pruning with Magnitude Compensation", AAAI 2026, arXiv
2507.18212): layer pruning that, after each removal, rescales the hidden
state the next kept block receives to the magnitude it had in the model
before the removal, with the scale folded offline into weights (the model
stays a standard checkpoint of fewer blocks, no module added).

The definition implemented (the paper's, as its official code computes it):

- **Selection** (the paper's main metric, CosSim/Block Influence as in
  ShortGPT): every round, on the model pruned and compensated so far,
  ``BI_b = 1 − mean over tokens of cos(x_b, x_{b+1})``, ``x_b`` the state
  entering block ``b``; the block of lowest BI is removed. Any block is a
  candidate (``min_start=0``, as the code: block 0 included), the lower
  index on ties.
- **Magnitude gap**: on the same model before the removal, for each
  calibration sample and channel ``c`` the ratio of mean ``|x|`` over the
  sample's tokens of the state leaving the block and of the state entering
  it, ``r_{s,c} = mean_t |x_{b+1}| / mean_t |x_b|``; the compensation is
  the scalar ``α = mean_c mean_s r_{s,c}`` (the code averages the
  per-channel ratio over samples, then over channels).
- **Compensation**: after the removal the state entering the next kept
  block becomes ``α x_b`` (what the removed block's output measured in
  magnitude). Folded (``fold="before"``, the paper's): the token
  embedding and the residual writers (attention output and MLP down
  projections, weights and biases) of every kept block before the cut are
  multiplied by ``α``, which scales every residual state up to the cut by
  ``α``; a pre-norm block's output does not change when its input is
  scaled (RMSNorm/LayerNorm are scale-invariant up to their ε).
- **Iterative**: ``num_blocks`` rounds of select → estimate → remove →
  fold, each on the model the previous round left (the paper's
  prune-and-compensate loop).

Assumed here, not in the paper: ``fold="after"`` folds ``1/α`` into the
residual writers of every kept block after the cut instead, which leaves
every state after the cut ``1/α`` times the paper's and, through the final
norm, the same logits (up to the norms' ε): the paper's fold scales the
token embedding, which a model whose LM head shares that matrix (tied
embeddings, e.g. SmolLM2) would see as logits scaled by ``α``;
``fold="auto"`` (default) folds before the cut unless the embeddings are
tied. Pad tokens are left out of every mean (the paper's calibration has
none); a channel whose mean ``|x_b|`` is 0 in a sample is left out of that
sample's mean. Pre-norm decoders only (the fold relies on every block
normalising its input).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch import nn

from toast.hf.capture.states import stream_states
from toast.hf.data.calibration import Calibration
from toast.hf.model.blocks import BlockStack, find_blocks, find_projections
from toast.hf.model.surgery import remove_blocks

__all__ = [
    "Fold",
    "PruneComp",
    "PruneCompStatistics",
    "fold_scale",
    "measure_prunecomp",
    "prune_and_comp",
    "resolve_fold",
]

Fold = Literal["auto", "before", "after"]


@dataclass
class PruneCompStatistics:
    """One pass's statistics: ``influence[b]``, block ``b``'s Block
    Influence; ``magnitudes[s, k, c]``, sample ``s``'s mean ``|x|`` of
    channel ``c`` at state ``k`` (non-pad tokens); ``rows``: tokens."""

    influence: np.ndarray
    magnitudes: np.ndarray = field(repr=False)
    rows: int

    def scale(self, block: int) -> float:
        """``α`` of removing ``block``: the mean over channels of the mean
        over samples of ``mean_t |x_{b+1}| / mean_t |x_b|``."""
        before, after = self.magnitudes[:, block], self.magnitudes[:, block + 1]
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(before > 0, after / before, np.nan)
        return float(np.nanmean(np.nanmean(ratio, axis=0)))


class _Accumulator:
    """Sums of each adjacent pair's token cosines, and every sample's
    per-channel mean ``|x|`` of every state (float64, pad tokens out)."""

    def __init__(self) -> None:
        self.cosines: torch.Tensor | None = None
        self.magnitudes: list[np.ndarray] = []
        self.rows = 0

    def __call__(self, states: list[torch.Tensor], mask: torch.Tensor | None) -> int:
        first = states[0]
        valid = (
            torch.ones(first.shape[:2], dtype=torch.float64)
            if mask is None
            else mask.to(device="cpu", dtype=torch.float64)
        )
        counts = valid.sum(dim=1)
        keep = counts > 0
        x = [s.to(device="cpu", dtype=torch.float64) for s in states]
        cos = torch.stack(
            [
                (torch.nn.functional.cosine_similarity(a, b, dim=-1) * valid).sum()
                for a, b in zip(x, x[1:], strict=False)
            ]
        )
        self.cosines = cos if self.cosines is None else self.cosines + cos
        per_state = [(s.abs() * valid[..., None]).sum(dim=1)[keep] / counts[keep, None] for s in x]
        self.magnitudes.append(torch.stack(per_state, dim=1).numpy())
        self.rows += int(valid.sum())
        return self.rows


def measure_prunecomp(
    model: nn.Module, data: Iterable, stack: BlockStack, calibration: Calibration
) -> PruneCompStatistics:
    """One pass over ``data``: every block's Block Influence and every
    state's per-sample channel magnitudes (one round's statistics)."""
    acc = _Accumulator()
    stream_states(
        model,
        data,
        acc,
        calibration,
        stack=stack,
        states=list(range(stack.num_blocks + 1)),
        tokens="all",
        desc="Prune&Comp statistics",
    )
    if acc.cosines is None or not acc.rows:
        raise ValueError("the calibration data gave no token (every sample was padding?)")
    influence = 1.0 - acc.cosines.numpy() / acc.rows
    return PruneCompStatistics(influence, np.concatenate(acc.magnitudes), acc.rows)


def resolve_fold(model: nn.Module, fold: Fold) -> Literal["before", "after"]:
    """``"auto"``: before the cut (the paper's) unless the token embedding
    is the LM head's matrix too (tied), then after it."""
    if fold != "auto":
        return fold
    embedding, head = _embedding(model, "input"), _embedding(model, "output")
    tied = (
        embedding is not None
        and head is not None
        and getattr(head, "weight", None) is getattr(embedding, "weight", False)
    )
    return "after" if tied or embedding is None else "before"


def _embedding(model: nn.Module, side: str) -> nn.Module | None:
    """The model's input or output embedding (None when it names none)."""
    get = getattr(model, f"get_{side}_embeddings", None)
    return get() if callable(get) else None


def _writers(block: nn.Module) -> list[nn.Module]:
    """The modules of ``block`` that write into the residual stream: the
    attention output and MLP down projections."""
    found = find_projections(block)
    missing = [p for p in ("out", "down") if p not in found]
    if missing:
        raise ValueError(
            f"{type(block).__name__}: no {' or '.join(missing)} projection to fold a "
            "Prune&Comp scale into (pre-norm decoder blocks only)"
        )
    return [found["out"].module, found["down"].module]


@torch.no_grad()
def _scale_module(module: nn.Module, factor: float) -> None:
    for name in ("weight", "bias"):
        p = getattr(module, name, None)
        if isinstance(p, torch.Tensor):
            p.mul_(factor)


def fold_scale(
    model: nn.Module, stack: BlockStack, cut: int, scale: float, fold: Literal["before", "after"]
) -> None:
    """Folds ``scale`` on the residual state at ``cut`` (the input of block
    ``cut`` of ``stack``, the blocks after a removal) into weights, in
    place: ``"before"`` multiplies the token embedding and the residual
    writers of blocks ``< cut`` by ``scale``; ``"after"`` multiplies the
    residual writers of blocks ``>= cut`` by ``1 / scale``."""
    if fold == "before":
        embedding = _embedding(model, "input")
        if embedding is None:
            raise ValueError(f"{type(model).__name__} has no input embedding to fold into")
        _scale_module(embedding, scale)
        blocks, factor = list(stack.blocks)[:cut], scale
    else:
        blocks, factor = list(stack.blocks)[cut:], 1.0 / scale
    for block in blocks:
        for writer in _writers(block):
            _scale_module(writer, factor)


@dataclass(frozen=True)
class PruneComp:
    """What Prune&Comp did: ``removed``, the original indices of the blocks
    in removal order; ``scales``, each round's ``α``; ``influence``, each
    round's Block Influence of the removed block; ``fold``: where the
    scales went; ``rows``: tokens per pass."""

    removed: list[int]
    scales: list[float]
    influence: list[float]
    fold: str
    rows: int


def prune_and_comp(
    model: nn.Module,
    data: Iterable,
    num_blocks: int,
    calibration: Calibration | None = None,
    *,
    min_start: int = 0,
    fold: Fold = "auto",
    blocks: str | BlockStack | None = None,
) -> tuple[nn.Module, PruneComp]:
    """Removes ``num_blocks`` blocks of ``model`` by Prune&Comp, in place
    (see the module's docstring): ``num_blocks`` rounds, each one pass over
    ``data`` (bounded by ``calibration``) on the model as the rounds left
    it, the block of lowest Block Influence at or after ``min_start``
    removed and its magnitude gap folded (``fold``). Returns the model and
    what was done."""
    calibration = calibration or Calibration()
    stack = find_blocks(model, blocks if blocks is not None else calibration.blocks)
    if not 1 <= num_blocks < stack.num_blocks - min_start + 1 or num_blocks >= stack.num_blocks:
        raise ValueError(
            f"num_blocks={num_blocks} cannot be removed from blocks {min_start}.."
            f"{stack.num_blocks - 1} (at least one block stays)"
        )
    where = resolve_fold(model, fold)
    alive = list(range(stack.num_blocks))
    removed, scales, influence = [], [], []
    rows = 0
    for _ in range(num_blocks):
        found = measure_prunecomp(model, data, stack, calibration)
        rows = found.rows
        candidates = range(min_start, stack.num_blocks)
        b = min(candidates, key=lambda k: (float(found.influence[k]), k))
        alpha = found.scale(b)
        remove_blocks(model, [(b, b + 1)], blocks=stack)
        stack = find_blocks(model, stack)  # looked up by its path
        fold_scale(model, stack, b, alpha, where)
        removed.append(alive.pop(b))
        scales.append(alpha)
        influence.append(float(found.influence[b]))
    return model, PruneComp(removed, scales, influence, where, rows)
