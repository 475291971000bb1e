"""Which blocks to remove, by rules other than one window's distance: the
block influence of ShortGPT, SLEB's measured greedy removal, and the
least-squares error a transform is predicted to leave.

- **Block influence** (Men et al., "ShortGPT: Layers in Large Language
  Models are More Redundant Than You Expect", arXiv 2403.03853, Eq. 1):
  ``BI_i = 1 − E_{X,t} [cos(x_{i,t}, x_{i+1,t})]``, the mean over tokens of
  the cosine between the hidden state entering block ``i`` and the one
  leaving it; the blocks of lowest BI change the stream least and are
  removed, wherever they are (not necessarily contiguous).
- **SLEB** (Song et al., "SLEB: Streamlining LLMs through Redundancy
  Verification and Elimination of Transformer Blocks", arXiv 2402.09025,
  Algorithm 1): ``num_blocks`` times, remove the one block whose removal
  gives the lowest calibration perplexity of the model pruned so far. The
  score of a block is measured, not predicted, and depends on the blocks
  already removed, so it is recomputed every step (one forward of the
  calibration batches per remaining block per step).
- **Predicted**: the window whose least-squares replacement has the
  smallest error predicted from the moments of the block states (toast's
  linear span error, :func:`toast.core.error_matrix` through the shared
  pass :func:`toast.methods.stages.capture_shared`).

Blocks chosen one by one become cuts by :func:`runs`: each maximal run of
consecutive chosen blocks is one span (ReplaceMe fits one transform per
run; plain removal just deletes it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from toast.hf.capture.states import stream_states
from toast.hf.data.calibration import Calibration
from toast.hf.evaluate.quality import Evaluator, skipped_blocks
from toast.hf.model.blocks import BlockStack
from toast.methods.stages import Layout, capture_shared

__all__ = [
    "Sleb",
    "block_influence",
    "lowest_blocks",
    "predicted_errors",
    "runs",
    "sleb",
    "span_scores",
]


def runs(blocks: Iterable[int]) -> list[tuple[int, int]]:
    """The maximal runs of consecutive ``blocks`` as ``(start, stop)`` spans,
    sorted: ``{2, 3, 7}`` gives ``[(2, 4), (7, 8)]``."""
    spans: list[tuple[int, int]] = []
    for b in sorted(set(blocks)):
        if spans and spans[-1][1] == b:
            spans[-1] = (spans[-1][0], b + 1)
        else:
            spans.append((b, b + 1))
    return spans


def _check_count(num_blocks: int, min_start: int, total: int) -> None:
    if not 1 <= num_blocks <= total - min_start or num_blocks >= total:
        raise ValueError(
            f"num_blocks={num_blocks} cannot be chosen among blocks {min_start}..{total - 1} "
            f"of {total} (at least one block stays)"
        )


def lowest_blocks(scores: np.ndarray, num_blocks: int, min_start: int = 1) -> list[int]:
    """The ``num_blocks`` blocks of lowest score, none before ``min_start``
    (the lower index on ties), sorted."""
    total = len(scores)
    _check_count(num_blocks, min_start, total)
    order = sorted(range(min_start, total), key=lambda b: (float(scores[b]), b))
    return sorted(order[:num_blocks])


class _Influence:
    """Sums of ``cos(x_i, x_{i+1})`` per block over the kept token rows."""

    def __init__(self, include_padding: bool) -> None:
        self.include_padding = include_padding
        self.sums: torch.Tensor | None = None
        self.rows = 0

    def __call__(self, states: list[torch.Tensor], mask: torch.Tensor | None) -> int:
        d = int(states[0].shape[-1])
        flat = [s.reshape(-1, d).double() for s in states]
        if mask is not None and not self.include_padding:
            keep = mask.reshape(-1).bool()
            flat = [f[keep] for f in flat]
        cos = torch.stack(
            [
                torch.nn.functional.cosine_similarity(a, b, dim=-1).sum()
                for a, b in zip(flat, flat[1:], strict=False)
            ]
        ).cpu()
        self.sums = cos if self.sums is None else self.sums + cos
        self.rows += int(flat[0].shape[0])
        return self.rows


def block_influence(
    model: nn.Module,
    data: Iterable,
    calibration: Calibration,
    stack: BlockStack,
    include_padding: bool = False,
) -> np.ndarray:
    """ShortGPT's block influence of every block (arXiv 2403.03853, Eq. 1):
    ``BI_i = 1 − mean over tokens of cos(x_i, x_{i+1})``, ``x_i`` the
    hidden state entering block ``i`` (state ``i``, before any final norm)
    and ``x_{i+1}`` the one leaving it, every non-pad token of ``data``
    (every token with ``include_padding``); one pass, float64 sums."""
    consume = _Influence(include_padding)
    stream_states(
        model,
        data,
        consume,
        calibration,
        stack=stack,
        states=list(range(stack.num_blocks + 1)),
        tokens="all",
        desc="block influence",
    )
    if consume.sums is None or consume.rows == 0:
        raise ValueError("the loader yielded no rows (empty loader, or every token masked out)")
    return 1.0 - consume.sums.numpy() / consume.rows


@dataclass(frozen=True)
class Sleb:
    """SLEB's choice: the blocks removed (sorted), the order they were
    removed in, and the calibration metric measured after each step
    (``metric``: perplexity, lower is better; or the cosine of the outputs
    to the original's, higher is better)."""

    blocks: list[int]
    order: list[int]
    scores: list[float]
    metric: str


def sleb(
    model: nn.Module,
    data: Iterable,
    stack: BlockStack,
    num_blocks: int,
    min_start: int = 1,
    progress: bool = False,
) -> Sleb:
    """SLEB (arXiv 2402.09025, Algorithm 1): ``num_blocks`` times, the one
    remaining block whose removal from the model pruned so far gives the
    best calibration metric on ``data`` (perplexity for a causal LM, else
    the mean cosine of outputs to the original's: see
    :class:`toast.hf.evaluate.quality.Evaluator`), the lower index on ties.
    Blocks are skipped by hooks (:func:`toast.hf.evaluate.quality.skipped_blocks`),
    so ``model`` is unchanged. ``data`` is iterated once per candidate per
    step (plus once for the original, the reference)."""
    total = stack.num_blocks
    _check_count(num_blocks, min_start, total)
    evaluator = Evaluator(data, progress=progress, top_k=1)
    evaluator.measure(model, "original")
    lower = evaluator.metric == "perplexity"
    removed: list[int] = []
    scores: list[float] = []
    for _ in range(num_blocks):
        best, best_score = -1, float("nan")
        for b in range(min_start, total):
            if b in removed:
                continue
            with skipped_blocks(stack, runs([*removed, b])):
                score = evaluator.measure(model, f"without block {b}")
            if best < 0 or (score < best_score if lower else score > best_score):
                best, best_score = b, score
        removed.append(best)
        scores.append(best_score)
    return Sleb(sorted(removed), removed, scores, str(evaluator.metric))


def predicted_errors(
    model: nn.Module,
    data: Iterable,
    stack: BlockStack,
    calibration: Calibration,
    backend: str,
    max_blocks: int,
    observe: Callable[[list[torch.Tensor], torch.Tensor | None], Any] | None = None,
) -> np.ndarray:
    """Every span's predicted least-squares error (toast's ``"linear"``
    error matrix, GCV estimator: ``errors[i, j]`` for replacing blocks
    ``i..j−1`` by the least-squares map of state ``i`` onto state ``j``;
    NaN beyond ``max_blocks``), from one pass capturing the moments of the
    block states (:func:`toast.methods.stages.capture_shared`), which
    ``observe`` sees too."""
    shared = capture_shared(
        model, data, Layout(stack), calibration, backend, max_blocks, observe=observe
    )
    try:
        return shared.errors("linear")
    finally:
        shared.close()


def span_scores(scores: np.ndarray, spans: Sequence[tuple[int, int]]) -> list[float]:
    """Each span's summed per-block score."""
    return [float(np.sum(scores[a:b])) for a, b in spans]
