"""``toast.compress(..., method="toast")``: TOAST registered, its
compression the one driver over its stages configured by the user's
:class:`ToastConfig` (:mod:`toast.methods.translate.configured`)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from toast.methods.base import BeforeSurgery, Method, register
from toast.methods.driver import compress_with_stages
from toast.methods.translate.config import ToastConfig
from toast.methods.translate.report import CompressionReport
from toast.methods.translate.stages import STAGES

__all__ = ["METHOD", "compress_toast"]


def compress_toast(
    model: nn.Module,
    data: Iterable,
    config: ToastConfig,
    before_surgery: BeforeSurgery | None = None,
) -> tuple[nn.Module, CompressionReport]:
    """Replaces redundant spans of ``model``'s blocks by translators, in place.

    One pass over ``data`` gives the moments and the error matrix; the
    spans come from ``config.spans`` or :meth:`Analysis.plan`; each gets a
    translator (see :class:`ToastConfig`) and the model is patched: what
    ``toast.compress(model, data, method="toast", config=config)`` runs.
    """
    model, report = compress_with_stages(METHOD, model, data, config, before_surgery)
    assert isinstance(report, CompressionReport)
    return model, report


METHOD = register(
    Method(
        name="toast",
        config=ToastConfig,
        summary="replace redundant spans of blocks by closed-form or trained translators",
        stages=STAGES,
    )
)
