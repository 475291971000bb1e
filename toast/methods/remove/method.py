"""``toast.compress(..., method="remove")``: plain block removal, the
baseline, registered with its stages alone: ``compress`` runs them through
the one driver (:mod:`toast.methods.driver`: calibrate, the first choice
of the size asked, apply), as ``toast.search`` does."""

from __future__ import annotations

from toast.methods.base import Method, register
from toast.methods.remove.config import RemoveConfig
from toast.methods.remove.report import RemoveReport
from toast.methods.remove.stages import STAGES

__all__ = ["METHOD", "RemoveReport"]


METHOD = register(
    Method(
        name="remove",
        config=RemoveConfig,
        needs_data=False,
        summary="delete the blocks whose output is nearest their input (the baseline)",
        stages=STAGES,
    )
)
