"""Removed sub-layers in a saved plan.

A removed sub-layer leaves a block without its attention (or MLP) and its
pre-norm, which no ``transformers`` config can express: the class would
build them again, with fresh weights. The ``"sublayer"``
:class:`toast.io.registry.ModelPatch` records each replaced module by
path (``"attention"`` / ``"mlp"``: a zero branch, with the attention's
``layer_idx`` for the KV cache; ``"identity"``: a removed norm or scale)
with ``needs_toast``, and its ``prepare`` puts the same parameter-free
modules back before the weights load, so the strict load finds exactly
the saved tensors and outputs are identical. Importing this module
registers the patch (the ``toast.serializers`` entry point of the same
name imports it).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from toast.io.format import PATH_RE
from toast.io.registry import ModelPatch, register_model_patch
from toast.methods.sublayer.parts import KINDS, ZeroBranch, removed_parts, replacement

__all__ = ["PATCH"]

_AS = (*KINDS, "identity")


def _describe(model: nn.Module) -> dict[str, Any] | None:
    parts = removed_parts(model)
    if not parts:
        return None
    replaced = []
    for path, module in parts:
        if isinstance(module, ZeroBranch):
            replaced.append({"module": path, "as": module.kind, "layer_idx": module.layer_idx})
        else:
            replaced.append({"module": path, "as": "identity", "layer_idx": None})
    return {"linears": [], "attributes": [], "state": {"replaced": replaced}, "needs_toast": True}


def _check(state: Any) -> None:
    replaced = state.get("replaced") if isinstance(state, dict) else None
    if not isinstance(replaced, list) or not replaced:
        raise ValueError("the sublayer state must list the 'replaced' modules")
    for item in replaced:
        if not (
            isinstance(item, dict)
            and isinstance(item.get("module"), str)
            and PATH_RE.fullmatch(item["module"])
            and item.get("as") in _AS
            and (item.get("layer_idx") is None or type(item.get("layer_idx")) is int)
        ):
            raise ValueError(f"malformed replaced module {item!r}")


def _prepare(model: nn.Module, state: Any) -> None:
    """Puts the parameter-free modules back in place of the removed ones
    (before the weights load)."""
    for item in state["replaced"]:
        owner, _, name = item["module"].rpartition(".")
        holder = model.get_submodule(owner)
        if not isinstance(getattr(holder, name, None), nn.Module):
            raise ValueError(f"{item['module']!r} is not a module of the rebuilt model")
        setattr(holder, name, replacement(item["as"], item["layer_idx"]))


def _finish(model: nn.Module, state: Any) -> None:
    return None  # everything was put back before the weights loaded


PATCH = register_model_patch(
    ModelPatch(type="sublayer", describe=_describe, check=_check, finish=_finish, prepare=_prepare)
)
