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
        return RemoveStats(errors=identity_errors(shared))

    def propose(self, stats: Stats, sizes: Sizes, max_blocks: int, macs_matter: bool) -> list[Plan]:
        assert isinstance(stats, RemoveStats)
        return span_family_plans(
            "remove", "plain", stats.errors, "identity", sizes, max_blocks, extendable=True
        )

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


STAGES = RemoveStages()
