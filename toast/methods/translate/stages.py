"""TOAST's stages: its analysis built from the shared pass (no pass of its
own), linear and affine translator plans over planned spans, Ghosted
Layers' plans (family ``"ghosted"``: LLM-Streamline's cosine windows, each
replaced by ``W = I + M`` fitted by ε-ridge least squares, no bias), and the
closed-form translators fitted from the moments when a plan is applied
(on disk: standing in for their spans as the blocks load, and written
in toast's format without loading the model)."""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Iterable, Sequence
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
from toast.methods.translate.configured import ConfiguredToast
from toast.methods.translate.fitting import Fitter
from toast.methods.translate.memory import within_memory
from toast.spans import Span
from toast.translators.block import translator_module

__all__ = ["STAGES", "ToastStages", "ToastStats"]

#: The closed-form translators a search compares: affine least squares (the
#: default's) and least squares shrunk towards LinearPatch's form, which
#: holds the linear fit (its GCV picks λ = 0 unless shrinking scores better)
#: and measured at least as good as it on DINOv2 and MiniLM
#: (benchmarks/bench_translators.py); the linear error table predicts it.
TRANSLATORS = ("patch_ridge", "affine")
_PREDICTED_BY = {"patch_ridge": "linear", "affine": "affine"}
#: Ghosted Layers' plans: their family and translator label.
GHOSTED = "ghosted"


@dataclass
class ToastStats(Stats):
    """The analysis (moments, massive rows) and each translator's span
    errors, ``errors[translator][i, j]``."""

    analysis: Analysis | None = field(default=None, repr=False)
    errors: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    #: mean 1 − token cosine of every pair of states (LLM-Streamline's windows)
    cosine: np.ndarray | None = field(default=None, repr=False)


def _ghosted_windows(cosine: np.ndarray, max_blocks: int) -> list[tuple[int, int]]:
    """LLM-Streamline's best windows of every size up to ``max_blocks``."""
    return [w for n in range(1, max_blocks + 1) for w in inner_windows(cosine, n)[:ALTERNATIVES]]


class ToastStages(BaseStages):
    """TOAST as stages (family ``"toast"``; the affine plans extendable);
    ``toast.compress`` runs them configured by the user's options
    (:class:`~toast.methods.translate.configured.ConfiguredToast`)."""

    from_disk = True

    def configured(self, config: Any) -> ConfiguredToast:
        return ConfiguredToast(config)

    def within_memory(
        self, config: Any, states: int, width: int, room: int, tokens: Sequence[int] | None = None
    ) -> tuple[Any, list[tuple[str, int]]]:
        return within_memory(config, states, width, room, tokens)

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
        assert shared is not None  # needs() asked for it
        errors = {kind: shared.errors(_PREDICTED_BY[kind]) for kind in TRANSLATORS}
        # what the fits of every span its plans can hold read (not the rows on
        # disk): the exact plans' spans first, then the alternatives', as many
        # as the memory allows when the rows are on disk
        plans = [
            (k, plan)
            for kind in TRANSLATORS
            for n in range(1, max_blocks + 1)
            for k, plan in enumerate(span_plans(errors[kind], n))
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
            kept,
            shared.errors("linear"),
            "linear",
            "gcv",
            "all",
            shared.block_path,
            0.0,
            shared.massive,
        )
        return ToastStats(analysis=analysis, errors=errors, note=note, cosine=cosine)

    def propose(self, stats: Stats, sizes: Sizes, max_blocks: int, macs_matter: bool) -> list[Plan]:
        assert isinstance(stats, ToastStats) and stats.analysis is not None
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
        return ghosted + [
            plan
            for kind in TRANSLATORS
            for plan in span_family_plans(
                "toast",
                "toast",
                stats.errors[kind],
                kind,
                sizes,
                max_blocks,
                added_per_span=translator_params(kind, moments.dim),
                extendable=kind == "affine",
            )
            if kept is None or kept.issuperset(plan.spans)
        ]

    def apply(self, model: nn.Module, plan: Plan, stats: Stats, layout: Layout) -> None:
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
        # the shared pass is all it needs, and it came from disk already
        return self.calibrate(disk.model, data, layout, shared, calibration, max_blocks)

    def edits(self, disk: DiskModel, plan: Plan, stats: Stats) -> BlockEdits:
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
        translators = _translators(plan, stats)
        return save_translated_from_disk(disk, output, list(plan.spans), translators, report)


def _translators(plan: Plan, stats: Stats) -> list[Translator]:
    """The plan's closed-form translators, fitted from the analysis's moments."""
    assert isinstance(stats, ToastStats) and stats.analysis is not None
    translator = plan.translator or "affine"
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
