"""``toast.compress(..., method="linearpatch")``: LinearPatch as published,
through the same stages the search runs (one pass, the most similar
window of the size asked, its patch in place)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import nn

from toast.hf.model.blocks import find_blocks
from toast.hf.model.params import count_params
from toast.methods.base import BeforeSurgery, Layout, Method, Plan, Report, Sizes, register
from toast.methods.linearpatch.config import LinearPatchConfig
from toast.methods.linearpatch.stages import STAGES, LinearPatchStats
from toast.methods.linearpatch.statistics import measure_patch_statistics
from toast.methods.runner import run_method, split_text_options
from toast.spans import Span, validate_spans

__all__ = ["METHOD", "LinearPatchReport", "linearpatch"]


@dataclass
class LinearPatchReport(Report):
    """What LinearPatch did: each window, its mean cosine similarity, and
    the spread of its scales ``d``."""

    method: str
    spans: list[Span]
    scales: list[np.ndarray]
    blocks_before: int
    blocks_after: int
    params_before: int
    params_after: int
    rows: int = 0

    def to_markdown(self) -> str:
        lines = [
            f"**{self.method}**: {self.blocks_removed} of {self.blocks_before} blocks replaced "
            f"by a Hadamard-basis scale (calibrated on {self.rows:,} tokens).",
            "",
            "| blocks | cosine similarity | scale d: min / median / max |",
            "|---|---:|---|",
            *(
                f"| [{s.start}:{s.stop}] | {1 - s.error:.4f} | "
                f"{d.min():.3g} / {np.median(d):.3g} / {d.max():.3g} |"
                for s, d in zip(self.spans, self.scales, strict=True)
            ),
            "",
            self.params_line(),
        ]
        return "\n".join(lines) + self.quality_markdown()


def _plan(
    model: nn.Module, data: Iterable | None, config: LinearPatchConfig, layout: Layout
) -> tuple[tuple[tuple[int, int], ...], LinearPatchStats]:
    """The windows (given, else the most similar of ``num_blocks``) and the
    pass's statistics."""
    if data is None:
        raise ValueError("LinearPatch needs calibration data (its scales come from it)")
    total = layout.num_blocks
    if config.spans is not None:
        spans = tuple((a, b) for a, b in validate_spans(config.spans, total))
        reach = max(b - a for a, b in spans)
    else:
        assert config.num_blocks is not None  # the config holds one of the two
        reach = config.num_blocks
        if reach > total - 2:
            raise ValueError(
                f"num_blocks={reach} leaves no window of {total} blocks that starts at block 1 "
                f"and ends before the last (LinearPatch's range); remove at most {total - 2}"
            )
    found = measure_patch_statistics(
        model, data, layout.stack, config.calibration, reach, config.rotate
    )
    if config.spans is None:
        spans = (found.windows(reach)[0],)
    return spans, LinearPatchStats(passes=1, statistics=found)


def _linearpatch(
    model: nn.Module,
    data: Iterable | None,
    config: LinearPatchConfig,
    before_surgery: BeforeSurgery | None = None,
) -> tuple[nn.Module, LinearPatchReport]:
    """The registered run (see :class:`LinearPatchConfig`)."""
    layout = Layout(find_blocks(model, config.calibration.blocks))
    sizes = Sizes(count_params(model), tuple(count_params(b) for b in layout.stack.blocks))
    spans, stats = _plan(model, data, config, layout)
    found = stats.statistics
    assert found is not None  # _plan measured it
    chosen = [Span(a, b, 1.0 - float(np.nan_to_num(found.similarity[a, b]))) for a, b in spans]
    if before_surgery is not None:
        before_surgery(chosen, layout.stack)
    plan = Plan(("linearpatch",), "linearpatch", spans, "linearpatch", None, 0, math.nan)
    STAGES.apply(model, plan, stats, layout)
    report = LinearPatchReport(
        method="linearpatch",
        spans=chosen,
        scales=[found.scales(a, b) for a, b in spans],
        blocks_before=sizes.num_blocks,
        blocks_after=find_blocks(model, layout.stack).num_blocks,
        params_before=sizes.params,
        params_after=count_params(model),
        rows=found.rows,
    )
    return model, report


def linearpatch(
    model: nn.Module,
    data: Any,
    config: LinearPatchConfig | None = None,
    *,
    heldout: Any = None,
    **params: Any,
) -> tuple[nn.Module, LinearPatchReport]:
    """Removes ``num_blocks`` blocks of ``model`` by LinearPatch, in place
    (see :class:`LinearPatchConfig`; ``data`` and ``heldout`` as in
    :func:`toast.compress`). Returns the model and its report."""
    text, params = split_text_options(params)
    if config is None:
        from toast.methods.base import make_config

        config = make_config(METHOD, params)
    elif params:
        raise TypeError("give either config= or its options as keywords, not both")
    _, report = run_method(METHOD, model, data, config, heldout=heldout, text=text)
    assert isinstance(report, LinearPatchReport)
    return model, report


METHOD = register(
    Method(
        name="linearpatch",
        config=LinearPatchConfig,
        run=_linearpatch,
        summary="replace the most similar window of blocks by a Hadamard-basis channel scale",
        stages=STAGES,
    )
)
