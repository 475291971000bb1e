"""ReplaceMe: depth pruning with a linear transform folded into the last
kept block's down-projection."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from torch import nn

from toast.methods.base import Method, register
from toast.methods.replaceme.config import ReplaceMeConfig
from toast.methods.replaceme.method import *  # noqa: F403
from toast.methods.replaceme.method import __all__ as _method_all
from toast.methods.replaceme.method import replaceme


def _run(model: nn.Module, data: Iterable | None, config: ReplaceMeConfig):
    options = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    cal = options.pop("calibration")
    options.update({f.name: getattr(cal, f.name) for f in dataclasses.fields(cal)})
    options.pop("distributed")
    options.pop("group")
    return replaceme(model, data, **options)


METHOD = register(
    Method(
        name="replaceme",
        config=ReplaceMeConfig,
        run=_run,
        summary="remove blocks, fold a least-squares or cosine transform into the last kept one",
    )
)

__all__ = ["METHOD", "ReplaceMeConfig", *_method_all]
