"""Choosing sub-layers on calibration data: by score in one pass, or by
measured quality, greedily.

The score of sub-layer ``s`` is ``1 − cos(h, h + f_s(h))`` averaged over
the (unmasked) tokens, ``h`` the residual stream entering it (its
pre-norm's input) and ``f_s(h)`` what it adds (its last module's output):
near 0, the sub-layer barely turns the residual stream, so removing it
changes the block's output least. One forward pass with hooks scores every
sub-layer of every block at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from toast.hf.capture.states import calibration_inputs, without_kv_cache
from toast.hf.data.calibration import Calibration
from toast.hf.evaluate.quality import HIGHER_IS_BETTER, Evaluator
from toast.hf.model.blocks import BlockStack
from toast.methods.sublayer.parts import SubLayer, branch_output, zeroed

__all__ = ["calibration_batches", "greedy_measured", "sublayer_scores"]


def _token_mask(kwargs: dict[str, Any], hidden: torch.Tensor) -> torch.Tensor | None:
    """The batch's attention mask where it matches the states' (batch,
    tokens) shape (padding is left out of the mean), else None."""
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.shape == hidden.shape[:2]:
        return mask.to(torch.bool)
    return None


class _Scorer:
    """Hooks that add each sub-layer's per-token ``1 − cos`` to its total."""

    def __init__(self, stack: BlockStack, subs: Sequence[SubLayer]) -> None:
        self.totals = np.zeros(len(subs))
        self.counts = np.zeros(len(subs))
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
            h = self.inputs.pop(i).double()
            cos = F.cosine_similarity(h, h + branch_output(output).double(), dim=-1)
            mask = _token_mask(self.kwargs, h)
            values = (1.0 - cos) if mask is None else (1.0 - cos)[mask]
            self.totals[i] += float(values.sum())
            self.counts[i] += values.numel()

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
    if not scorer.counts.any():
        raise ValueError("the calibration data yielded no token to score the sub-layers on")
    with np.errstate(invalid="ignore", divide="ignore"):
        return scorer.totals / scorer.counts


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
