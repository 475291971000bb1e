"""``toast.compress(..., method="remove")``: plain block removal, the
baseline, through the same stages the search runs (calibrate, the best
plan of the size asked, apply)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from toast.hf.model.blocks import find_blocks
from toast.hf.model.params import count_params
from toast.methods.base import (
    BeforeSurgery,
    Layout,
    Method,
    Plan,
    Report,
    Sizes,
    capture_shared,
    register,
)
from toast.methods.remove.config import RemoveConfig
from toast.methods.remove.stages import STAGES, RemoveStats
from toast.spans import Span, validate_spans

__all__ = ["METHOD", "RemoveReport", "remove"]


@dataclass
class RemoveReport(Report):
    """What plain removal did: the spans deleted, with their identity-span
    error when they were chosen from the data (NaN when given)."""

    method: str
    spans: list[Span]
    blocks_before: int
    blocks_after: int
    params_before: int
    params_after: int

    def to_markdown(self) -> str:
        lines = [
            f"**{self.method}**: {self.blocks_removed} of {self.blocks_before} blocks removed.",
            "",
            "| blocks | paper (s→e) | identity error |",
            "|---|---|---:|",
            *(f"| [{s.start}:{s.stop}] | {s.paper} | {s.error:.4g} |" for s in self.spans),
            "",
            self.params_line(),
        ]
        return "\n".join(lines) + self.quality_markdown()


def _plan(
    model: nn.Module, data: Iterable | None, config: RemoveConfig, layout: Layout, sizes: Sizes
) -> tuple[Plan, RemoveStats]:
    """The plan: the given spans, else calibrate and take the best-predicted
    of the plans removing exactly ``num_blocks`` (the search's stages)."""
    if config.spans is not None:
        spans = tuple(validate_spans(config.spans, layout.num_blocks))
        after = sizes.after_spans(spans)
        return Plan(("remove",), "plain", spans, "identity", None, after, math.nan), RemoveStats()
    n = config.num_blocks
    assert n is not None  # the config holds one of the two
    if data is None:
        raise ValueError("method='remove' with num_blocks= needs calibration data (or spans=)")
    if n >= layout.num_blocks:
        raise ValueError(f"num_blocks={n} leaves no block of {layout.num_blocks}; remove fewer")
    shared = capture_shared(model, data, layout, config.calibration, config.backend)
    stats = STAGES.calibrate(model, data, layout, shared, config.calibration, n)
    plans = [p for p in STAGES.propose(stats, sizes, n, False) if p.blocks_removed == n]
    if not plans:
        raise ValueError(f"no plan removes {n} blocks with finite error; remove fewer")
    return min(plans, key=lambda p: (p.predicted_error, p.key)), stats


def remove(
    model: nn.Module,
    data: Iterable | None,
    config: RemoveConfig,
    before_surgery: BeforeSurgery | None = None,
) -> tuple[nn.Module, RemoveReport]:
    """Deletes the chosen blocks of ``model``, in place (see
    :class:`RemoveConfig`): calibrate, best plan, apply."""
    layout = Layout(find_blocks(model, config.calibration.blocks))
    sizes = Sizes(count_params(model), tuple(count_params(b) for b in layout.stack.blocks))
    plan, stats = _plan(model, data, config, layout, sizes)
    errors = stats.errors if stats.errors.size else None
    spans = [Span(a, b, math.nan if errors is None else float(errors[a, b])) for a, b in plan.spans]
    if before_surgery is not None:
        before_surgery(spans, layout.stack)
    STAGES.apply(model, plan, stats, layout)
    report = RemoveReport(
        method="remove",
        spans=spans,
        blocks_before=sizes.num_blocks,
        blocks_after=sizes.num_blocks - plan.blocks_removed,
        params_before=sizes.params,
        params_after=count_params(model),
    )
    return model, report


METHOD = register(
    Method(
        name="remove",
        config=RemoveConfig,
        run=remove,
        needs_data=False,
        summary="delete the blocks whose output is nearest their input (the baseline)",
        stages=STAGES,
    )
)
