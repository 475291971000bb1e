"""ReplaceMe's stages: the cuts chosen by the shared pass's linear span
error (the best windows of every size), one pass of its own estimating
each cut's least-squares transform, and the transform folded into the
block before the cut when a plan is applied. On disk the same pass runs
block by block (:class:`toast.methods.replaceme.disk.DiskEstimation`), a
plan is measured with its cuts made as the blocks load, and written as a
pruned checkpoint without loading the model. ``configured(config)`` gives
the stages of a user's options, what ``toast.compress`` runs through the
one driver (:mod:`toast.methods.replaceme.configured`)."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from toast.hf.capture.sequential import BlockEdits, DiskModel
from toast.hf.data.calibration import Calibration
from toast.hf.model.blocks import BlockStack
from toast.methods.replaceme.config import ReplaceMeConfig, distance_candidates_only
from toast.methods.replaceme.configured import ConfiguredReplaceMe
from toast.methods.replaceme.disk import DiskEstimation, cut_edits, write_replaceme
from toast.methods.replaceme.estimate import Estimation, Fits
from toast.methods.replaceme.fold import NotFoldableError, apply_cuts, check_cuts
from toast.methods.replaceme.memory import within_memory
from toast.methods.span_plans import best_windows, span_error
from toast.methods.stages import BaseStages, Layout, Needs, Plan, Shared, Sizes, Stats
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


def _config(cuts: list[tuple[int, int]], calibration: Calibration | None = None) -> ReplaceMeConfig:
    """ReplaceMe's defaults for ``cuts`` (massive rows fitted as plain
    removal leaves them; no held-out gate: the search measures every plan)."""
    # placement "fold", full T: what apply() and edits() make (the search
    # leaves ReplaceMe out where it does not fold)
    if calibration is None:
        return ReplaceMeConfig(spans=cuts, check_fraction=0.0, placement="fold")
    return ReplaceMeConfig(
        spans=cuts, check_fraction=0.0, placement="fold", calibration=calibration
    )


def _estimate(
    estimation: Fits, stack: BlockStack, config: ReplaceMeConfig, cuts: list[tuple[int, int]]
) -> tuple[dict[tuple[int, int], np.ndarray | None], str]:
    """The LS transform of every cut in one pass of ``estimation`` (in
    memory or from disk); ``({}, why)`` when the model's blocks cannot take
    a folded transform."""
    spans = [Span(a, b, math.nan) for a, b in cuts]
    try:
        check_cuts(stack, spans, config.structure, config.placement, config.objective)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fitted, _ = estimation.fit(spans)
    except (NotFoldableError, ValueError) as exc:
        return {}, f"ReplaceMe left out: {exc}"
    return {cut: f.transform for cut, f in zip(cuts, fitted, strict=True)}, ""


def _stats(errors: np.ndarray, transforms: dict, note: str) -> ReplaceMeStats:
    return ReplaceMeStats(passes=0 if note else 1, note=note, errors=errors, transforms=transforms)


def _calibrated(
    shared: Shared | None,
    calibration: Calibration,
    max_blocks: int,
    estimation: Callable[[ReplaceMeConfig], Fits],
    stack: BlockStack,
) -> ReplaceMeStats:
    """The shared pass's best cuts of every size up to ``max_blocks``, each
    cut's transform from one estimation pass (``estimation(config)``: in
    memory or block by block from disk)."""
    assert shared is not None  # needs() asked for it
    errors = shared.errors("linear")
    cuts = _cuts(errors, max_blocks)
    if not cuts:
        return ReplaceMeStats(errors=errors)
    config = _config(cuts, calibration)
    return _stats(errors, *_estimate(estimation(config), stack, config, cuts))


class ReplaceMeStages(BaseStages):
    """ReplaceMe as stages (family ``"replaceme"``): the search's; configured
    by a user's :class:`ReplaceMeConfig`, the stages ``toast.compress`` runs
    (:class:`~toast.methods.replaceme.configured.ConfiguredReplaceMe`)."""

    from_disk = True
    statistics_apart = True  # cuts open after stage 0; held-out passes keep transforms only

    def on_either_path(self, config: Any) -> Any:
        return distance_candidates_only(config)

    def within_memory(
        self, config: Any, states: int, width: int, room: int, tokens: Sequence[int] | None = None
    ) -> tuple[Any, list[tuple[str, int]]]:
        return within_memory(config, states, width, room)

    def configured(self, config: ReplaceMeConfig) -> ConfiguredReplaceMe:
        return ConfiguredReplaceMe(config)

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
        def estimation(config: ReplaceMeConfig) -> Estimation:
            return Estimation(model, data, config, layout.stack)

        return _calibrated(shared, calibration, max_blocks, estimation, layout.stack)

    def calibrate_from_disk(
        self,
        disk: DiskModel,
        data: Iterable,
        layout: Layout,
        shared: Shared | None,
        calibration: Calibration,
        max_blocks: int,
    ) -> ReplaceMeStats:
        """:meth:`calibrate` with the estimation pass run block by block."""

        def estimation(config: ReplaceMeConfig) -> DiskEstimation:
            return DiskEstimation(disk, data, config)

        return _calibrated(shared, calibration, max_blocks, estimation, disk.stack)

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
                    plans.append(Plan(("replaceme",), "replaceme", spans, "ls", params, predicted))
        return plans

    def apply(self, model: nn.Module, plan: Plan, stats: Stats, layout: Layout) -> None:
        spans, transforms = _cuts_of(plan, stats)
        apply_cuts(model, layout.stack, spans, transforms, "fold", "full")

    def edits(self, disk: DiskModel, plan: Plan, stats: Stats) -> BlockEdits:
        spans, transforms = _cuts_of(plan, stats)
        return cut_edits(spans, transforms, _config(list(plan.spans)), disk.dtype)

    def save_from_disk(
        self,
        disk: DiskModel,
        plan: Plan,
        stats: Stats,
        output: str | os.PathLike,
        report: str | None = None,
    ) -> Path:
        """A standard checkpoint without the cut blocks, each transform
        folded into the block before its cut (no model card for ``report``)."""
        spans, transforms = _cuts_of(plan, stats)
        return write_replaceme(disk, output, spans, transforms, progress=False)


def _cuts_of(plan: Plan, stats: Stats) -> tuple[list[Span], list[np.ndarray | None]]:
    """The plan's cuts and the transform estimated for each."""
    assert isinstance(stats, ReplaceMeStats)
    missing = [s for s in plan.spans if s not in stats.transforms]
    if missing:
        raise KeyError(f"no ReplaceMe transform was estimated for cut(s) {missing}")
    spans = [Span(a, b, math.nan) for a, b in plan.spans]
    return spans, [stats.transforms[s] for s in plan.spans]


STAGES = ReplaceMeStages()
