"""The token reducers as registered methods: ``toast.compress(model, None,
method="tome", r=8)`` (``"rapid"``, ``"token-transforming"``, ``"atm"``,
``"pitome"`` alike) and ``toast compress MODEL --method tome --r 8``, each
registered with its stages alone: ``compress`` runs them configured by the
user's options (:mod:`toast.methods.merge.configured`) through the one
driver (:mod:`toast.methods.driver`), as ``toast.search`` runs their grid."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

from toast.methods.base import BeforeSurgery, Method, register
from toast.methods.driver import compress_with_stages
from toast.methods.merge import persist  # noqa: F401  (registers the "tome" model patch)
from toast.methods.merge.config import (
    AtmConfig,
    PitomeConfig,
    RapidConfig,
    TomeConfig,
    TransformingConfig,
)
from toast.methods.merge.report import TomeReport
from toast.methods.merge.stages import (
    ATM_STAGES,
    PITOME_STAGES,
    RAPID_STAGES,
    STAGES,
    TRANSFORMING_STAGES,
)

__all__ = ["METHODS", "METHOD", "TomeReport", "compress_tome"]


@dataclass(frozen=True)
class _Entry:
    """One reducer as a registered method: its config, its stages and the
    registry's one-line summary."""

    config: type
    stages: Any
    summary: str


_ENTRIES = {
    "tome": _Entry(
        TomeConfig, STAGES, "ViT token merging (ToMe): bipartite soft matching, no training"
    ),
    "rapid": _Entry(
        RapidConfig,
        RAPID_STAGES,
        "ViT token pruning (early blocks) then merging by CLS attention (RAPID)",
    ),
    "token-transforming": _Entry(
        TransformingConfig,
        TRANSFORMING_STAGES,
        "ViT many-to-many token reduction (Token Transforming), no training",
    ),
    "atm": _Entry(
        AtmConfig,
        ATM_STAGES,
        "ViT adaptive token merging by per-block similarity thresholds (ATM)",
    ),
    "pitome": _Entry(
        PitomeConfig,
        PITOME_STAGES,
        "ViT token merging that protects low-energy (informative) tokens (PiToMe)",
    ),
}


METHODS = tuple(
    register(
        Method(
            name=name,
            config=entry.config,
            needs_data=False,
            summary=entry.summary,
            stages=entry.stages,
        )
    )
    for name, entry in _ENTRIES.items()
)
METHOD = METHODS[0]


def compress_tome(
    model: nn.Module,
    data: Iterable[Any] | None,
    config: TomeConfig,
    before_surgery: BeforeSurgery | None = None,
) -> tuple[nn.Module, TomeReport]:
    """Installs token merging on ``model`` in place, as ``config`` says; what
    ``toast.compress(model, data, method="tome", config=config)`` runs.
    ``data``, when given, sets the image size the report's MACs count (its
    first batch). No block goes, so ``before_surgery`` is never called."""
    model, report = compress_with_stages(METHOD, model, data, config, before_surgery)
    assert isinstance(report, TomeReport)  # the configured stages' report
    return model, report
