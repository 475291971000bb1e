"""A plan made real: each of its methods' ``apply`` on a copy of the model,
with no pass over the data (translators and ReplaceMe transforms come
from the calibration, head pruning from the weights).

The copy shares the original's tensors (its modules are new, its weights
are not): a candidate costs the memory of what its stages add, not a
second model. What a stage writes in place is copied first: the blocks
before each cut (ReplaceMe folds its transform into one); a write into
any other shared tensor is refused before it happens
(:class:`SharedWrites`), and that candidate is built on a whole copy.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from toast.io.guard import guard_save
from toast.methods.base import Layout, Plan, get_method
from toast.methods.calibrate import Calibrated

__all__ = ["Built", "build", "finish", "shared_copy"]


@dataclass(frozen=True)
class Built:
    """A built copy of the model and the layout that describes it."""

    model: nn.Module
    layout: Layout


class SharedWrite(RuntimeError):
    """A stage tried to write in place into a tensor the copy shares with
    the original."""


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


#: In-place by name only: they change no tensor's values.
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_"})


class SharedWrites(TorchFunctionMode):
    """Refuses, before it runs, any in-place torch operation on a tensor
    whose storage is in ``shared`` (the original's weights)."""

    def __init__(self, shared: set[int]) -> None:
        super().__init__()
        self.shared = shared

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        name = getattr(func, "__name__", "")
        inplace = name == "__setitem__" or (
            name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES
        )
        target = args[0] if args else None
        out = (kwargs or {}).get("out")
        for t in (target if inplace else None, out):
            if isinstance(t, torch.Tensor) and t.numel() and _storage(t) in self.shared:
                raise SharedWrite(f"{name} writes into a tensor shared with the original")
        return func(*args, **(kwargs or {}))


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def shared_copy(
    model: nn.Module, layout: Layout, own: list[nn.Module] | None = None
) -> tuple[nn.Module, Layout]:
    """``(model, layout)`` copied with every parameter and buffer sharing
    the original's storage, except those of ``own`` (modules of ``model``),
    which are copied. Parameters stay distinct objects, so rebinding one
    (``module.weight = ...``) leaves the original alone."""
    owned = {id(t) for m in own or [] for t in _tensors(m)}
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if id(p) not in owned:
            memo[id(p)] = nn.Parameter(p.detach(), requires_grad=p.requires_grad)
    for b in model.buffers():
        if id(b) not in owned:
            memo[id(b)] = b.detach()
    # copied together, so the copied layout describes the copied model
    return copy.deepcopy((model, layout), memo)


def _written(layout: Layout, plan: Plan) -> list[nn.Module]:
    """The blocks a plan's stages write in place: the one before each cut
    (ReplaceMe folds its transform into its MLP's down-projection)."""
    blocks = layout.stack.blocks
    return [blocks[start - 1] for start, _ in plan.spans if 0 < start <= len(blocks)]


def _apply(built: nn.Module, copied: Layout, plan: Plan, calibrated: Calibrated) -> None:
    for name in plan.methods:
        stages = get_method(name).stages
        assert stages is not None  # plans come from staged methods
        stages.apply(built, plan, calibrated.stats[name], copied)


def build(model: nn.Module, layout: Layout, plan: Plan, calibrated: Calibrated) -> Built:
    """``plan``'s weight changes applied to a copy of ``model`` that shares
    its untouched tensors (``model`` is left as it is); :func:`finish` adds
    what it changes at run time."""
    built, copied = shared_copy(model, layout, _written(layout, plan))
    shared = {_storage(t) for t in _tensors(model)} & {_storage(t) for t in _tensors(built)}
    try:
        with SharedWrites(shared):
            _apply(built, copied, plan, calibrated)
    except SharedWrite:
        # a stage writes where it was not expected to: a whole copy for this one
        built, copied = copy.deepcopy((model, layout))
        _apply(built, copied, plan, calibrated)
    return Built(guard_save(built), copied)


def finish(built: Built, plan: Plan, calibrated: Calibrated) -> nn.Module:
    """``built`` with ``plan``'s run-time changes (Token Channel Selection)
    installed; its ``save_pretrained`` writes a complete save."""
    for name in plan.methods:
        stages = get_method(name).stages
        assert stages is not None
        stages.finish(built.model, plan, calibrated.stats[name], built.layout)
    return guard_save(built.model)
