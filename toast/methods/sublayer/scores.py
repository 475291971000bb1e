"""Choosing sub-layers on calibration data: by score in one pass, or by
measured quality, greedily.

The score of sub-layer ``s`` is ``1 − cos(h, h + f_s(h))`` averaged over
the (unmasked) tokens, ``h`` the residual stream entering it (its
pre-norm's input) and ``f_s(h)`` what it adds (its last module's output):
near 0, the sub-layer barely turns the residual stream, so removing it
changes the block's output least. One forward pass with hooks scores every
sub-layer of every block at once; from a checkpoint on disk
(:func:`sublayer_scores_from_disk`) the same hooks sit on each block while
it is loaded, and one sweep over the blocks scores them all, with the
same arithmetic on the same states (so the same scores).

The measured greedy cannot run from disk: each of its steps measures the
model with every remaining candidate removed in turn, a sweep over every
block per candidate per step on a checkpoint that is never loaded.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from toast.hf.capture.sequential import DiskModel, stream_blocks
from toast.hf.capture.states import calibration_inputs, without_kv_cache
from toast.hf.data.calibration import Calibration
from toast.hf.evaluate.quality import HIGHER_IS_BETTER, Evaluator
from toast.hf.model.blocks import BlockStack
from toast.methods.sublayer.parts import SubLayer, branch_output, zeroed

__all__ = [
    "calibration_batches",
    "greedy_measured",
    "sublayer_scores",
    "sublayer_scores_from_disk",
]


def _token_mask(kwargs: dict[str, Any], hidden: torch.Tensor) -> torch.Tensor | None:
    """The batch's attention mask where it matches the states' (batch,
    tokens) shape (padding is left out of the mean), else None."""
    return _matching(kwargs.get("attention_mask"), hidden)


def _matching(mask: Any, hidden: torch.Tensor) -> torch.Tensor | None:
    """``mask`` as booleans where it is a ``(batch, tokens)`` tensor of
    ``hidden``'s first two dimensions, else None (every token counts)."""
    if isinstance(mask, torch.Tensor) and mask.shape == hidden.shape[:2]:
        return mask.to(torch.bool)
    return None


def _distance(h: torch.Tensor, output: Any) -> torch.Tensor:
    """Each token's ``1 − cos(h, h + f(h))`` in float64."""
    h = h.double()
    return 1.0 - F.cosine_similarity(h, h + branch_output(output).double(), dim=-1)


class _Sums:
    """Each sub-layer's summed per-token ``1 − cos`` and its token count."""

    def __init__(self, subs: Sequence[SubLayer]) -> None:
        self.totals = np.zeros(len(subs))
        self.counts = np.zeros(len(subs))

    def add(self, i: int, distance: torch.Tensor, mask: torch.Tensor | None) -> None:
        """One batch's per-token distances of sub-layer ``i``, pad tokens left out."""
        values = distance if mask is None else distance[mask]
        self.totals[i] += float(values.sum())
        self.counts[i] += values.numel()


class _Scorer(_Sums):
    """Hooks that add each sub-layer's per-token ``1 − cos`` to its total."""

    def __init__(self, stack: BlockStack, subs: Sequence[SubLayer]) -> None:
        super().__init__(subs)
        self.kwargs: dict[str, Any] = {}
        self.inputs: dict[int, torch.Tensor] = {}
        self.handles = []
        for i, sub in enumerate(subs):
            block = stack.blocks[sub.block]
            norm, last = getattr(block, sub.norm), getattr(block, sub.last)
            self.handles.append(norm.register_forward_pre_hook(self._enter(i)))
            self.handles.append(last.register_forward_hook(self._leave(i)))

    def _enter(self, i: int) -> Any:
        def hook(module: nn.Module, args: tuple) -> None:
            self.inputs[i] = args[0]

        return hook

    def _leave(self, i: int) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            h = self.inputs.pop(i)
            self.add(i, _distance(h, output), _token_mask(self.kwargs, h))

        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def sublayer_scores(
    model: nn.Module,
    data: Iterable,
    stack: BlockStack,
    subs: Sequence[SubLayer],
    calibration: Calibration,
) -> np.ndarray:
    """Each of ``subs``' mean ``1 − cos(h, h + f(h))`` over the calibration
    tokens (see the module docstring), in ``subs``' order; one pass."""
    scorer = _Scorer(stack, subs)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for args, kwargs in calibration_inputs(model, data, calibration):
                scorer.kwargs = kwargs
                model(*args, **without_kv_cache(model, kwargs))
    finally:
        scorer.close()
        model.train(was_training)
    return _means(scorer.totals, scorer.counts)


def _means(totals: np.ndarray, counts: np.ndarray) -> np.ndarray:
    if not counts.any():
        raise ValueError("the calibration data yielded no token to score the sub-layers on")
    with np.errstate(invalid="ignore", divide="ignore"):
        return totals / counts


def calibration_batches(model: nn.Module, data: Iterable, calibration: Calibration) -> list[Any]:
    """The calibration batches within ``max_batches`` / ``max_samples``, as
    the model's keyword inputs (a tensor for a positional input), held so
    that every measured pass reads the same ones."""
    return [
        kwargs if not args else args[0]
        for args, kwargs in calibration_inputs(model, data, calibration)
    ]


def greedy_measured(
    model: nn.Module,
    data: Iterable,
    stack: BlockStack,
    candidates: Sequence[SubLayer],
    count: int,
    calibration: Calibration,
) -> tuple[list[SubLayer], list[float]]:
    """``count`` of ``candidates`` chosen one at a time, each step the one
    whose removal (on top of those chosen) keeps the calibration quality
    best; with the quality after each step. The model is not changed
    (removals are measured with :func:`~toast.methods.sublayer.parts.zeroed`)."""
    evaluator = Evaluator(calibration_batches(model, data, calibration), progress=False)
    evaluator.measure(model, "original")  # the reference every later pass compares with
    assert evaluator.metric is not None  # set by the first measure
    sign = -1.0 if HIGHER_IS_BETTER[evaluator.metric] else 1.0
    chosen: list[SubLayer] = []
    qualities: list[float] = []
    remaining = list(candidates)
    for _ in range(count):
        measured = []
        for sub in remaining:
            with zeroed(stack, [*chosen, sub]):
                measured.append(evaluator.measure(model, f"without {sub.kind} {sub.block}"))
        best = min(range(len(remaining)), key=lambda i: (sign * measured[i], i))
        chosen.append(remaining.pop(best))
        qualities.append(measured[best])
    return chosen, qualities


class _DiskScorer(_Sums):
    """The scores' sums over a sweep of a checkpoint's blocks: hooks on the
    loaded block's sub-layers keep each run's distances (a block may run a
    batch a few rows at a time), and once the batch's output state is handed
    on they are joined and added with the batch's mask, as in memory."""

    def __init__(self, subs: Sequence[SubLayer]) -> None:
        super().__init__(subs)
        self.subs = list(subs)
        self.inputs: dict[int, torch.Tensor] = {}
        self.runs: dict[int, list[torch.Tensor]] = {}

    def on_block(self, index: int, block: nn.Module) -> Callable[[], None]:
        handles = []
        for i, sub in enumerate(self.subs):
            if sub.block == index:
                norm, last = getattr(block, sub.norm), getattr(block, sub.last)
                handles.append(norm.register_forward_pre_hook(self._enter(i)))
                handles.append(last.register_forward_hook(self._leave(i)))
                self.runs[i] = []

        def cleanup() -> None:
            for handle in handles:
                handle.remove()
            self.runs.clear()

        return cleanup

    def _enter(self, i: int) -> Any:
        def hook(module: nn.Module, args: tuple) -> None:
            self.inputs[i] = args[0]

        return hook

    def _leave(self, i: int) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self.runs[i].append(_distance(self.inputs.pop(i), output))

        return hook

    def on_state(
        self, state: int, batch: int, hidden: torch.Tensor, mask: torch.Tensor | None
    ) -> None:
        """After block ``state - 1`` ran on the batch: its sub-layers' sums."""
        for i, runs in self.runs.items():
            if runs:
                distance = runs[0] if len(runs) == 1 else torch.cat(runs)
                self.add(i, distance, _matching(mask, hidden))
                runs.clear()


def sublayer_scores_from_disk(
    disk: DiskModel,
    data: Iterable,
    subs: Sequence[SubLayer],
    calibration: Calibration,
    buffer_dir: str | os.PathLike | None = None,
) -> np.ndarray:
    """:func:`sublayer_scores` on the checkpoint ``disk``, block by block,
    never loaded (one sweep; the blocks after the last scored one do not
    run). The states wait between blocks in files with no name in
    ``buffer_dir``, freed on every exit."""
    scorer = _DiskScorer(subs)
    upto = max((s.block for s in subs), default=-1) + 1
    stream_blocks(
        disk, data, scorer.on_state, calibration, upto=upto, on_block=scorer.on_block,
        buffer_dir=buffer_dir, desc="sub-layer scores",
    )  # fmt: skip
    return _means(scorer.totals, scorer.counts)
