"""``toast.compress(model, method="toast-vit", ...)``: SCWP head pruning, an
optional recovery fine-tune, then Token Channel Selection — in place,
through the one driver (:mod:`toast.methods.driver`) over ToaSt's stages
configured by the user's options
(:class:`toast.methods.heads.stages.ConfiguredToastVitStages`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from toast.methods.base import BeforeSurgery, Method, register
from toast.methods.driver import compress_with_stages
from toast.methods.heads.config import ToastVitConfig
from toast.methods.heads.report import ToastVitReport
from toast.methods.heads.stages import STAGES

__all__ = ["METHOD", "ToastVitReport", "compress_vit"]


def compress_vit(
    model: nn.Module,
    data: Iterable[Any] | None,
    config: ToastVitConfig,
    before_surgery: BeforeSurgery | None = None,
) -> tuple[nn.Module, ToastVitReport]:
    """ToaSt on an HF ViT / DeiT / DINOv2 / ViT-MAE / Swin model, in place
    (the fields are described on :class:`ToastVitConfig`); what
    ``toast.compress(model, data, method="toast-vit", config=config)`` runs,
    kept as a function of the config:

    1. SCWP, :func:`toast.methods.heads.scwp.prune_heads` with ``config.head_sparsity``
       (default: the named schedule's ρ, else 0.9);
    2. if ``config.finetune_steps`` > 0, the recovery fine-tune
       (:func:`toast.methods.heads.finetune.finetune`) on ``data``
       (batches of ``(pixel_values, labels)``, dicts with labels, or
       anything ``config.loss_fn(model, batch)`` takes);
    3. TCS, :func:`toast.methods.heads.tcs.enable_tcs` with ``config.schedule`` (None: no TCS).

    ``data`` is only needed for the fine-tune: ToaSt itself uses no data.
    ``config.calibration.seed`` seeds the fine-tune and TCS's token samples.
    ToaSt removes no block, so ``before_surgery`` is never called.
    """
    model, report = compress_with_stages(METHOD, model, data, config, before_surgery)
    assert isinstance(report, ToastVitReport)  # the configured stages' report
    return model, report


METHOD = register(
    Method(
        name="toast-vit",
        config=ToastVitConfig,
        needs_data=False,
        summary="ViT head-dimension pruning by geometric median and Token Channel Selection",
        stages=STAGES,
    )
)
