"""Plain removal's stages: the identity-span error of every span from the
shared pass, the exact plan and the best single spans of every size, and
the blocks deleted (on disk: skipped as the blocks load, and left out of
the written checkpoint). Configured by :class:`RemoveConfig`'s
``selection``, they propose one rule's plans: the identity-span error's
(family ``"plain"``), ShortGPT's Block Influence (``"shortgpt"``, from the
same pass) or SLEB's greedy steps (``"sleb"``, a pass per remaining block
per step, no shared pass); the search's defaults propose the first two."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from toast.hf.capture.sequential import BlockEdits, DiskModel
from toast.hf.data.calibration import Calibration
from toast.hf.evaluate.from_disk import removal
from toast.hf.model.surgery import remove_blocks
from toast.io.pruned import write_pruned_checkpoint
from toast.methods.remove.config import RemoveConfig
from toast.methods.selection import lowest_blocks, runs, sleb, span_scores
from toast.methods.span_plans import span_family_plans
from toast.methods.stages import BaseStages, Layout, Needs, Plan, Request, Shared, Sizes, Stats
from toast.spans import Span, validate_spans

__all__ = ["STAGES", "RemoveStages", "RemoveStats", "identity_errors"]


@dataclass
class RemoveStats(Stats):
    """``errors[i, j]``: ``‖Y − X‖_F / ‖Y‖_F`` from state ``i`` to state ``j``;
    ``scores``: each span's score when a selection rule chose it instead."""

    errors: np.ndarray = field(default_factory=lambda: np.empty((0, 0)), repr=False)
    #: ShortGPT's Block Influence of every block, ``1 − mean cos(x_b, x_{b+1})``
    #: over every token (the shared pass's cosine metric)
    influence: np.ndarray | None = field(default=None, repr=False)
    #: SLEB's blocks in the order its greedy steps removed them, and the
    #: calibration metric after each step (None: SLEB did not run)
    sleb_order: list[int] | None = None
    sleb_scores: list[float] = field(default_factory=list)
    sleb_lower: bool = True  # SLEB's metric is lower-is-better (perplexity)


def identity_errors(shared: Shared) -> np.ndarray:
    """``‖Y − X‖_F / ‖Y‖_F`` for every pair of states, from the core's
    ``mse`` (the mean of ``‖y − x‖²`` over rows; NaN where it is)."""
    norms = shared.state_traces()
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.sqrt(shared.errors("mse") * shared.moments.rows / norms[None, :])


class RemoveStages(BaseStages):
    """Plain removal as stages; ``selection`` one of
    :data:`toast.methods.remove.config.SELECTIONS` proposes that rule's
    plans alone (None: the identity-span error's and ShortGPT's, what the
    search compares)."""

    from_disk = True

    def __init__(self, selection: str | None = None) -> None:
        self.selection = selection

    def configured(self, config: RemoveConfig) -> RemoveStages:
        return RemoveStages(config.selection)

    def needs_data(self, request: Request) -> bool:
        return request.spans is None  # given spans are deleted as they are

    def reach(self, request: Request) -> int:
        # Block Influence reads adjacent states alone: the shared pass need pair no others
        return 1 if self.selection == "block_influence" else request.reach

    def needs(self, layout: Layout) -> Needs:
        return Needs(moments=self.selection != "sleb")

    def calibrate(
        self,
        model: nn.Module,
        data: Iterable,
        layout: Layout,
        shared: Shared | None,
        calibration: Calibration,
        max_blocks: int,
    ) -> RemoveStats:
        if self.selection == "sleb":
            found = sleb(model, data, layout.stack, max_blocks, progress=calibration.progress)
            passes = (layout.num_blocks - 1) * max_blocks + 1  # bounded above: the greedy's
            lower = found.metric == "perplexity"
            return RemoveStats(
                passes=passes, sleb_order=found.order, sleb_scores=found.scores, sleb_lower=lower
            )
        assert shared is not None  # needs() asked for it
        cosine = shared.errors("cosine")
        influence = np.array([cosine[b, b + 1] for b in range(cosine.shape[0] - 1)])
        return RemoveStats(errors=identity_errors(shared), influence=influence)

    def propose(self, stats: Stats, sizes: Sizes, max_blocks: int, macs_matter: bool) -> list[Plan]:
        assert isinstance(stats, RemoveStats)
        if stats.sleb_order is not None:
            return _sleb_plans(stats, sizes, max_blocks)
        plans = []
        if self.selection in (None, "error"):
            plans = span_family_plans(
                "remove", "plain", stats.errors, "identity", sizes, max_blocks, extendable=True
            )
        if self.selection in (None, "block_influence"):
            plans += _influence_plans(stats.influence, sizes, max_blocks)
        return plans

    def given(self, spans: tuple[tuple[int, int], ...], stats: Stats, sizes: Sizes) -> Plan:
        spans = tuple(validate_spans(spans, sizes.num_blocks))
        after = sizes.after_spans(spans)
        return Plan(("remove",), "given", spans, "identity", after, math.nan)

    def scores(self, plan: Plan, stats: Stats) -> list[float]:
        """Each span's score in the report: the rule's (summed influence,
        SLEB's metric after its last step), else its identity-span error."""
        if not isinstance(stats, RemoveStats):  # given spans, nothing calibrated
            return [math.nan] * len(plan.spans)
        if plan.family == "shortgpt" and stats.influence is not None:
            return span_scores(stats.influence, plan.spans)
        if plan.family == "sleb":
            return [stats.sleb_scores[plan.blocks_removed - 1]] * len(plan.spans)
        if plan.family == "plain":
            return [float(stats.errors[a, b]) for a, b in plan.spans]
        return [math.nan] * len(plan.spans)

    def report(
        self, plan: Plan, stats: Stats, sizes: Sizes, spans: Sequence[Span], params_after: int
    ) -> Any:
        from toast.methods.remove.report import RemoveReport

        selection = {"plain": "error", "shortgpt": "block_influence", "sleb": "sleb"}
        return RemoveReport(
            method="remove",
            spans=list(spans),
            blocks_before=sizes.num_blocks,
            blocks_after=sizes.num_blocks - plan.blocks_removed,
            params_before=sizes.params,
            params_after=params_after,
            selection=selection.get(plan.family, "spans"),
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
    ) -> RemoveStats | None:
        if self.selection == "sleb":
            return None  # its greedy steps measure the loaded model
        # the shared pass is all it needs, and it came from disk already
        return self.calibrate(disk.model, data, layout, shared, calibration, max_blocks)

    def edits(self, disk: DiskModel, plan: Plan, stats: Stats) -> BlockEdits:
        return removal(plan.spans)

    def save_from_disk(
        self,
        disk: DiskModel,
        plan: Plan,
        stats: Stats,
        output: str | os.PathLike,
        report: str | None = None,
    ) -> Path:
        """A standard checkpoint without the plan's blocks (the rest
        renumbered; a plain checkpoint has no model card to hold ``report``)."""
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
        plans.append(Plan(("remove",), "shortgpt", spans, "identity", params, predicted))
    return plans


def _sleb_plans(stats: RemoveStats, sizes: Sizes, max_blocks: int) -> list[Plan]:
    """SLEB's plans (family ``"sleb"``): its first ``n`` greedy steps' blocks,
    each run of them one span; predicted: the metric after step ``n``
    (perplexity; the negated cosine where the metric is one, so that lower
    is better as for every prediction)."""
    assert stats.sleb_order is not None
    plans = []
    for n in range(1, min(max_blocks, len(stats.sleb_order)) + 1):
        spans = tuple(runs(sorted(stats.sleb_order[:n])))
        score = stats.sleb_scores[n - 1]
        predicted = score if stats.sleb_lower else -score
        params = sizes.after_spans(spans)
        plans.append(Plan(("remove",), "sleb", spans, "identity", params, predicted))
    return plans


STAGES = RemoveStages()
