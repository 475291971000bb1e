"""LinearPatch's stages: its own pass (per-sample rotated magnitudes and
the similarity of every pair of states), the most similar windows of
every size as plans, and the window replaced by its patch when a plan is
applied. In memory only (on a checkpoint on disk the search leaves it out)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from torch import nn

from toast.core import Translator
from toast.hf.data.calibration import Calibration
from toast.hf.model.surgery import replace_spans
from toast.methods.linearpatch.statistics import PatchStatistics, measure_patch_statistics
from toast.methods.stages import ALTERNATIVES, BaseStages, Layout, Plan, Shared, Sizes, Stats

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
    """LinearPatch as stages (family ``"linearpatch"``)."""

    def calibrate(
        self,
        model: nn.Module,
        data: Iterable,
        layout: Layout,
        shared: Shared | None,
        calibration: Calibration,
        max_blocks: int,
    ) -> LinearPatchStats:
        stats = measure_patch_statistics(model, data, layout.stack, calibration, max_blocks)
        return LinearPatchStats(passes=1, statistics=stats)

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
                        None,
                        sizes.after_spans((window,), width * width),
                        1.0 - float(found.similarity[window]),
                    )
                )
        return plans

    def apply(self, model: nn.Module, plan: Plan, stats: Stats, layout: Layout) -> None:
        assert isinstance(stats, LinearPatchStats) and stats.statistics is not None
        translators = patch_translators(stats.statistics, plan.spans)
        replace_spans(model, list(plan.spans), translators, blocks=layout.stack)


STAGES = LinearPatchStages()
