"""``toast.compress(..., method="remove")``: plain block removal, the
baseline, through the same stages the search runs (calibrate, the best
plan of the size asked, apply)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from toast.hf.model.blocks import BlockStack, find_blocks
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
from toast.methods.selection import block_influence, lowest_blocks, runs, sleb, span_scores
from toast.spans import Span, validate_spans

__all__ = ["METHOD", "RemoveReport", "remove"]


#: The column naming each span's score, by selection.
_SCORES = {"block_influence": "block influence (ShortGPT)", "sleb": "perplexity after SLEB"}


@dataclass
class RemoveReport(Report):
    """What plain removal did: the spans deleted, with the score that chose
    them (``selection``: identity-span error by default, summed block
    influence, SLEB's perplexity; NaN when given)."""

    method: str
    spans: list[Span]
    blocks_before: int
    blocks_after: int
    params_before: int
    params_after: int
    selection: str = "error"

    def to_markdown(self) -> str:
        score = _SCORES.get(self.selection, "identity error")
        lines = [
            f"**{self.method}**: {self.blocks_removed} of {self.blocks_before} blocks removed.",
            "",
            f"| blocks | paper (s→e) | {score} |",
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
    if config.selection != "error":
        spans, scores = _by_rule(model, data, config, layout.stack, n)
        plan = Plan(
            ("remove",), "plain", spans, "identity", None, sizes.after_spans(spans), math.nan
        )
        return plan, RemoveStats(scores=scores)
    shared = capture_shared(model, data, layout, config.calibration, config.backend)
    stats = STAGES.calibrate(model, data, layout, shared, config.calibration, n)
    plans = [p for p in STAGES.propose(stats, sizes, n, False) if p.blocks_removed == n]
    if not plans:
        raise ValueError(f"no plan removes {n} blocks with finite error; remove fewer")
    return min(plans, key=lambda p: (p.predicted_error, p.key)), stats


def _by_rule(
    model: nn.Module, data: Iterable, config: RemoveConfig, stack: BlockStack, n: int
) -> tuple[tuple[tuple[int, int], ...], dict[tuple[int, int], float]]:
    """The spans ``config.selection`` chooses (runs of the chosen blocks) and
    each one's score: summed block influence, or the perplexity SLEB
    measured after its last step."""
    if config.selection == "block_influence":
        influence = block_influence(model, data, config.calibration, stack)
        spans = runs(lowest_blocks(influence, n))
        return tuple(spans), dict(zip(spans, span_scores(influence, spans), strict=True))
    found = sleb(model, data, stack, n, progress=config.calibration.progress)
    spans = runs(found.blocks)
    return tuple(spans), {span: found.scores[-1] for span in spans}


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
    spans = [Span(a, b, _score(stats, a, b)) for a, b in plan.spans]
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
        selection=config.selection if config.spans is None else "spans",
    )
    return model, report


def _score(stats: RemoveStats, a: int, b: int) -> float:
    """The score that chose span ``(a, b)``: a rule's, else its
    identity-span error (NaN for given spans)."""
    if (a, b) in stats.scores:
        return stats.scores[(a, b)]
    return float(stats.errors[a, b]) if stats.errors.size else math.nan


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
