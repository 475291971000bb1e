"""One driver for a method's stages: what ``toast.compress`` runs for every
method without a driver of its own, over the stages ``toast.search`` runs.

A compression is calibrate → propose → choose → apply, whichever front
door asks for it:

1. the method's stages, configured by the user's config
   (:meth:`toast.methods.stages.BaseStages.configured`: the options the
   search leaves at their defaults), say what they need captured;
2. :func:`toast.methods.calibrate.calibrate` runs the one shared pass and
   the method's own (the search's calibration, the same code);
3. the stages propose their plans up to the size asked;
4. the stages' ``choose`` takes one (by default :func:`first_choice`: the
   best-predicted plan of the first family among those removing exactly
   the blocks asked, the sub-layers for ``sublayer``): the plan a search
   restricted to the method measures first (:func:`by_family` orders both),
   so ``compress(model, data, method=m, num_blocks=n)`` and
   ``search(model, data, heldout, methods=[m], target=f"blocks={n}",
   max_measured=1)`` build the same model;
5. the stages apply it in place, and report it.

Explicit spans skip the choice: the plan of exactly those spans is applied
(calibrated first only where applying it needs statistics).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from toast.methods.base import Report
from toast.methods.choice import by_family, first_choice
from toast.methods.stages import Plan, Request, Sizes, Stats

if TYPE_CHECKING:
    import os

    from torch import nn

    from toast.hf.capture.sequential import DiskModel
    from toast.hf.model.blocks import BlockStack
    from toast.methods.base import Method
    from toast.methods.stages import Layout, Stages
    from toast.spans import Span

__all__ = [
    "PlanReport",
    "Request",
    "disk_runner_of",
    "runner_of",
    "by_family",
    "compress_from_disk_with_stages",
    "compress_with_stages",
    "first_choice",
]


@dataclass
class PlanReport(Report):
    """What a method without a report of its own did: the plan applied."""

    method: str
    plan: Plan
    blocks_before: int
    blocks_after: int
    params_before: int
    params_after: int

    def to_markdown(self) -> str:
        removed = self.blocks_before - self.blocks_after
        head = f"**{self.method}**: {self.plan.label} ({removed} of {self.blocks_before} blocks)."
        return f"{head}\n\n{self.params_line()}{self.quality_markdown()}"


BeforeSurgery = Callable[["Sequence[Span]", "BlockStack"], None]


def compress_with_stages(
    method: Method,
    model: nn.Module,
    data: Iterable | None,
    config: Any,
    before_surgery: BeforeSurgery | None = None,
) -> tuple[nn.Module, Report]:
    """``method`` on ``model`` through its stages configured by ``config``
    (see the module docstring), in place; the model and the stages' report.
    ``before_surgery(spans, stack)`` runs just before the model changes (the
    runner measures plain removal of the same blocks there)."""
    from toast.hf.model.params import count_params
    from toast.methods.base import find_layout
    from toast.methods.calibrate import calibrate, model_sizes

    stages = method.stages.configured(config)
    calibration = config.calibration
    layout = stages.layout(model, calibration.blocks)
    if layout is None:
        layout = find_layout(model, calibration.blocks)
    sizes = model_sizes(model, layout)

    def calibrated(reach: int) -> Stats | None:
        backend = getattr(config, "backend", "auto")
        staged = [_Staged(method.name, stages)]
        # None only where the stages calibrate without data (data_optional): no shared pass
        given = cast("Iterable", data)
        return calibrate(model, given, layout, staged, calibration, backend, reach).stats[
            method.name
        ]

    plan, stats = _choose(
        method.name, stages, data, layout, sizes, stages.request(config), calibrated
    )
    spans = _spans(stages, plan, stats)
    if before_surgery is not None and spans:  # no block goes: no plain removal to measure
        before_surgery(spans, layout.stack)
    stages.apply(model, plan, stats, layout)
    stages.finish(model, plan, stats, layout)
    return model, _report(method.name, stages, plan, stats, sizes, spans, count_params(model))


def compress_from_disk_with_stages(
    method: Method,
    disk: DiskModel,
    data: Iterable,
    output: str | os.PathLike | None,
    config: Any,
    *,
    heldout: Iterable | None = None,
    stages: Stages | None = None,
) -> Report:
    """:func:`compress_with_stages` on the checkpoint ``disk``, block by
    block, never loaded: the same calibration from disk, the same choice,
    the planned model written to the new folder ``output`` (None: nothing
    written, the report alone); ``heldout`` adds the original's, plain
    removal's and the result's quality, measured block by block (scratch
    under the config's ``buffer_dir``, if it has one); ``stages``: the
    method's stages configured already (default: by ``config``). Returns
    the report."""
    from toast.hf.evaluate.from_disk import measure_from_disk, removal
    from toast.methods.base import find_layout
    from toast.methods.calibrate import calibrate_from_disk, model_sizes

    assert method.stages.from_disk  # disk_runner_of checked
    if stages is None:
        stages = method.stages.configured(config)
    calibration = config.calibration
    layout = find_layout(disk.model, disk.stack)  # found when the checkpoint opened
    sizes = model_sizes(disk.model, layout)

    def calibrated(reach: int) -> Stats | None:
        backend = getattr(config, "backend", "auto")
        staged = [_Staged(method.name, stages)]
        found = calibrate_from_disk(disk, data, layout, staged, calibration, backend, reach)
        return found.stats.get(method.name)

    plan, stats = _choose(
        method.name, stages, data, layout, sizes, stages.request(config), calibrated
    )
    stages.prepare_from_disk(disk, plan, stats)
    spans = _spans(stages, plan, stats)
    report = _report(method.name, stages, plan, stats, sizes, spans, plan.params_after)
    if heldout is not None:  # a plan removing no block has no plain removal (as in memory)
        report.quality = measure_from_disk(
            disk,
            heldout,
            removal(plan.spans) if plan.spans else None,
            stages.edits(disk, plan, stats),
            progress=calibration.progress,
            buffer_dir=getattr(config, "buffer_dir", None),
        )
    if output is not None:
        stages.save_from_disk(disk, plan, stats, output, report.to_markdown())
    return report


def _choose(
    name: str,
    stages: Stages,
    data: Iterable | None,
    layout: Layout,
    sizes: Sizes,
    request: Request,
    calibrated: Callable[[int], Stats | None],
) -> tuple[Plan, Stats]:
    """The plan the request chooses and the statistics applying it reads
    (``calibrated(reach)``: the method's calibration, in memory or from
    disk; None where the method cannot calibrate there; without data only
    where the stages say it runs without)."""
    stages.check(request, layout)
    stats: Stats | None
    if not stages.needs_data(request):
        stats = Stats()
    elif data is None and not stages.data_optional(request):
        what = "its size" if request.spans is None else "spans= (its statistics)"
        raise ValueError(
            f"method={name!r} with {what} needs calibration data (a loader of batches, "
            "or raw text with tokenizer=)"
        )
    else:
        stats = calibrated(stages.reach(request))
    if stats is None:
        why = getattr(stages, "in_memory_because", "")  # BaseStages: ""
        raise ValueError(
            f"method={name!r} with these options needs the model in memory"
            f"{f' ({why})' if why else ''}: pass sequential=False, or max_memory= enough "
            "to load it"
        )
    if request.spans is not None:
        return stages.given(request.spans, stats, sizes), stats
    plans = stages.propose(stats, sizes, request.reach, False)
    chosen = stages.choose(plans, request)
    if chosen is None:
        note = f" ({stats.note})" if stats.note else ""
        raise ValueError(
            f"method={name!r} has no plan of the size asked ({request.count}) with a finite "
            f"predicted error{note}; remove fewer"
        )
    return chosen, stats


def _spans(stages: Stages, plan: Plan, stats: Stats) -> list[Span]:
    """The plan's spans with the scores its report shows."""
    from toast.spans import Span

    scores = stages.scores(plan, stats)
    return [Span(a, b, score) for (a, b), score in zip(plan.spans, scores, strict=True)]


def _report(
    name: str,
    stages: Stages,
    plan: Plan,
    stats: Stats,
    sizes: Sizes,
    spans: list[Span],
    params_after: int,
) -> Report:
    """The stages' report of the applied plan, else the driver's own."""
    report = stages.report(plan, stats, sizes, spans, params_after)
    if report is None:
        blocks_after = sizes.num_blocks - plan.blocks_removed
        report = PlanReport(name, plan, sizes.num_blocks, blocks_after, sizes.params, params_after)
    return report


@dataclass(frozen=True)
class _Staged:
    """A method's name with its configured stages, as calibration reads a
    registered method."""

    name: str
    stages: Stages


def runner_of(method: Method) -> Callable[..., tuple[nn.Module, Report]]:
    """What compresses a model in memory with ``method``: the one driver
    over its stages."""
    return functools.partial(compress_with_stages, method)


def disk_runner_of(method: Method) -> Callable[..., Report] | None:
    """What compresses a checkpoint block by block with ``method``: the one
    driver over its stages, where they run from disk; None where the
    method needs the model in memory."""
    if not method.stages.from_disk:
        return None
    return functools.partial(compress_from_disk_with_stages, method)
