"""``toast.compress(..., method="remove")``: plain block removal, the
baseline, through the same stages the search runs."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from toast.hf.blocks import find_blocks
from toast.hf.params import count_params
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
from toast.spans import Span, plan_spans, validate_spans

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


def _chosen(
    model: nn.Module, data: Iterable | None, config: RemoveConfig, layout: Layout
) -> list[Span]:
    """The spans to delete: the given ones, else the exact plan of
    ``num_blocks`` under the identity-span error."""
    if config.spans is not None:
        given = validate_spans(config.spans, layout.num_blocks)
        return [Span(a, b, float("nan")) for a, b in given]
    assert config.num_blocks is not None  # the config holds one of the two
    if data is None:
        raise ValueError("method='remove' with num_blocks= needs calibration data (or spans=)")
    if config.num_blocks >= layout.num_blocks:
        raise ValueError(
            f"num_blocks={config.num_blocks} leaves no block of {layout.num_blocks}; remove fewer"
        )
    shared = capture_shared(model, data, layout, config.calibration, config.backend)
    stats = STAGES.calibrate(model, data, layout, shared, config.calibration, config.num_blocks)
    planned = plan_spans(stats.errors, max_blocks=config.num_blocks)
    if sum(s.num_blocks for s in planned) < config.num_blocks:
        raise ValueError(
            f"no plan removes {config.num_blocks} blocks with finite error; remove fewer"
        )
    return planned


def remove(
    model: nn.Module,
    data: Iterable | None,
    config: RemoveConfig,
    before_surgery: BeforeSurgery | None = None,
) -> tuple[nn.Module, RemoveReport]:
    """Deletes the chosen blocks of ``model``, in place (see :class:`RemoveConfig`)."""
    layout = Layout(find_blocks(model, config.calibration.blocks))
    spans = _chosen(model, data, config, layout)
    if before_surgery is not None:
        before_surgery(spans, layout.stack)
    sizes = Sizes(count_params(model), tuple(count_params(b) for b in layout.stack.blocks))
    pairs = tuple((s.start, s.stop) for s in spans)
    predicted = sum(s.error for s in spans)
    plan = Plan(("remove",), "plain", pairs, "identity", None, sizes.after_spans(pairs), predicted)
    STAGES.apply(model, plan, RemoveStats(), layout)
    report = RemoveReport(
        method="remove",
        spans=list(spans),
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
