"""TOAST's stages: its analysis built from the shared pass (no pass of its
own), linear and affine translator plans over planned spans, and the
closed-form translators fitted from the moments when a plan is applied."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from torch import nn

from toast.accounting import translator_params
from toast.hf.calibration import Calibration
from toast.hf.surgery import replace_spans
from toast.methods.stages import (
    BaseStages,
    Layout,
    Needs,
    Plan,
    Shared,
    Sizes,
    Stats,
    span_family_plans,
)
from toast.methods.toast.analysis import Analysis
from toast.methods.toast.config import ToastConfig
from toast.methods.toast.fitting import Fitter
from toast.spans import Span

__all__ = ["STAGES", "ToastStages", "ToastStats"]

#: The closed-form translators a search compares (the papers' best two).
TRANSLATORS = ("linear", "affine")


@dataclass
class ToastStats(Stats):
    """The analysis (moments, massive rows) and each translator's span
    errors, ``errors[translator][i, j]``."""

    analysis: Analysis | None = field(default=None, repr=False)
    errors: dict[str, np.ndarray] = field(default_factory=dict, repr=False)


class ToastStages(BaseStages):
    """TOAST as stages (family ``"toast"``; the affine plans extendable)."""

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
        errors = {kind: shared.errors(kind) for kind in TRANSLATORS}
        analysis = Analysis(
            shared.moments,
            errors["linear"],
            "linear",
            "gcv",
            "all",
            shared.block_path,
            0.0,
            shared.massive,
        )
        return ToastStats(analysis=analysis, errors=errors)

    def propose(self, stats: Stats, sizes: Sizes, max_blocks: int, macs_matter: bool) -> list[Plan]:
        assert isinstance(stats, ToastStats) and stats.analysis is not None
        width = stats.analysis.moments.dim
        return [
            plan
            for kind in TRANSLATORS
            for plan in span_family_plans(
                "toast",
                "toast",
                stats.errors[kind],
                kind,
                sizes,
                max_blocks,
                added_per_span=translator_params(kind, width),
                extendable=kind == "affine",
            )
        ]

    def apply(self, model: nn.Module, plan: Plan, stats: Stats, layout: Layout) -> None:
        assert isinstance(stats, ToastStats) and stats.analysis is not None
        translator = plan.translator or "affine"
        config = ToastConfig(spans=list(plan.spans), translator=translator)
        spans = [Span(a, b, math.nan) for a, b in plan.spans]
        with warnings.catch_warnings():
            # a search measures every plan; a poorly conditioned fit just measures badly
            warnings.simplefilter("ignore")
            modules = Fitter(config).fit_all(model, [], spans, stats.analysis, layout.stack)
        replace_spans(model, list(plan.spans), modules, blocks=layout.stack)


STAGES = ToastStages()
