"""A plan made real: each of its methods' ``apply`` on a copy of the model,
with no pass over the data (translators and ReplaceMe transforms come
from the calibration, head pruning from the weights)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import nn

from toast.io.guard import guard_save
from toast.methods.base import Layout, Plan, get_method

from .calibrate import Calibrated

__all__ = ["Built", "build", "finish"]


@dataclass(frozen=True)
class Built:
    """A built copy of the model and the layout that describes it."""

    model: nn.Module
    layout: Layout


def build(model: nn.Module, layout: Layout, plan: Plan, calibrated: Calibrated) -> Built:
    """``plan``'s weight changes applied to a deep copy of ``model`` (which
    is left as it is); :func:`finish` adds what it changes at run time."""
    # copied together, so the copied layout describes the copied model
    built, copied = copy.deepcopy((model, layout))
    for name in plan.methods:
        stages = get_method(name).stages
        assert stages is not None  # plans come from staged methods
        stages.apply(built, plan, calibrated.stats[name], copied)
    return Built(guard_save(built), copied)


def finish(built: Built, plan: Plan, calibrated: Calibrated) -> nn.Module:
    """``built`` with ``plan``'s run-time changes (Token Channel Selection)
    installed; its ``save_pretrained`` writes a complete save."""
    for name in plan.methods:
        stages = get_method(name).stages
        assert stages is not None
        stages.finish(built.model, plan, calibrated.stats[name], built.layout)
    return guard_save(built.model)
