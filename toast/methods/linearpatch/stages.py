"""LinearPatch's stages: its own pass (per-sample rotated magnitudes and
the similarity of every pair of states), the most similar windows of
every size as plans, and the window replaced by its patch when a plan is
applied: an inserted linear block (a translator block holding ``H diag(d)
Hᵀ``, saved in toast's format), never folded into the weights around it.

On a checkpoint on disk the same pass runs block by block
(:func:`~toast.methods.linearpatch.statistics.measure_patch_statistics_from_disk`),
the plan is measured with the patch applied as the blocks load, and the
folder is written as :func:`toast.save_pretrained` writes the patched
model (:func:`toast.io.from_disk.save_translated_from_disk`, the writer of
TOAST's translators: the same translator block)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from toast.core import Translator
from toast.hf.capture.sequential import BlockEdits, DiskModel
from toast.hf.data.calibration import Calibration
from toast.hf.evaluate.from_disk import replaced
from toast.hf.model.surgery import replace_spans
from toast.io.from_disk import save_translated_from_disk
from toast.methods.linearpatch.config import LinearPatchConfig
from toast.methods.linearpatch.statistics import (
    PatchStatistics,
    measure_patch_statistics,
    measure_patch_statistics_from_disk,
)
from toast.methods.span_plans import ALTERNATIVES
from toast.methods.stages import BaseStages, Layout, Plan, Shared, Sizes, Stats
from toast.spans import Span, validate_spans
from toast.translators.block import translator_module

__all__ = ["STAGES", "LinearPatchStages", "LinearPatchStats", "patch_translators"]


@dataclass
class LinearPatchStats(Stats):
    """The pass's statistics (None when it proposes nothing)."""

    statistics: PatchStatistics | None = None


def patch_translators(
    statistics: PatchStatistics, spans: Sequence[tuple[int, int]]
) -> list[Translator]:
    """Each window's patch as a fitted linear translator (no bias)."""
    found = []
    for a, b in spans:
        weight = statistics.patch(a, b)
        bias = np.zeros(weight.shape[0])
        found.append(Translator("linearpatch", weight, bias, math.nan, weight.shape[0], "none"))
    return found


class LinearPatchStages(BaseStages):
    """LinearPatch as stages (family ``"linearpatch"``); ``rotate=False`` is
    the paper's ablation without the Hadamard rotation. Runs from disk too."""

    from_disk = True

    def __init__(self, rotate: bool = True) -> None:
        self.rotate = rotate

    def configured(self, config: LinearPatchConfig) -> LinearPatchStages:
        return LinearPatchStages(config.rotate)

    def check(self, request: Any, layout: Layout) -> None:
        total, asked = layout.num_blocks, request.count
        if asked is not None and asked > total - 2:
            raise ValueError(
                f"num_blocks={asked} leaves no window of {total} blocks that starts at block 1 "
                f"and ends before the last (LinearPatch's range); remove at most {total - 2}"
            )

    def calibrate(
        self,
        model: nn.Module,
        data: Iterable,
        layout: Layout,
        shared: Shared | None,
        calibration: Calibration,
        max_blocks: int,
    ) -> LinearPatchStats:
        reach, note = _reach(layout, max_blocks)
        if reach < 1:
            return LinearPatchStats(note=note)
        stats = measure_patch_statistics(model, data, layout.stack, calibration, reach, self.rotate)
        return LinearPatchStats(passes=1, note=note, statistics=stats)

    def propose(self, stats: Stats, sizes: Sizes, max_blocks: int, macs_matter: bool) -> list[Plan]:
        assert isinstance(stats, LinearPatchStats)
        found = stats.statistics
        if found is None:
            return []
        width = found.magnitudes.shape[2]
        plans = []
        for n in range(1, max_blocks + 1):
            for window in found.windows(n)[:ALTERNATIVES]:
                plans.append(
                    Plan(
                        ("linearpatch",),
                        "linearpatch",
                        (window,),
                        "linearpatch",
                        sizes.after_spans((window,), width * width),
                        1.0 - float(found.similarity[window]),
                    )
                )
        return plans

    def given(self, spans: tuple[tuple[int, int], ...], stats: Stats, sizes: Sizes) -> Plan:
        assert isinstance(stats, LinearPatchStats) and stats.statistics is not None
        spans = tuple(validate_spans(spans, sizes.num_blocks))
        width = stats.statistics.magnitudes.shape[2]
        after = sizes.after_spans(spans, width * width)
        return Plan(("linearpatch",), "given", spans, "linearpatch", after, math.nan)

    def scores(self, plan: Plan, stats: Stats) -> list[float]:
        """Each window's ``1 −`` mean cosine similarity."""
        assert isinstance(stats, LinearPatchStats) and stats.statistics is not None
        similarity = stats.statistics.similarity
        return [1.0 - float(np.nan_to_num(similarity[a, b])) for a, b in plan.spans]

    def report(
        self, plan: Plan, stats: Stats, sizes: Sizes, spans: Sequence[Span], params_after: int
    ) -> Any:
        from toast.methods.linearpatch.report import LinearPatchReport

        assert isinstance(stats, LinearPatchStats) and stats.statistics is not None
        found = stats.statistics
        return LinearPatchReport(
            method="linearpatch",
            spans=list(spans),
            scales=[found.scales(a, b) for a, b in plan.spans],
            blocks_before=sizes.num_blocks,
            blocks_after=sizes.num_blocks - plan.blocks_removed,
            params_before=sizes.params,
            params_after=params_after,
            rows=found.rows,
        )

    def apply(self, model: nn.Module, plan: Plan, stats: Stats, layout: Layout) -> None:
        assert isinstance(stats, LinearPatchStats) and stats.statistics is not None
        translators = patch_translators(stats.statistics, plan.spans)
        replace_spans(model, list(plan.spans), translators, blocks=layout.stack)

    def calibrate_from_disk(
        self,
        disk: DiskModel,
        data: Iterable,
        layout: Layout,
        shared: Shared | None,
        calibration: Calibration,
        max_blocks: int,
    ) -> LinearPatchStats:
        """The statistics :meth:`calibrate` forms, from one sweep over the
        checkpoint's blocks (no shared pass: it needs none)."""
        reach, note = _reach(layout, max_blocks)
        if reach < 1:
            return LinearPatchStats(note=note)
        stats = measure_patch_statistics_from_disk(disk, data, calibration, reach, self.rotate)
        return LinearPatchStats(passes=1, note=note, statistics=stats)

    def edits(self, disk: DiskModel, plan: Plan, stats: Stats) -> BlockEdits:
        """Each window skipped and its patch applied to the window's input,
        in the dtype the blocks compute in (as the patched model runs it)."""
        assert isinstance(stats, LinearPatchStats) and stats.statistics is not None
        translators = patch_translators(stats.statistics, plan.spans)
        return replaced(plan.spans, [translator_module(t, dtype=disk.dtype) for t in translators])

    def save_from_disk(
        self,
        disk: DiskModel,
        plan: Plan,
        stats: Stats,
        output: str | os.PathLike,
        report: str | None = None,
    ) -> Path:
        """The folder :func:`toast.save_pretrained` writes for the patched
        model: the same translator block in each window's place (in the
        checkpoint's dtype), every other tensor copied from the checkpoint."""
        assert isinstance(stats, LinearPatchStats) and stats.statistics is not None
        translators = patch_translators(stats.statistics, plan.spans)
        return save_translated_from_disk(disk, output, list(plan.spans), translators, report)


def _reach(layout: Layout, max_blocks: int) -> tuple[int, str]:
    """How many blocks a window may remove (windows start at block 1 and
    end before the last: at most ``L − 2``), and why it is fewer than asked."""
    reach = min(max_blocks, layout.num_blocks - 2)
    if reach < 1:
        return reach, f"linearpatch: {layout.num_blocks} blocks leave no window"
    note = ""
    if reach < max_blocks:
        note = (
            f"linearpatch: a window of {layout.num_blocks} blocks starts at block 1 and ends "
            f"before the last, so it removes at most {reach}"
        )
    return reach, note


STAGES = LinearPatchStages()
