"""Sub-layer pruning's stages: nothing shared, a scoring pass of its own
(:func:`~toast.methods.sublayer.scores.sublayer_scores`), plans removing
the ``k`` lowest-scored attention sub-layers, MLP sub-layers or either,
each with its exact size and the summed scores as its prediction, and the
removal by module replacement.

From a checkpoint on disk (the default ``selection="score"``) the scores
come from one sweep over the blocks, the plan is measured with the
sub-layers' weights zeroed as their blocks load, and the folder is
written as :func:`toast.save_pretrained` writes the pruned model. The
measured greedy needs the model in memory (a sweep over every block per
candidate per step): left out of a search on disk, refused by
``compress`` with that reason."""

from __future__ import annotations

import dataclasses
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
from toast.hf.model.blocks import BlockStack, find_blocks
from toast.io.from_disk import save_edited_from_disk
from toast.methods.stages import BaseStages, Layout, Plan, Request, Shared, Sizes, Stats
from toast.methods.sublayer.config import SublayerConfig
from toast.methods.sublayer.part import SublayerPart, removed_sublayers
from toast.methods.sublayer.parts import (
    KINDS,
    SubLayer,
    find_sublayers,
    remove_sublayer,
    sublayer_params,
    zero_branch,
)
from toast.methods.sublayer.scores import (
    greedy_measured,
    sublayer_scores,
    sublayer_scores_from_disk,
)
from toast.spans import Span

__all__ = [
    "FAMILY",
    "STAGES",
    "SublayerStages",
    "SublayerStats",
    "allowed_kinds",
    "apply_sublayers",
    "lowest",
    "sublayer_plan",
]

#: The plans' family: one for every kind, since their scores compare.
FAMILY = "sublayer"


@dataclass
class SublayerStats(Stats):
    """Every sub-layer present (``subs``), its score (lower: removing it
    changes the residual stream less) and its parameters, in one order;
    under ``selection="measured"``, the greedy's picks (indices into
    ``subs``) and the calibration quality after each."""

    subs: list[SubLayer] = field(default_factory=list)
    scores: np.ndarray = field(default_factory=lambda: np.empty(0), repr=False)
    params: list[int] = field(default_factory=list)
    picked: list[int] | None = None
    qualities: list[float] = field(default_factory=list)


def allowed_kinds(kind: str | None) -> tuple[str, ...]:
    """The sub-layer kinds ``kind`` lets go (``"any"`` or None: every one)."""
    return KINDS if kind in (None, "any") else (kind,)


def lowest(stats: SublayerStats, kind: str, count: int) -> list[int]:
    """Indices (into ``stats.subs``) of the ``count`` lowest-scored
    sub-layers of ``kind`` (``"any"``: either), lowest first; ties go to
    the earlier sub-layer. Fewer when fewer have a finite score."""
    allowed = allowed_kinds(kind)
    pool = [
        i
        for i, s in enumerate(stats.subs)
        if s.kind in allowed and math.isfinite(float(stats.scores[i]))
    ]
    pool.sort(key=lambda i: (float(stats.scores[i]), i))
    return pool[:count]


def sublayer_plan(stats: SublayerStats, chosen: Sequence[int], sizes: Sizes) -> Plan:
    """The plan removing ``stats.subs[i]`` for each ``i`` of ``chosen``
    (in block order), its size exact and its prediction the summed scores."""
    order = sorted(chosen, key=lambda i: (stats.subs[i].block, KINDS.index(stats.subs[i].kind)))
    return Plan(
        (FAMILY,),
        FAMILY,
        (),
        None,
        sizes.params - sum(stats.params[i] for i in order),
        float(sum(stats.scores[i] for i in order)),
        parts=(SublayerPart(tuple((stats.subs[i].block, stats.subs[i].kind) for i in order)),),
    )


class SublayerStages(BaseStages):
    """Sub-layer pruning as stages (family :data:`FAMILY`); configured by
    :class:`~toast.methods.sublayer.config.SublayerConfig`, the plans of its
    ``kind`` alone, and under ``selection="measured"`` its greedy's (a pass
    per remaining sub-layer per step, family ``"sublayer-measured"``).
    Runs from disk by score."""

    from_disk = True

    def __init__(self, kind: str | None = None, selection: str = "score") -> None:
        self.kind, self.selection = kind, selection
        if selection == "measured":  # what compress's refusal on the disk path says
            self.in_memory_because = (
                "selection='measured' measures the model once per remaining sub-layer per "
                "step, a sweep over every block each on a checkpoint on disk; "
                "selection='score' runs block by block"
            )

    def configured(self, config: SublayerConfig) -> SublayerStages:
        return SublayerStages(config.kind, config.selection)

    def request(self, config: SublayerConfig) -> Request:
        return Request(count=config.num_sublayers)

    def amount(self, plan: Plan) -> int:
        return len(removed_sublayers(plan))

    def check(self, request: Request, layout: Layout) -> None:
        """A count beyond the sub-layers of the kind fails before the pass."""
        subs = layout.part(FAMILY)
        if subs is None:  # a layout it cannot split: the error says which it can
            subs = find_sublayers(layout.stack)
        kind = self.kind or "any"
        pool = [s for s in subs if s.kind in allowed_kinds(kind)]
        n = request.count
        if n is not None and n > len(pool):
            what = "sub-layers" if kind == "any" else f"{kind} sub-layers"
            raise ValueError(
                f"num_sublayers={n} but the model has {len(pool)} {what}; give "
                f"num_sublayers <= {len(pool)}" + ("" if kind == "any" else " or kind='any'")
            )

    def structure(self, model: nn.Module, stack: BlockStack) -> list[SubLayer] | None:
        try:
            return find_sublayers(stack)
        except ValueError:
            return None  # not a pre-norm layout it can split: it proposes nothing

    def calibrate(
        self,
        model: nn.Module,
        data: Iterable,
        layout: Layout,
        shared: Shared | None,
        calibration: Calibration,
        max_blocks: int,
    ) -> SublayerStats:
        subs = layout.part(FAMILY)
        if not subs:
            return SublayerStats(note=_NONE)
        scores = sublayer_scores(model, data, layout.stack, subs, calibration)
        stats = _scored(layout, subs, scores)
        if self.selection == "measured":
            pool = [s for s in subs if s.kind in allowed_kinds(self.kind)]
            picked, stats.qualities = greedy_measured(
                model, data, layout.stack, pool, max_blocks, calibration
            )
            index = {id(s): i for i, s in enumerate(subs)}
            stats.picked = [index[id(s)] for s in picked]
            stats.passes += sum(len(pool) - k for k in range(max_blocks)) + 1
        return stats

    def propose(self, stats: Stats, sizes: Sizes, max_blocks: int, macs_matter: bool) -> list[Plan]:
        """For each kind and each ``k`` up to twice ``max_blocks`` (a
        sub-layer is about half a block), the ``k`` lowest-scored."""
        assert isinstance(stats, SublayerStats)
        if stats.picked is not None:
            return _measured_plans(stats, sizes, max_blocks)
        plans: dict[str, Plan] = {}
        for kind in ("attention", "mlp", "any") if self.kind is None else (self.kind,):
            for count in range(1, 2 * max_blocks + 1):
                chosen = lowest(stats, kind, count)
                if len(chosen) < count:
                    break
                plan = sublayer_plan(stats, chosen, sizes)
                plans.setdefault(plan.key, plan)
        return list(plans.values())

    def apply(self, model: nn.Module, plan: Plan, stats: Stats, layout: Layout) -> None:
        apply_sublayers(layout.stack, removed_sublayers(plan))

    def report(
        self, plan: Plan, stats: Stats, sizes: Sizes, spans: Sequence[Span], params_after: int
    ) -> Any:
        from toast.methods.sublayer.report import RemovedSublayer, SublayerReport

        assert isinstance(stats, SublayerStats)
        where = {(s.block, s.kind): i for i, s in enumerate(stats.subs)}
        # lowest score first, as chosen (the plan keeps block order)
        chosen = sorted(
            (where[r] for r in removed_sublayers(plan)), key=lambda i: (stats.scores[i], i)
        )
        measured = dict(zip(stats.picked or (), stats.qualities, strict=False))
        removed = [
            RemovedSublayer(
                stats.subs[i].block,
                stats.subs[i].kind,
                stats.params[i],
                float(stats.scores[i]),
                measured.get(i, math.nan),
            )
            for i in (stats.picked[: len(chosen)] if stats.picked is not None else chosen)
        ]
        return SublayerReport(
            method="sublayer",
            selection=self.selection,
            removed=removed,
            sublayers_before=len(stats.subs),
            blocks_before=sizes.num_blocks,
            blocks_after=sizes.num_blocks,
            params_before=sizes.params,
            params_after=params_after,
        )

    def calibrate_from_disk(
        self,
        disk: DiskModel,
        data: Iterable,
        layout: Layout,
        shared: Shared | None,
        calibration: Calibration,
        max_blocks: int,
    ) -> SublayerStats | None:
        """The scores :meth:`calibrate` forms, from one sweep over the
        checkpoint's blocks; None under ``selection="measured"``."""
        if self.selection == "measured":
            return None
        subs = layout.part(FAMILY)
        if not subs:
            return SublayerStats(note=_NONE)
        return _scored(layout, subs, sublayer_scores_from_disk(disk, data, subs, calibration))

    def edits(self, disk: DiskModel, plan: Plan, stats: Stats) -> BlockEdits:
        """The plan's sub-layers zeroed by their weights as their blocks load
        (:func:`~toast.methods.sublayer.parts.zero_branch`)."""
        assert isinstance(stats, SublayerStats)
        where = {(s.block, s.kind): s for s in stats.subs}
        removed: dict[int, list[SubLayer]] = {}
        for block, kind in removed_sublayers(plan):
            removed.setdefault(block, []).append(where[(block, kind)])

        def zero(index: int, block: nn.Module) -> None:
            for sub in removed.get(index, ()):
                zero_branch(block, sub)

        return BlockEdits(edit=zero)

    def save_from_disk(
        self,
        disk: DiskModel,
        plan: Plan,
        stats: Stats,
        output: str | os.PathLike,
        report: str | None = None,
    ) -> Path:
        """The folder :func:`toast.save_pretrained` writes for the pruned
        model: the sub-layers removed from the model built on the meta
        device, every kept tensor copied from the checkpoint."""
        path = disk.stack.path

        def remove(model: nn.Module) -> None:
            apply_sublayers(find_blocks(model, path), removed_sublayers(plan))

        return save_edited_from_disk(disk, output, remove, report)


_NONE = "no attention or MLP sub-layer it can remove"


def _scored(layout: Layout, subs: Sequence[SubLayer], scores: np.ndarray) -> SublayerStats:
    """The stats of one scoring pass: every sub-layer, its score and its
    parameters (counted on the model's blocks: a skeleton's count the same)."""
    blocks = layout.stack.blocks
    return SublayerStats(
        passes=1,
        subs=list(subs),
        scores=scores,
        params=[sublayer_params(blocks[s.block], s) for s in subs],
    )


def apply_sublayers(stack: BlockStack, removed: Iterable[tuple[int, str]]) -> None:
    """Removes each ``(block, kind)`` sub-layer of ``stack``'s blocks, in
    place (a ``ValueError`` when one is not there to remove)."""
    present = {(s.block, s.kind): s for s in find_sublayers(stack)}
    for block, kind in removed:
        sub = present.get((block, kind))
        if sub is None:
            raise ValueError(f"block {block} has no {kind} sub-layer left to remove")
        remove_sublayer(stack.blocks[block], sub)


def _measured_plans(stats: SublayerStats, sizes: Sizes, max_blocks: int) -> list[Plan]:
    """The greedy's first ``k`` picks for every ``k`` it made (family
    ``"sublayer-measured"``, one plan a count, so its prediction, the
    calibration quality after step ``k``, orders nothing)."""
    assert stats.picked is not None
    plans = []
    for k in range(1, len(stats.picked) + 1):
        plan = sublayer_plan(stats, stats.picked[:k], sizes)
        quality = stats.qualities[k - 1]
        plans.append(
            dataclasses.replace(plan, family=f"{FAMILY}-measured", predicted_error=quality)
        )
    return plans


STAGES = SublayerStages()
