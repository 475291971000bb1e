"""Plain removal's stages: the identity-span error of every span from the
shared pass, the exact plan and the best single spans of every size, and
the blocks deleted (on disk: skipped as the blocks load, and left out of
the written checkpoint)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from torch import nn

from toast.hf.capture.sequential import BlockEdits, DiskModel
from toast.hf.data.calibration import Calibration
from toast.hf.evaluate.from_disk import removal
from toast.hf.model.surgery import remove_blocks
from toast.io.pruned import write_pruned_checkpoint
from toast.methods.selection import lowest_blocks, runs
from toast.methods.stages import (
    BaseStages,
    Layout,
    Needs,
    Plan,
    Shared,
    Sizes,
    Stats,
    span_family_plans,
)

__all__ = ["STAGES", "RemoveStages", "RemoveStats", "identity_errors"]


@dataclass
class RemoveStats(Stats):
    """``errors[i, j]``: ``‖Y − X‖_F / ‖Y‖_F`` from state ``i`` to state ``j``;
    ``scores``: each span's score when a selection rule chose it instead."""

    errors: np.ndarray = field(default_factory=lambda: np.empty((0, 0)), repr=False)
    #: ShortGPT's Block Influence of every block, ``1 − mean cos(x_b, x_{b+1})``
    #: over every token (the shared pass's cosine metric)
    influence: np.ndarray | None = field(default=None, repr=False)
    scores: dict[tuple[int, int], float] = field(default_factory=dict)


def identity_errors(shared: Shared) -> np.ndarray:
    """``‖Y − X‖_F / ‖Y‖_F`` for every pair of states, from the core's
    ``mse`` (the mean of ``‖y − x‖²`` over rows; NaN where it is)."""
    norms = shared.state_traces()
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.sqrt(shared.errors("mse") * shared.moments.rows / norms[None, :])


class RemoveStages(BaseStages):
    """Plain removal as stages (family ``"plain"``)."""

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
    ) -> RemoveStats:
        assert shared is not None  # needs() asked for it
        cosine = shared.errors("cosine")
        influence = np.array([cosine[b, b + 1] for b in range(cosine.shape[0] - 1)])
        return RemoveStats(errors=identity_errors(shared), influence=influence)

    def propose(self, stats: Stats, sizes: Sizes, max_blocks: int, macs_matter: bool) -> list[Plan]:
        assert isinstance(stats, RemoveStats)
        plans = span_family_plans(
            "remove", "plain", stats.errors, "identity", sizes, max_blocks, extendable=True
        )
        return plans + _influence_plans(stats.influence, sizes, max_blocks)

    def apply(self, model: nn.Module, plan: Plan, stats: Stats, layout: Layout) -> None:
        remove_blocks(model, list(plan.spans), blocks=layout.stack)

    def calibrate_from_disk(
        self,
        disk: DiskModel,
        data: Iterable,
        layout: Layout,
        shared: Shared | None,
        calibration: Calibration,
        max_blocks: int,
    ) -> RemoveStats:
        # the shared pass is all it needs, and it came from disk already
        return self.calibrate(disk.model, data, layout, shared, calibration, max_blocks)

    def edits(self, disk: DiskModel, plan: Plan, stats: Stats) -> BlockEdits:
        return removal(plan.spans)

    def save_from_disk(
        self, disk: DiskModel, plan: Plan, stats: Stats, output: str | os.PathLike
    ) -> Path:
        """A standard checkpoint without the plan's blocks (the rest renumbered)."""
        renames, kept = disk.renumbered(b for a, z in plan.spans for b in range(a, z))
        return write_pruned_checkpoint(
            disk.checkpoint, output, renames, kept=kept, total=disk.num_blocks, progress=False
        )


def _influence_plans(influence: np.ndarray | None, sizes: Sizes, max_blocks: int) -> list[Plan]:
    """ShortGPT's plans (family ``"shortgpt"``): the ``n`` blocks of lowest
    Block Influence, block 0 kept, each run of them one span; predicted:
    their summed influence."""
    if influence is None:
        return []
    plans = []
    for n in range(1, min(max_blocks, len(influence) - 1) + 1):
        blocks = lowest_blocks(influence, n, 1)
        spans = tuple(runs(blocks))
        predicted = float(sum(influence[b] for b in blocks))
        params = sizes.after_spans(spans)
        plans.append(Plan(("remove",), "shortgpt", spans, "identity", None, params, predicted))
    return plans


STAGES = RemoveStages()
