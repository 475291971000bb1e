"""Sub-layer pruning's stages: nothing shared, a scoring pass of its own
(:func:`~toast.methods.sublayer.scores.sublayer_scores`), plans removing
the ``k`` lowest-scored attention sub-layers, MLP sub-layers or either,
each with its exact size and the summed scores as its prediction, and the
removal by module replacement."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from torch import nn

from toast.hf.data.calibration import Calibration
from toast.hf.model.blocks import BlockStack
from toast.methods.stages import BaseStages, Layout, Plan, Shared, Sizes, Stats
from toast.methods.sublayer.parts import (
    KINDS,
    SubLayer,
    find_sublayers,
    remove_sublayer,
    sublayer_params,
)
from toast.methods.sublayer.scores import sublayer_scores

__all__ = [
    "FAMILY",
    "STAGES",
    "SublayerStages",
    "SublayerStats",
    "apply_sublayers",
    "lowest",
    "sublayer_plan",
]

#: The plans' family: one for every kind, since their scores compare.
FAMILY = "sublayer"


@dataclass
class SublayerStats(Stats):
    """Every sub-layer present (``subs``), its score (lower: removing it
    changes the residual stream less) and its parameters, in one order."""

    subs: list[SubLayer] = field(default_factory=list)
    scores: np.ndarray = field(default_factory=lambda: np.empty(0), repr=False)
    params: list[int] = field(default_factory=list)


def lowest(stats: SublayerStats, kind: str, count: int) -> list[int]:
    """Indices (into ``stats.subs``) of the ``count`` lowest-scored
    sub-layers of ``kind`` (``"any"``: either), lowest first; ties go to
    the earlier sub-layer. Fewer when fewer have a finite score."""
    allowed = KINDS if kind == "any" else (kind,)
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
        None,
        sizes.params - sum(stats.params[i] for i in order),
        float(sum(stats.scores[i] for i in order)),
        sublayers=tuple((stats.subs[i].block, stats.subs[i].kind) for i in order),
    )


class SublayerStages(BaseStages):
    """Sub-layer pruning as stages (family :data:`FAMILY`)."""

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
            return SublayerStats(note="no attention or MLP sub-layer it can remove")
        blocks = layout.stack.blocks
        return SublayerStats(
            passes=1,
            subs=list(subs),
            scores=sublayer_scores(model, data, layout.stack, subs, calibration),
            params=[sublayer_params(blocks[s.block], s) for s in subs],
        )

    def propose(self, stats: Stats, sizes: Sizes, max_blocks: int, macs_matter: bool) -> list[Plan]:
        """For each kind and each ``k`` up to twice ``max_blocks`` (a
        sub-layer is about half a block), the ``k`` lowest-scored."""
        assert isinstance(stats, SublayerStats)
        plans: dict[str, Plan] = {}
        for kind in ("attention", "mlp", "any"):
            for count in range(1, 2 * max_blocks + 1):
                chosen = lowest(stats, kind, count)
                if len(chosen) < count:
                    break
                plan = sublayer_plan(stats, chosen, sizes)
                plans.setdefault(plan.key, plan)
        return list(plans.values())

    def apply(self, model: nn.Module, plan: Plan, stats: Stats, layout: Layout) -> None:
        apply_sublayers(layout.stack, plan.sublayers or ())


def apply_sublayers(stack: BlockStack, removed: Iterable[tuple[int, str]]) -> None:
    """Removes each ``(block, kind)`` sub-layer of ``stack``'s blocks, in
    place (a ``ValueError`` when one is not there to remove)."""
    present = {(s.block, s.kind): s for s in find_sublayers(stack)}
    for block, kind in removed:
        sub = present.get((block, kind))
        if sub is None:
            raise ValueError(f"block {block} has no {kind} sub-layer left to remove")
        remove_sublayer(stack.blocks[block], sub)


STAGES = SublayerStages()
