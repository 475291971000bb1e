"""``toast.compress(..., method="sublayer")``: removes attention or MLP
sub-layers of transformer blocks (their residual passes through), chosen
by score in one calibration pass or by measured calibration quality,
registered with its stages alone: ``compress`` runs them through the one
driver (:mod:`toast.methods.driver`), as ``toast.search`` does."""

from __future__ import annotations

from toast.methods.base import Method, register
from toast.methods.sublayer import persist  # noqa: F401  (registers the "sublayer" model patch)
from toast.methods.sublayer.config import SublayerConfig
from toast.methods.sublayer.report import RemovedSublayer, SublayerReport
from toast.methods.sublayer.stages import STAGES

__all__ = ["METHOD", "RemovedSublayer", "SublayerReport"]


METHOD = register(
    Method(
        name="sublayer",
        config=SublayerConfig,
        summary="remove the attention or MLP sub-layers that turn the residual stream least",
        stages=STAGES,
    )
)
