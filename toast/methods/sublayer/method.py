"""``toast.compress(..., method="sublayer")``: removes attention or MLP
sub-layers of transformer blocks (their residual passes through), chosen
by score in one calibration pass or by measured calibration quality, and
reports exactly what went."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from toast.hf.model.blocks import BlockStack, find_blocks
from toast.hf.model.params import count_params
from toast.methods.base import BeforeSurgery, Layout, Method, Report, Sizes, register
from toast.methods.sublayer import persist  # noqa: F401  (registers the "sublayer" model patch)
from toast.methods.sublayer.config import SublayerConfig
from toast.methods.sublayer.parts import KINDS, SubLayer, find_sublayers
from toast.methods.sublayer.scores import greedy_measured
from toast.methods.sublayer.stages import (
    FAMILY,
    STAGES,
    SublayerStats,
    apply_sublayers,
    lowest,
    sublayer_plan,
)

__all__ = ["METHOD", "RemovedSublayer", "SublayerReport", "sublayer"]


@dataclass(frozen=True)
class RemovedSublayer:
    """One removed sub-layer: its block, kind, parameters, score (NaN when
    not scored) and, under ``selection="measured"``, the calibration
    quality once it and those before it were removed (else NaN)."""

    block: int
    kind: str
    params: int
    score: float
    measured: float = math.nan


@dataclass
class SublayerReport(Report):
    """What sub-layer pruning did (blocks stay: ``blocks_after`` equals
    ``blocks_before``; the parameters say what went)."""

    method: str
    selection: str
    removed: list[RemovedSublayer]
    sublayers_before: int
    blocks_before: int
    blocks_after: int
    params_before: int
    params_after: int

    def to_markdown(self) -> str:
        lines = [
            f"**{self.method}**: {len(self.removed)} of {self.sublayers_before} sub-layers "
            f"removed (by {self.selection}); every block kept.",
            "",
            "| block | sub-layer | parameters | score (1 − cos) | measured |",
            "|---:|---|---:|---:|---:|",
            *(
                f"| {r.block} | {r.kind} | {r.params:,} | {r.score:.4g} | {r.measured:.4g} |"
                for r in self.removed
            ),
            "",
            self.params_line(),
        ]
        return "\n".join(lines) + self.quality_markdown()


def _candidates(subs: list[SubLayer], config: SublayerConfig) -> list[int]:
    """Indices of the sub-layers of the kind asked, checked to outnumber nothing."""
    allowed = KINDS if config.kind == "any" else (config.kind,)
    pool = [i for i, s in enumerate(subs) if s.kind in allowed]
    n = config.num_sublayers
    assert n is not None  # the config requires it
    if n > len(pool):
        what = "sub-layers" if config.kind == "any" else f"{config.kind} sub-layers"
        raise ValueError(
            f"num_sublayers={n} but the model has {len(pool)} {what}; give "
            f"num_sublayers <= {len(pool)}" + ("" if config.kind == "any" else " or kind='any'")
        )
    return pool


def _choose(
    model: nn.Module,
    data: Iterable,
    stack: BlockStack,
    stats: SublayerStats,
    config: SublayerConfig,
) -> tuple[list[int], list[float]]:
    """Indices into ``stats.subs`` of the sub-layers to remove (with the
    measured quality after each, under ``selection="measured"``)."""
    n = config.num_sublayers
    assert n is not None
    pool = _candidates(stats.subs, config)
    if config.selection == "score":
        chosen = lowest(stats, config.kind, n)
        if len(chosen) < n:
            raise ValueError(f"only {len(chosen)} sub-layers have a finite score; remove fewer")
        return chosen, [math.nan] * n
    picked, qualities = greedy_measured(
        model, data, stack, [stats.subs[i] for i in pool], n, config.calibration
    )
    index = {id(s): i for i, s in enumerate(stats.subs)}
    return [index[id(s)] for s in picked], qualities


def sublayer(
    model: nn.Module,
    data: Iterable | None,
    config: SublayerConfig,
    before_surgery: BeforeSurgery | None = None,
) -> tuple[nn.Module, SublayerReport]:
    """Removes the chosen sub-layers of ``model``, in place (see
    :class:`SublayerConfig`): score them, choose, replace their modules.
    No block goes, so ``before_surgery`` is never called."""
    if data is None:
        raise ValueError("method='sublayer' needs calibration data to choose the sub-layers")
    stack = find_blocks(model, config.calibration.blocks)
    subs = find_sublayers(stack)
    _candidates(subs, config)  # a bad num_sublayers fails before the pass
    layout = Layout(stack, {FAMILY: subs})
    sizes = Sizes(count_params(model), tuple(count_params(b) for b in stack.blocks))
    stats = STAGES.calibrate(model, data, layout, None, config.calibration, stack.num_blocks)
    chosen, qualities = _choose(model, data, stack, stats, config)
    plan = sublayer_plan(stats, chosen, sizes)
    apply_sublayers(stack, plan.sublayers or ())
    removed = [
        RemovedSublayer(
            stats.subs[i].block, stats.subs[i].kind, stats.params[i], float(stats.scores[i]), q
        )
        for i, q in zip(chosen, qualities, strict=True)
    ]
    report = SublayerReport(
        method="sublayer",
        selection=config.selection,
        removed=removed,
        sublayers_before=len(subs),
        blocks_before=stack.num_blocks,
        blocks_after=stack.num_blocks,
        params_before=sizes.params,
        params_after=count_params(model),
    )
    return model, report


METHOD = register(
    Method(
        name="sublayer",
        config=SublayerConfig,
        run=sublayer,
        summary="remove the attention or MLP sub-layers that turn the residual stream least",
        stages=STAGES,
    )
)
