"""TOAST as ``toast.compress`` runs it: its stages configured by the
user's :class:`ToastConfig`, which the one driver
(:mod:`toast.methods.driver`) takes through calibrate → choose → apply,
in memory and on a checkpoint on disk.

Where the search's stages (:mod:`toast.methods.translate.stages`) read the
shared pass and compare translator families, a configured TOAST keeps the
rules its options ask for (:mod:`toast.methods.translate.rules`): its own
analysis (the config's metric, estimator, folds, tokens and pairs) on the
calibration batches it does not hold out, the spans of ``num_blocks`` /
``max_error`` / ``spans`` / ``single_window`` (with ``num_blocks`` and held-out batches: the
``candidates`` best predicted, each fitted and measured there, the best
measured kept), the config's translator
fitted (closed form, trained, or sequentially), each fit checked against
plain removal on the held-out batches (``check_fraction``, ``fallback``)
and the kept ones fitted again on every batch (``refit``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from toast.accounting import translator_params
from toast.core import Translator
from toast.hf.capture.disk_moments import capture_moments_from_disk
from toast.hf.capture.massive import MassiveRows
from toast.hf.capture.sequential import BlockEdits, DiskModel
from toast.hf.capture.states import capture_moments
from toast.hf.data.calibration import Calibration
from toast.hf.evaluate.check import (
    CheckSplit,
    RemovalCheck,
    unchecked_because,
)
from toast.hf.evaluate.from_disk import SequentialEvaluator
from toast.hf.model.surgery import replace_spans
from toast.io.from_disk import save_translated_from_disk
from toast.methods.stages import BaseStages, Layout, Needs, Plan, Request, Shared, Sizes, Stats
from toast.methods.translate.analysis import Analysis, analyze, analyze_from_disk
from toast.methods.translate.check import (
    MeasuredPlans,
    check_translators,
    measure_plans,
    translated,
)
from toast.methods.translate.config import CLOSED_FORM, ToastConfig
from toast.methods.translate.disk import check_from_disk, params_on_disk, translated_edits
from toast.methods.translate.fitting import Fitter
from toast.methods.translate.report import CompressionReport
from toast.methods.translate.rules import (
    Capture,
    Check,
    Measure,
    analysis_options,
    candidate_plans,
    checked,
    choose_spans,
    cross_validated,
    fit_sequentially,
    refit_options,
)
from toast.spans import Span, validate_spans

__all__ = ["ConfiguredToast", "ToastRun"]


@dataclass
class ToastRun(Stats):
    """What a configured TOAST's calibration found (the analysis, the
    batches it held out) and what applying its plan did (the fits, their
    checks against plain removal, whether they were refitted)."""

    analysis: Analysis | None = field(default=None, repr=False)
    split: CheckSplit | None = field(default=None, repr=False)
    #: the candidate plans measured on the held-out batches (None: not measured)
    measured: MeasuredPlans | None = None
    #: why the candidates were not measured ("": they were, or there was one)
    measure_note: str = ""
    #: the calibration data as given (a sequential fit reads every batch)
    data: Iterable | None = field(default=None, repr=False)
    #: warnings the analysis issued (the fits do not say them twice)
    issued: set[str] = field(default_factory=set)
    fitter: Fitter | None = field(default=None, repr=False)
    translators: list[Translator] = field(default_factory=list, repr=False)
    checks: list[RemovalCheck | None] = field(default_factory=list)
    check_note: str = ""
    refitted: bool = False
    #: spans whose refit measured worse than plain removal held out: removed plainly
    refit_fallbacks: list[Span] = field(default_factory=list)
    disk: DiskModel | None = field(default=None, repr=False)


@dataclass(frozen=True)
class ConfiguredToast(BaseStages):
    """TOAST's stages with the user's options (see the module docstring);
    ``buffer_dir`` holds the states of a checkpoint's blocks while they run
    from disk (a temporary directory, removed on every exit)."""

    config: ToastConfig
    buffer_dir: str | os.PathLike | None = None
    from_disk = True

    def configured(self, config: Any) -> ConfiguredToast:
        return ConfiguredToast(config, self.buffer_dir)

    def check(self, request: Any, layout: Layout) -> None:
        count, total = request.count, layout.num_blocks
        if count is not None and not 1 <= count < total:
            raise ValueError(
                f"num_blocks={count} must be between 1 and {total - 1}: the model has "
                f"{total} blocks and keeps at least one"
            )

    def needs(self, layout: Layout) -> Needs:
        return Needs()  # its own analysis, with the config's options

    def calibrate(
        self,
        model: nn.Module,
        data: Iterable,
        layout: Layout,
        shared: Shared | None,
        calibration: Calibration,
        max_blocks: int,
    ) -> ToastRun:
        config = self.config
        split = CheckSplit(data, 0.0 if config.fit == "sequential" else config.check_fraction)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            analysis = analyze(
                model, split.fit, backend=config.backend, stack=layout.stack,
                **analysis_options(config),
            )  # fmt: skip
        issued = {str(w.message): w.message for w in caught}
        for message in issued.values():  # each once, as the analysis issued it
            warnings.warn(message, stacklevel=2)
        stack = layout.stack

        def apply(where: Sequence[Span], fits: Sequence[Any]) -> Any:
            return translated(stack, where, fits)

        def capture(
            batches: Iterable, states: list[int], observe: MassiveRows | None, bound: int
        ) -> Any:
            options = refit_options(config, states, observe, bound)
            found, _ = capture_moments(
                model, batches, backend=config.backend, stack=stack, **options
            )
            return found

        def measure(plans: list[list[Span]], fits: list[list[Any]], batches: Iterable) -> Any:
            return measure_plans(model, plans, fits, apply, batches, stack=stack)

        measured, note = self._measured(analysis, split, data, capture, measure)
        return ToastRun(
            passes=1, analysis=analysis, split=split, data=data, issued=set(issued),
            measured=measured, measure_note=note,
        )  # fmt: skip

    def _measured(
        self,
        analysis: Analysis,
        split: CheckSplit,
        data: Iterable,
        capture: Capture,
        measure: Measure,
    ) -> tuple[MeasuredPlans | None, str]:
        """The config's candidate plans (:func:`candidate_plans`), each
        fitted in closed form and measured: by cross-validation over the
        calibration batches (:func:`cross_validated`), or with one batch on
        its held-out sequences; and why not ("" where there is nothing to
        choose: given spans, one candidate): ``check_fraction=0`` (the
        papers' protocols: nothing is held out), one sequence, or a fit
        other than an independent closed form (which the measurement would
        train or chain once per candidate). Unmeasured, the plan is the
        best predicted."""
        config = self.config
        plans = candidate_plans(analysis, config)
        if len(plans) < 2:
            return None, ""
        unmeasured = "the best predicted plan, unmeasured"
        if config.fit != "independent" or config.translator not in CLOSED_FORM:
            how = "trained" if config.translator not in CLOSED_FORM else "chained"
            why = f"a {config.fit} {config.translator} fit would be {how} once per candidate"
            return None, f"none ({why}): {unmeasured}"
        if split.every == 0:
            return None, f"none (check_fraction=0: nothing is held out): {unmeasured}"
        measured = cross_validated(plans, config, analysis, data, capture, measure)
        if measured is not None:
            return measured, ""
        if not split.has_check():
            return None, f"none (nothing held out): {unmeasured}"
        fitter = Fitter(config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the kept plan's fits say it, once, in apply
            fits = [fitter.closed_forms(plan, analysis) for plan in plans]
        return measure(plans, fits, split.check), ""

    def propose(self, stats: Stats, sizes: Sizes, max_blocks: int, macs_matter: bool) -> list[Plan]:
        analysis = _analysis(stats)
        measured = stats.measured if isinstance(stats, ToastRun) else None
        if measured is None:
            spans = choose_spans(analysis, self.config)
        else:
            spans = measured.plans[measured.chosen]
        return [self._plan(tuple((s.start, s.stop) for s in spans), analysis, sizes)]

    def choose(self, plans: Sequence[Plan], request: Request) -> Plan | None:
        return plans[0] if plans else None  # the config's own plan

    def given(self, spans: tuple[tuple[int, int], ...], stats: Stats, sizes: Sizes) -> Plan:
        analysis = _analysis(stats)
        return self._plan(tuple(validate_spans(spans, analysis.num_blocks)), analysis, sizes)

    def _plan(self, spans: tuple[tuple[int, int], ...], analysis: Analysis, sizes: Sizes) -> Plan:
        kind = self.config.translator
        errors = [float(analysis.errors[a, b]) for a, b in spans]
        added = translator_params(kind, analysis.moments.dim)
        after = sizes.after_spans(spans, added)
        return Plan(("toast",), "toast", spans, kind, after, sum(errors))

    def scores(self, plan: Plan, stats: Stats) -> list[float]:
        errors = _analysis(stats).errors
        return [float(errors[a, b]) for a, b in plan.spans]

    def apply(self, model: nn.Module, plan: Plan, stats: Stats, layout: Layout) -> None:
        assert isinstance(stats, ToastRun) and stats.split is not None
        config, analysis, stack = self.config, _analysis(stats), layout.stack
        spans = _spans(plan, analysis)
        fitter = stats.fitter = Fitter(config)
        split = stats.split
        stats.check_note = unchecked_because(split, config.fit == "sequential")
        if config.fit != "independent":
            assert stats.data is not None
            fit_sequentially(model, stats.data, spans, fitter, stack)
            fitter.warn_ill_conditioned(already=stats.issued)
            return
        modules = fitter.fit_all(model, split.fit, spans, analysis, stack)
        if not stats.check_note:
            removed: dict[Any, Any] = {}  # plain removal measured once, the re-check reads it

            def check(fits: list, fallback: bool) -> Any:
                return check_translators(model, stack, spans, fits, split.check, fallback, removed)

            def capture(states: list[int], observe: MassiveRows | None) -> Any:
                options = refit_options(config, states, observe)
                return capture_moments(
                    model, split.check, backend=config.backend, stack=stack, **options
                )[0]

            modules = self._checked(stats, spans, modules, check, capture)
        replace_spans(model, [(s.start, s.stop) for s in spans], modules, blocks=stack)
        fitter.warn_ill_conditioned(already=stats.issued)

    def _checked(
        self, stats: ToastRun, spans: list[Span], fits: list, check: Check, capture: Any
    ) -> list:
        """The fits :func:`checked` leaves, with what it found kept in ``stats``."""
        assert stats.fitter is not None
        found = checked(stats.fitter, spans, fits, _analysis(stats), check, capture)
        stats.checks, stats.refitted = found.checks, found.refitted
        stats.refit_fallbacks = found.refit_fallbacks
        return found.fits

    def report(
        self, plan: Plan, stats: Stats, sizes: Sizes, spans: Sequence[Span], params_after: int
    ) -> CompressionReport:
        assert isinstance(stats, ToastRun) and stats.fitter is not None
        analysis, config = _analysis(stats), self.config
        params_before = sizes.params
        if stats.disk is not None:  # as the written model counts them
            params_before, params_after = params_on_disk(stats.disk, spans, stats.translators)
        removed = sum(s.num_blocks for s in spans)
        return CompressionReport(
            method="toast",
            translator=config.translator,
            spans=list(spans),
            conditions=stats.fitter.conditions,
            ranks=stats.fitter.ranks,
            width=analysis.moments.dim,
            blocks_before=sizes.num_blocks,
            blocks_after=sizes.num_blocks - removed + len(spans),
            params_before=params_before,
            params_after=params_after,
            rows=analysis.rows,
            analysis=analysis,
            fit=config.fit,
            checks=stats.checks,
            check_note=stats.check_note,
            refitted=stats.refitted,
            refit_fallbacks=stats.refit_fallbacks,
            measured=stats.measured,
            measure_note=stats.measure_note,
        )

    def calibrate_from_disk(
        self,
        disk: DiskModel,
        data: Iterable,
        layout: Layout,
        shared: Shared | None,
        calibration: Calibration,
        max_blocks: int,
    ) -> ToastRun:
        config = self.config
        if config.translator not in CLOSED_FORM or config.fit != "independent":
            raise ValueError(
                "compress_from_disk fits closed-form translators (translator in "
                f"{sorted(CLOSED_FORM)}) with fit='independent'; got translator="
                f"{config.translator!r}, fit={config.fit!r}"
            )
        split = CheckSplit(data, config.check_fraction)
        options = analysis_options(config)
        analysis = analyze_from_disk(disk, split.fit, buffer_dir=self.buffer_dir, **options)
        buffer_dir, progress = self.buffer_dir, config.calibration.progress

        def capture(
            batches: Iterable, states: list[int], observe: MassiveRows | None, bound: int
        ) -> Any:
            options = refit_options(config, states, observe, bound)
            return capture_moments_from_disk(disk, batches, buffer_dir=buffer_dir, **options)[0]

        def measure(plans: list[list[Span]], fits: list[list[Any]], batches: Iterable) -> Any:
            # each candidate is one sweep over the checkpoint's blocks: counted
            evaluator = SequentialEvaluator(
                disk, batches, progress=progress, buffer_dir=buffer_dir, fidelity=False
            )

            def apply(where: Sequence[Span], chosen: Sequence[Any]) -> Any:
                return evaluator.editing(translated_edits(disk, where, chosen))

            return measure_plans(disk.model, plans, fits, apply, batches, evaluator)

        measured, note = self._measured(analysis, split, data, capture, measure)
        return ToastRun(
            passes=1, analysis=analysis, split=split, data=data, disk=disk, measured=measured,
            measure_note=note,
        )  # fmt: skip

    def prepare_from_disk(self, disk: DiskModel, plan: Plan, stats: Stats) -> None:
        """The closed-form fits of the plan's spans, each checked against
        plain removal block by block and refitted where kept, as
        :meth:`apply` does in memory."""
        assert isinstance(stats, ToastRun) and stats.split is not None
        config, analysis, split = self.config, _analysis(stats), stats.split
        spans = _spans(plan, analysis)
        fitter = stats.fitter = Fitter(config)
        translators = fitter.closed_forms(spans, analysis)
        stats.check_note = unchecked_because(split, sequential=False)
        if not stats.check_note:
            progress, buffer_dir = config.calibration.progress, self.buffer_dir
            removed: dict[Any, Any] = {}  # plain removal swept once, the re-check reads it

            def check(fits: list, fallback: bool) -> Any:
                return check_from_disk(
                    disk, spans, fits, split.check, fallback, progress, buffer_dir, removed
                )

            def capture(states: list[int], observe: MassiveRows | None) -> Any:
                options = refit_options(config, states, observe)
                return capture_moments_from_disk(
                    disk, split.check, buffer_dir=buffer_dir, **options
                )[0]

            translators = self._checked(stats, spans, translators, check, capture)
        fitter.warn_ill_conditioned()
        stats.translators = translators

    def edits(self, disk: DiskModel, plan: Plan, stats: Stats) -> BlockEdits:
        assert isinstance(stats, ToastRun)
        return translated_edits(disk, _spans(plan, _analysis(stats)), stats.translators)

    def save_from_disk(
        self,
        disk: DiskModel,
        plan: Plan,
        stats: Stats,
        output: str | os.PathLike,
        report: str | None = None,
    ) -> Path:
        assert isinstance(stats, ToastRun)
        return save_translated_from_disk(disk, output, list(plan.spans), stats.translators, report)


def _analysis(stats: Stats) -> Analysis:
    assert isinstance(stats, ToastRun) and stats.analysis is not None  # calibrated first
    return stats.analysis


def _spans(plan: Plan, analysis: Analysis) -> list[Span]:
    """The plan's spans with their predicted errors, as the fits read them."""
    return [Span(a, b, float(analysis.errors[a, b])) for a, b in plan.spans]
