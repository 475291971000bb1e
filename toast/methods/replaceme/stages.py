"""ReplaceMe's stages: the cuts chosen by the shared pass's linear span
error (the best windows of every size), one pass of its own estimating
each cut's least-squares transform, and the transform folded into the
block before the cut when a plan is applied."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from torch import nn

from toast.hf.calibration import Calibration
from toast.methods.replaceme.config import ReplaceMeConfig
from toast.methods.replaceme.estimate import Estimation
from toast.methods.replaceme.fold import NotFoldableError, apply_cuts, check_cuts
from toast.methods.stages import (
    BaseStages,
    Layout,
    Needs,
    Plan,
    Shared,
    Sizes,
    Stats,
    best_windows,
    span_error,
)
from toast.spans import Span

__all__ = ["STAGES", "ReplaceMeStages", "ReplaceMeStats"]


@dataclass
class ReplaceMeStats(Stats):
    """The linear span errors that chose the cuts, and each cut's transform."""

    errors: np.ndarray = field(default_factory=lambda: np.empty((0, 0)), repr=False)
    transforms: dict[tuple[int, int], np.ndarray | None] = field(default_factory=dict)


def _cuts(errors: np.ndarray, max_blocks: int) -> list[tuple[int, int]]:
    """The best-predicted windows of every size up to ``max_blocks``."""
    return [cut for n in range(1, max_blocks + 1) for cut in best_windows(errors, n)]


def _estimate(
    model: nn.Module,
    data: Iterable,
    layout: Layout,
    calibration: Calibration,
    cuts: list[tuple[int, int]],
) -> tuple[dict[tuple[int, int], np.ndarray | None], str]:
    """ReplaceMe's LS transform of every cut in one pass (its defaults:
    massive rows fitted as plain removal leaves them); ``({}, why)`` when
    the model's blocks cannot take a folded transform."""
    config = ReplaceMeConfig(spans=cuts, holdout=0.0, calibration=calibration)
    spans = [Span(a, b, math.nan) for a, b in cuts]
    try:
        check_cuts(layout.stack, spans, config.structure, config.placement, config.objective)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fitted, _ = Estimation(model, data, config, layout.stack).fit(spans)
    except (NotFoldableError, ValueError) as exc:
        return {}, f"ReplaceMe left out: {exc}"
    return {cut: f.transform for cut, f in zip(cuts, fitted, strict=True)}, ""


class ReplaceMeStages(BaseStages):
    """ReplaceMe as stages (family ``"replaceme"``)."""

    def needs(self, layout: Layout) -> Needs:
        return Needs(moments=True)

    def calibrate(
        self,
        model: nn.Module,
        data: Iterable,
        layout: Layout,
        shared: Shared | None,
        calibration: Calibration,
        max_blocks: int,
    ) -> ReplaceMeStats:
        assert shared is not None  # needs() asked for it
        errors = shared.errors("linear")
        cuts = _cuts(errors, max_blocks)
        if not cuts:
            return ReplaceMeStats(errors=errors)
        transforms, note = _estimate(model, data, layout, calibration, cuts)
        return ReplaceMeStats(
            passes=0 if note else 1, note=note, errors=errors, transforms=transforms
        )

    def propose(self, stats: Stats, sizes: Sizes, max_blocks: int, macs_matter: bool) -> list[Plan]:
        assert isinstance(stats, ReplaceMeStats)
        if not stats.transforms:
            return []
        plans = []
        for n in range(1, max_blocks + 1):
            for window in best_windows(stats.errors, n):
                spans = (window,)
                predicted = span_error(stats.errors, spans)
                if math.isfinite(predicted):
                    params = sizes.after_spans(spans)
                    plans.append(
                        Plan(("replaceme",), "replaceme", spans, "ls", None, params, predicted)
                    )
        return plans

    def apply(self, model: nn.Module, plan: Plan, stats: Stats, layout: Layout) -> None:
        assert isinstance(stats, ReplaceMeStats)
        missing = [s for s in plan.spans if s not in stats.transforms]
        if missing:
            raise KeyError(f"no ReplaceMe transform was estimated for cut(s) {missing}")
        transforms = [stats.transforms[s] for s in plan.spans]
        spans = [Span(a, b, math.nan) for a, b in plan.spans]
        apply_cuts(model, layout.stack, spans, transforms, "fold", "full")


STAGES = ReplaceMeStages()
