"""ReplaceMe as the user configured it: the stages ``toast.compress(...,
method="replaceme")`` runs through the one driver (:mod:`toast.methods.driver`),
in memory and block by block from disk.

The search's stages (:mod:`toast.methods.replaceme.stages`) read the shared
pass and fit the best windows of every size; a user's
:class:`~toast.methods.replaceme.config.ReplaceMeConfig` asks for more (its
own profile pass, candidate windows measured on held-out calibration
batches, placements measured against each other, every fit checked against
plain removal, sequential fits), all of which chooses the cut and its
transform together. So :meth:`ConfiguredReplaceMe.calibrate` runs that whole
choice, its own passes only (``needs()`` asks for no shared pass), and
leaves it in :class:`ReplaceMeRun`; ``propose`` gives the one plan it
chose and ``choose`` takes it; ``apply`` folds (or, with ``fit="sequential"``,
fits each cut on the model with the previous ones made, which needs the
model the surgery changes); ``report`` is :class:`ReplaceMeReport`. From
disk the same choice runs block by block
(:func:`toast.methods.replaceme.disk.fit_from_disk`), so the held-out
quality the driver measures through ``edits`` is that of the checked fits.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from toast.hf.capture.sequential import BlockEdits, DiskModel
from toast.hf.data.calibration import Calibration
from toast.hf.evaluate.check import CheckSplit
from toast.hf.model.blocks import BlockStack, find_blocks
from toast.methods.replaceme.auto import (
    AutoResult,
    first_because,
    fit_placements,
    placement_options,
    resolved,
)
from toast.methods.replaceme.config import ReplaceMeConfig
from toast.methods.replaceme.cuts import candidate_cuts, choose_cuts, unmeasured_cut
from toast.methods.replaceme.disk import (
    check_supported,
    cut_edits,
    fit_from_disk,
    write_replaceme,
)
from toast.methods.replaceme.estimate import Estimation, Fitted, check_note, fits_sequentially
from toast.methods.replaceme.fold import apply_cuts, check_cuts
from toast.methods.replaceme.profile import DistanceProfile
from toast.methods.replaceme.report import ReplaceMeReport
from toast.methods.stages import BaseStages, Layout, Needs, Plan, Request, Shared, Sizes, Stats
from toast.spans import Span

__all__ = ["ConfiguredReplaceMe", "ReplaceMeRun", "choose_in_memory", "fit_sequentially"]


@dataclass
class ReplaceMeRun(Stats):
    """What a configured ReplaceMe chose in its calibration: the cuts, their
    fits and how they were chosen (``chosen``; its estimation carries the
    placement used), the distance profile (None for given spans or another
    selection rule), why nothing was checked on held-out batches
    (``check_note``), whether the cuts are fitted one after the other at
    the surgery (``sequential``), the blocks the model has after it (set
    by ``apply``: a ``"block"`` placement keeps a linear block per cut) and,
    from disk, the parameters before and after counted from the
    checkpoint's tensors."""

    chosen: AutoResult | None = None
    profile: DistanceProfile | None = None
    check_note: str = ""
    sequential: bool = False
    blocks_after: int | None = None
    checkpoint_params: tuple[int, int] | None = None


def choose_in_memory(
    model: nn.Module, data: Iterable, stack: BlockStack, config: ReplaceMeConfig
) -> ReplaceMeRun:
    """The cuts and transforms ``config`` asks for on ``model`` (profile,
    candidates, placements and checks against plain removal on held-out
    calibration batches), the model left intact."""
    split = CheckSplit(data, 0.0 if fits_sequentially(config) else config.check_fraction)
    spans, profile = choose_cuts(model, split.fit, config, stack)
    note = check_note(config, split, len(spans))
    spans, note = unmeasured_cut(spans, profile, config, note)
    pool = [] if note else candidate_cuts(profile, config)
    # the block placement is a candidate only where it can be measured
    options, why = placement_options(stack.blocks, pool or spans, config, with_block=not note)
    for placement, structure in options:
        check_cuts(stack, pool or spans, structure, placement, config.objective)
    expected_rows = profile.token_rows if profile is not None else None
    first = resolved(config, options[0])
    estimation = Estimation(model, split.fit, first, stack, expected_rows)
    fitting = config.objective != "identity"
    sequential = fitting and config.fit == "sequential" and len(spans) > 1
    if not fitting or sequential:
        said = first_because(why, *options[0], note) if len(options) > 1 else ""
        chosen = AutoResult(estimation, spans, [Fitted(None) for _ in spans], 0, [], [], said)
    else:
        chosen = fit_placements(estimation, options, why, spans, pool, split, note)
    return ReplaceMeRun(chosen=chosen, profile=profile, check_note=note, sequential=sequential)


def apply_fitted(estimation: Estimation, spans: Sequence[Span], fitted: Sequence[Fitted]) -> None:
    """The cuts made on the estimation's model, each T placed as its config says."""
    config = estimation.config
    transforms = [f.transform for f in fitted]
    apply_cuts(
        estimation.model, estimation.stack, spans, transforms, config.placement, config.structure
    )


def fit_sequentially(estimation: Estimation, spans: Sequence[Span]) -> tuple[list[Fitted], int]:
    """Each cut estimated on the model with the previous cuts applied (the
    reference code's cosine multi-LT): one pass per cut. Cuts are given in
    the original model's indices and shifted by the blocks removed before
    them (a translator block keeps one place per cut)."""
    fitted: list[Fitted] = []
    rows, removed = 0, 0
    for span in spans:
        shift = removed if estimation.config.placement != "block" else removed - len(fitted)
        where = Span(span.start - shift, span.stop - shift, span.error)
        (one,), used = estimation.fit([where])
        rows = max(rows, used)
        fitted.append(one)
        apply_fitted(estimation, [where], [one])
        estimation = estimation.after_surgery()  # the same path, the new block list
        removed += span.num_blocks
    return fitted, rows


def _run_of(stats: Stats) -> tuple[ReplaceMeRun, AutoResult]:
    assert isinstance(stats, ReplaceMeRun) and stats.chosen is not None
    return stats, stats.chosen


class ConfiguredReplaceMe(BaseStages):
    """ReplaceMe's stages carrying the user's ``config`` (see the module
    docstring): what ``toast.compress`` runs, in memory or from disk."""

    from_disk = True

    def __init__(self, config: ReplaceMeConfig, writes: bool = True) -> None:
        self.config = config
        #: whether the block-by-block path writes the result (a checkpoint
        #: takes the fold alone); :func:`~toast.methods.replaceme.from_disk.replaceme_from_disk`
        #: without ``output`` only measures, any placement
        self.writes = writes

    def configured(self, config: ReplaceMeConfig) -> ConfiguredReplaceMe:
        return ConfiguredReplaceMe(config, self.writes)

    def check(self, request: Request, layout: Layout) -> None:
        """Nothing here: the config's own checks (the cuts, the selection)
        run before the first pass of :meth:`calibrate`, with ReplaceMe's
        words."""
        return None

    def needs(self, layout: Layout) -> Needs:
        return Needs()  # every pass is its own

    def calibrate(
        self,
        model: nn.Module,
        data: Iterable,
        layout: Layout,
        shared: Shared | None,
        calibration: Calibration,
        max_blocks: int,
    ) -> ReplaceMeRun:
        return choose_in_memory(model, data, layout.stack, self.config)

    def calibrate_from_disk(
        self,
        disk: DiskModel,
        data: Iterable,
        layout: Layout,
        shared: Shared | None,
        calibration: Calibration,
        max_blocks: int,
    ) -> ReplaceMeRun:
        """:meth:`calibrate` block by block: the same choice and checks
        (what the block-by-block path cannot do refused before any pass)."""
        check_supported(self.config, self.writes)
        chosen, profile, note = fit_from_disk(disk, data, self.config)
        params = disk.params_without((s.start, s.stop) for s in chosen.spans)
        return ReplaceMeRun(
            chosen=chosen, profile=profile, check_note=note, checkpoint_params=params
        )

    def propose(self, stats: Stats, sizes: Sizes, max_blocks: int, macs_matter: bool) -> list[Plan]:
        """The one plan the calibration chose."""
        _, chosen = _run_of(stats)
        spans = tuple((s.start, s.stop) for s in chosen.spans)
        objective = chosen.estimation.config.objective
        after = sizes.after_spans(spans)
        return [Plan(("replaceme",), "replaceme", spans, objective, after, math.nan)]

    def choose(self, plans: Sequence[Plan], request: Request) -> Plan | None:
        """ReplaceMe's choice, made by its calibration (the cut and its fit
        measured together): the plan it proposed, whatever the count."""
        return plans[0] if plans else None

    def given(self, spans: tuple[tuple[int, int], ...], stats: Stats, sizes: Sizes) -> Plan:
        """The given spans as the calibration checked them (in cut order)."""
        (plan,) = self.propose(stats, sizes, 0, False)
        return plan

    def scores(self, plan: Plan, stats: Stats) -> list[float]:
        """Each cut's score by the rule that chose it (NaN for given spans)."""
        _, chosen = _run_of(stats)
        return [s.error for s in chosen.spans]

    def apply(self, model: nn.Module, plan: Plan, stats: Stats, layout: Layout) -> None:
        run, chosen = _run_of(stats)
        estimation = chosen.estimation
        assert isinstance(estimation, Estimation)
        if run.sequential:
            chosen.fitted, chosen.rows = fit_sequentially(estimation, chosen.spans)
        else:
            apply_fitted(estimation, chosen.spans, chosen.fitted)
        run.blocks_after = find_blocks(model, layout.stack).num_blocks

    def report(
        self, plan: Plan, stats: Stats, sizes: Sizes, spans: Sequence[Span], params_after: int
    ) -> ReplaceMeReport:
        run, chosen = _run_of(stats)
        if run.checkpoint_params is not None:  # from disk: counted from the tensors
            before, after = run.checkpoint_params
            blocks_after = sizes.num_blocks - sum(s.num_blocks for s in chosen.spans)
        else:
            assert run.blocks_after is not None  # apply() ran
            before, after, blocks_after = sizes.params, params_after, run.blocks_after
        return replaceme_report(run, (sizes.num_blocks, blocks_after), (before, after))

    def edits(self, disk: DiskModel, plan: Plan, stats: Stats) -> BlockEdits:
        _, chosen = _run_of(stats)
        transforms = [f.transform for f in chosen.fitted]
        return cut_edits(chosen.spans, transforms, chosen.estimation.config, disk.dtype)

    def save_from_disk(
        self,
        disk: DiskModel,
        plan: Plan,
        stats: Stats,
        output: str | os.PathLike,
        report: str | None = None,
    ) -> Path:
        """A standard checkpoint without the cut blocks, each T folded (no
        model card for ``report``, as the in-memory path's save)."""
        _, chosen = _run_of(stats)
        transforms = [f.transform for f in chosen.fitted]
        progress = self.config.calibration.progress
        return write_replaceme(disk, output, chosen.spans, transforms, progress=progress)


def replaceme_report(
    run: ReplaceMeRun, blocks: tuple[int, int], params: tuple[int, int]
) -> ReplaceMeReport:
    """The report of a configured run: its config as placed (the
    estimation's), the blocks and parameters before and after."""
    assert run.chosen is not None
    chosen, config = run.chosen, run.chosen.estimation.config
    fitted = chosen.fitted
    return ReplaceMeReport(
        objective=config.objective,
        structure=config.structure,
        placement=config.placement,
        metric=config.distance,
        spans=list(chosen.spans),
        transforms=[f.transform for f in fitted],
        conditions=[f.condition for f in fitted],
        objectives=[f.objective for f in fitted],
        blocks_before=blocks[0],
        blocks_after=blocks[1],
        params_before=params[0],
        params_after=params[1],
        rows=chosen.rows,
        profile=run.profile,
        buffer_bytes=sum(f.buffer_bytes for f in fitted),
        rows_kept=sum(f.rows_kept for f in fitted),
        fit=config.fit,
        checks=chosen.checks,
        check_note=run.check_note,
        candidates=chosen.candidates,
        placement_note=chosen.note,
        placements=chosen.trials,
        selection=config.selection if config.spans is None else "spans",
    )
