"""TOAST's stages as a search runs them: the family ``"toast"`` is the
default :class:`ToastConfig` at every size
(:class:`~toast.methods.translate.configured.ConfiguredToast`: its own
analysis on the calibration batches it does not hold out, each fit checked
against plain removal on those it does and refitted where kept), so that
``toast.compress(model, data, num_blocks=n)`` is what a search of TOAST
measures first at ``n`` blocks; beside it, from the shared pass, least
squares shrunk towards LinearPatch's form (family ``"toast-ridge"``) and
Ghosted Layers' plans (family ``"ghosted"``: LLM-Streamline's cosine
windows, each replaced by ``W = I + M`` fitted by ε-ridge least squares,
no bias), their closed-form translators fitted from the shared moments when
a plan is applied (on disk: standing in for their spans as the blocks load,
and written in toast's format without loading the model)."""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from toast.accounting import translator_params
from toast.core import Translator
from toast.core.chunked import PairMoments
from toast.hf.capture.sequential import BlockEdits, DiskModel
from toast.hf.data.calibration import Calibration
from toast.hf.evaluate.from_disk import replaced
from toast.hf.model.surgery import replace_spans
from toast.io.from_disk import save_translated_from_disk
from toast.methods.span_plans import ALTERNATIVES, inner_windows, span_family_plans, span_plans
from toast.methods.stages import BaseStages, Layout, Needs, Plan, Shared, Sizes, Stats
from toast.methods.translate.analysis import Analysis
from toast.methods.translate.config import GHOSTED_RIDGE, ToastConfig
from toast.methods.translate.configured import ConfiguredToast, ToastRun
from toast.methods.translate.fitting import Fitter
from toast.methods.translate.memory import within_memory
from toast.spans import Span
from toast.translators.block import translator_module

__all__ = ["STAGES", "ToastStages", "ToastStats"]

#: The translator fitted from the shared pass beside the default's: least
#: squares shrunk towards LinearPatch's form, which holds the linear fit (its
#: GCV picks λ = 0 unless shrinking scores better) and measured at least as
#: good as it on DINOv2 and MiniLM (benchmarks/bench_translators.py); the
#: linear error table predicts it.
RIDGE = "patch_ridge"
#: Its family: a variant of ``"toast"``, measured after every method's own.
RIDGE_FAMILY = "toast-ridge"
#: Ghosted Layers' plans: their family and translator label.
GHOSTED = "ghosted"


@dataclass
class ToastStats(Stats):
    """The default's own calibration (``own``, with the stages that ran
    it), and from the shared pass the analysis (moments, massive rows), the
    ridge's span errors and LLM-Streamline's cosines."""

    analysis: Analysis | None = field(default=None, repr=False)
    errors: np.ndarray | None = field(default=None, repr=False)
    #: mean 1 − token cosine of every pair of states (LLM-Streamline's windows)
    cosine: np.ndarray | None = field(default=None, repr=False)
    own: ToastRun | None = field(default=None, repr=False)
    own_stages: ConfiguredToast | None = field(default=None, repr=False)


def _ghosted_windows(cosine: np.ndarray, max_blocks: int) -> list[tuple[int, int]]:
    """LLM-Streamline's best windows of every size up to ``max_blocks``."""
    return [w for n in range(1, max_blocks + 1) for w in inner_windows(cosine, n)[:ALTERNATIVES]]


def _shared(plan: Plan) -> bool:
    """Whether ``plan`` is fitted from the shared pass (else: the default's own)."""
    return plan.translator in (RIDGE, GHOSTED)


class ToastStages(BaseStages):
    """TOAST as a search runs it (see the module docstring); ``toast.compress``
    runs :class:`~toast.methods.translate.configured.ConfiguredToast`
    configured by the user's options, the family ``"toast"`` alone."""

    from_disk = True

    def configured(self, config: Any) -> ConfiguredToast:
        return ConfiguredToast(config)

    def within_memory(
        self, config: Any, states: int, width: int, room: int
    ) -> tuple[Any, list[tuple[str, int]]]:
        return within_memory(config, states, width, room)

    def needs(self, layout: Layout) -> Needs:
        return Needs(moments=True)

    def calibrate(
        self,
        model: nn.Module,
        data: Iterable,
        layout: Layout,
        shared: Shared | None,
        calibration: Calibration,
        max_blocks: int,
    ) -> ToastStats:
        own = _default(calibration, max_blocks)
        stats = self._from_shared(shared, max_blocks)
        stats.own = own.calibrate(model, data, layout, shared, calibration, max_blocks)
        stats.own_stages, stats.passes = own, stats.passes + stats.own.passes
        return stats

    def _from_shared(self, shared: Shared | None, max_blocks: int) -> ToastStats:
        assert shared is not None  # needs() asked for it
        errors = shared.errors("linear")
        # what the fits of every span its plans can hold read (not the rows on
        # disk): the exact plans' spans first, then the alternatives', as many
        # as the memory allows when the rows are on disk
        plans = [
            (k, plan)
            for n in range(1, max_blocks + 1)
            for k, plan in enumerate(span_plans(errors, n))
        ]
        spans = [span for k, plan in sorted(plans, key=lambda p: p[0] > 0) for span in plan]
        cosine = shared.errors("cosine")
        spans += _ghosted_windows(cosine, max_blocks)
        kept = shared.pairs(spans)
        note = ""
        if isinstance(kept, PairMoments) and len(kept.spans) < len(set(spans)):
            note = (
                f"toast: the moments of {len(kept.spans)} of its {len(set(spans))} spans were "
                "kept (each 2 d² doubles, within the memory the errors used); plans with the "
                "others are not proposed: raise max_memory or lower max_blocks"
            )
        analysis = Analysis(
            kept, errors, "linear", "gcv", "all", shared.block_path, 0.0, shared.massive
        )
        return ToastStats(analysis=analysis, errors=errors, note=note, cosine=cosine)

    def propose(self, stats: Stats, sizes: Sizes, max_blocks: int, macs_matter: bool) -> list[Plan]:
        assert isinstance(stats, ToastStats) and stats.analysis is not None
        assert stats.own is not None and stats.own_stages is not None
        own = stats.own_stages.propose(stats.own, sizes, max_blocks, macs_matter)
        moments = stats.analysis.moments
        kept = set(moments.spans) if isinstance(moments, PairMoments) else None
        ghosted: list[Plan] = []
        cosine = stats.cosine if stats.cosine is not None else np.full((1, 1), np.nan)
        for window in _ghosted_windows(cosine, max_blocks):
            if kept is None or window in kept:
                added = translator_params("linear", moments.dim)
                ghosted.append(
                    Plan(
                        ("toast",),
                        GHOSTED,
                        (window,),
                        GHOSTED,
                        sizes.after_spans((window,), added),
                        float(cosine[window]),
                    )
                )
        assert stats.errors is not None
        ridge = span_family_plans(
            "toast", RIDGE_FAMILY, stats.errors, RIDGE, sizes, max_blocks,
            added_per_span=translator_params(RIDGE, moments.dim),
        )  # fmt: skip
        return own + ghosted + [p for p in ridge if kept is None or kept.issuperset(p.spans)]

    def apply(self, model: nn.Module, plan: Plan, stats: Stats, layout: Layout) -> None:
        if not _shared(plan):
            own, run = _own(stats)
            own.apply(model, plan, run, layout)
            return
        modules = _translators(plan, stats)
        replace_spans(model, list(plan.spans), modules, blocks=layout.stack)

    def calibrate_from_disk(
        self,
        disk: DiskModel,
        data: Iterable,
        layout: Layout,
        shared: Shared | None,
        calibration: Calibration,
        max_blocks: int,
    ) -> ToastStats:
        own = _default(calibration, max_blocks)
        stats = self._from_shared(shared, max_blocks)  # the shared pass came from disk already
        stats.own = own.calibrate_from_disk(disk, data, layout, shared, calibration, max_blocks)
        stats.own_stages, stats.passes = own, stats.passes + stats.own.passes
        return stats

    def prepare_from_disk(self, disk: DiskModel, plan: Plan, stats: Stats) -> None:
        if not _shared(plan):
            own, run = _own(stats)
            own.prepare_from_disk(disk, plan, run)

    def params_from_disk(self, disk: DiskModel, plan: Plan, stats: Stats) -> int:
        if not _shared(plan):
            own, run = _own(stats)
            return own.params_from_disk(disk, plan, run)
        return plan.params_after

    def edits(self, disk: DiskModel, plan: Plan, stats: Stats) -> BlockEdits:
        if not _shared(plan):
            own, run = _own(stats)
            return own.edits(disk, plan, run)
        # in the weights' dtype, as the patched model has them
        modules = [translator_module(t, dtype=disk.dtype) for t in _translators(plan, stats)]
        return replaced(plan.spans, modules)

    def save_from_disk(
        self,
        disk: DiskModel,
        plan: Plan,
        stats: Stats,
        output: str | os.PathLike,
        report: str | None = None,
    ) -> Path:
        """What :func:`toast.save_pretrained` writes for the applied plan."""
        if not _shared(plan):
            own, run = _own(stats)
            return own.save_from_disk(disk, plan, run, output, report)
        translators = _translators(plan, stats)
        return save_translated_from_disk(disk, output, list(plan.spans), translators, report)


def _default(calibration: Calibration, max_blocks: int) -> ConfiguredToast:
    """The default config's stages at every size up to ``max_blocks``,
    reading the search's calibration options (its moments keep the pairs
    of states that far apart, as ``num_blocks=max_blocks`` keeps them)."""
    config = ToastConfig(num_blocks=max_blocks, calibration=calibration)
    return ConfiguredToast(config, every_size=True)


def _own(stats: Stats) -> tuple[ConfiguredToast, ToastRun]:
    assert isinstance(stats, ToastStats) and stats.own is not None  # calibrated first
    assert stats.own_stages is not None
    return stats.own_stages, stats.own


def _translators(plan: Plan, stats: Stats) -> list[Translator]:
    """The plan's closed-form translators, fitted from the analysis's moments."""
    assert isinstance(stats, ToastStats) and stats.analysis is not None
    translator = plan.translator or RIDGE
    analysis = stats.analysis
    if translator == GHOSTED:  # every row fitted as it is: no massive-row correction
        config = ToastConfig(
            spans=list(plan.spans),
            translator="linear",
            ridge=GHOSTED_RIDGE,
            ridge_target="identity",
            massive_rows="fit",
        )
        analysis = dataclasses.replace(analysis, massive=None)
    else:
        config = ToastConfig(spans=list(plan.spans), translator=translator)
    spans = [Span(a, b, math.nan) for a, b in plan.spans]
    with warnings.catch_warnings():
        # a search measures every plan; a poorly conditioned fit just measures badly
        warnings.simplefilter("ignore")
        return Fitter(config).closed_forms(spans, analysis)


STAGES = ToastStages()
