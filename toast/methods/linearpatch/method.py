"""``toast.compress(..., method="linearpatch")``: LinearPatch as published,
registered with its stages alone: ``compress`` runs them through the one
driver (:mod:`toast.methods.driver`: one pass, the most similar window of
the size asked, its patch in place), as ``toast.search`` does."""

from __future__ import annotations

from typing import Any

from torch import nn

from toast.methods.base import Method, register
from toast.methods.linearpatch.config import LinearPatchConfig
from toast.methods.linearpatch.report import LinearPatchReport
from toast.methods.linearpatch.stages import STAGES
from toast.methods.runner import run_method, split_text_options

__all__ = ["METHOD", "LinearPatchReport", "linearpatch"]


def linearpatch(
    model: nn.Module,
    data: Any,
    config: LinearPatchConfig | None = None,
    *,
    heldout: Any = None,
    **params: Any,
) -> tuple[nn.Module, LinearPatchReport]:
    """Removes ``num_blocks`` blocks of ``model`` by LinearPatch, in place
    (see :class:`LinearPatchConfig`; ``data`` and ``heldout`` as in
    :func:`toast.compress`). Returns the model and its report."""
    text, params = split_text_options(params)
    if config is None:
        from toast.methods.base import make_config

        config = make_config(METHOD, params)
    elif params:
        raise TypeError("give either config= or its options as keywords, not both")
    _, report = run_method(METHOD, model, data, config, heldout=heldout, text=text)
    assert isinstance(report, LinearPatchReport)
    return model, report


METHOD = register(
    Method(
        name="linearpatch",
        config=LinearPatchConfig,
        summary="replace the most similar window of blocks by a Hadamard-basis channel scale",
        stages=STAGES,
    )
)
