"""The calibration a search needs, in as few passes as possible: one pass
gives the moments of every state (TOAST's analysis: every span's linear,
affine and identity error, and every closed-form translator), a second
gives ReplaceMe's least-squares transform for the best-predicted cuts of
every size up to the largest a search considers. Both results are what the
cache keeps, so a new target needs neither pass again.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from torch import nn

from toast.hf.blocks import BlockStack
from toast.hf.calibration import Calibration
from toast.hf.params import count_params
from toast.methods.replaceme.config import ReplaceMeConfig
from toast.methods.replaceme.estimate import Estimation
from toast.methods.replaceme.fold import NotFoldableError, check_cuts
from toast.methods.toast.analysis import Analysis, analyze
from toast.methods.toast_vit.blocks import Attention, vit_blocks
from toast.methods.toast_vit.macs import vit_arch
from toast.spans import Span

from .candidates import Predictions, Sizes, best_windows

__all__ = ["Calibrated", "calibrate_analysis", "calibrate_replaceme", "model_sizes", "predictions"]


@dataclass
class Calibrated:
    """What the calibration passes left: the analysis (moments, massive
    rows), the span errors derived from it, and ReplaceMe's transforms by
    cut, ``note`` saying why ReplaceMe was left out ("" when it was not)."""

    analysis: Analysis
    predictions: Predictions
    transforms: dict[tuple[int, int], np.ndarray | None] = field(default_factory=dict)
    note: str = ""


def calibrate_analysis(
    model: nn.Module, data: Iterable, stack: BlockStack, calibration: Calibration, backend: str
) -> Analysis:
    """The one pass over ``data``: moments of every state, every pair."""
    with warnings.catch_warnings():
        # a search compares measured candidates; ill-conditioned spans just rank badly
        warnings.simplefilter("ignore")
        return analyze(
            model,
            data,
            metric="linear",
            estimator="gcv",
            tokens="all",
            backend=backend,  # type: ignore[arg-type]
            calibration=calibration,
            stack=stack,
            massive_rows=True,
        )


def _identity_errors(analysis: Analysis) -> np.ndarray:
    """``‖Y − X‖_F / ‖Y‖_F`` for every pair of states, from the core's
    ``mse`` (the mean of ``‖y − x‖²`` over rows; NaN where it is)."""
    moments = analysis.moments
    norms = np.array([np.trace(moments.cross(j, j)) for j in range(moments.num_states)])
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.sqrt(analysis.error_matrix("mse") * moments.rows / norms[None, :])


def predictions(analysis: Analysis) -> Predictions:
    """Every span's relative error under each family's map."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Predictions(
            {
                "identity": _identity_errors(analysis),
                "linear": analysis.error_matrix("linear"),
                "affine": analysis.error_matrix("affine"),
            }
        )


def replaceme_cuts(predictions: Predictions, max_blocks: int) -> list[tuple[int, int]]:
    """The cuts whose transforms a search estimates: the best-predicted
    windows of every size up to ``max_blocks``."""
    table = predictions.errors["linear"]
    return [cut for n in range(1, max_blocks + 1) for cut in best_windows(table, n)]


def calibrate_replaceme(
    model: nn.Module,
    data: Iterable,
    stack: BlockStack,
    calibration: Calibration,
    cuts: list[tuple[int, int]],
) -> tuple[dict[tuple[int, int], np.ndarray | None], str]:
    """ReplaceMe's LS transform of every cut in one pass (its defaults:
    massive rows fitted as plain removal leaves them); ``({}, why)`` when
    the model's blocks cannot take a folded transform."""
    if not cuts:
        return {}, ""
    config = ReplaceMeConfig(spans=cuts, holdout=0.0, calibration=calibration)
    spans = [Span(a, b, math.nan) for a, b in cuts]
    try:
        check_cuts(stack, spans, config.structure, config.placement, config.objective)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fitted, _ = Estimation(model, data, config, stack).fit(spans)
    except (NotFoldableError, ValueError) as exc:
        return {}, f"ReplaceMe left out: {exc}"
    return {cut: f.transform for cut, f in zip(cuts, fitted, strict=True)}, ""


def _head_dim_params(attention: Attention) -> int:
    """Parameters one head dimension costs: a row of Q, K and V (with
    their biases) and a column of the output projection."""
    per_dim = 0
    for linear in (attention.q_proj, attention.k_proj, attention.v_proj):
        per_dim += linear.in_features + (1 if linear.bias is not None else 0)
    return per_dim + attention.o_proj.out_features


def model_sizes(model: nn.Module, stack: BlockStack, width: int) -> Sizes:
    """The model's :class:`Sizes`, read from its modules once."""
    block_params = tuple(sum(p.numel() for p in b.parameters()) for b in stack.blocks)
    try:
        vm = vit_blocks(model)
    except (ValueError, TypeError):
        return Sizes(count_params(model), block_params, width)
    if vm.num_blocks != stack.num_blocks:  # e.g. Swin's stages: no block removal beside heads
        return Sizes(count_params(model), block_params, width)
    per_dim = tuple(_head_dim_params(b.attention) for b in vm.blocks)
    dims = tuple((b.heads, b.head_dim) for b in vm.blocks)
    try:
        tcs = not vit_arch(model.config).swiglu
    except (ValueError, TypeError, AttributeError):
        tcs = False
    return Sizes(count_params(model), block_params, width, per_dim, dims, tcs=tcs)
