"""ToaSt in a saved plan: narrowed attention heads and Token Channel Selection.

Dense SCWP leaves every pruned attention with ``q_proj`` … ``o_proj`` of a
kept width the config cannot express (``head_dim`` differs per block), so
the plan lists those linears and the ``head_dim`` / ``scaling`` attributes;
the loader rebuilds them before the weights load. TCS changes no tensor: its
schedule, options and seed go into the entry's state and :func:`_finish`
enables it again on the loaded model, so outputs are identical. Importing
this module registers the ``"toast-vit"`` :class:`toast.io.registry.ModelPatch`
(the ``toast.serializers`` entry point of the same name imports it).

Masked SCWP needs no entry: its zeroed rows are ordinary weights (the masks
kept for re-application after optimiser steps are not saved).
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

from torch import nn

from toast.hf.model.vit import SUPPORTED_TYPES, vit_blocks
from toast.io.registry import ModelPatch, register_model_patch
from toast.methods.heads.schedules import Schedule
from toast.methods.heads.scwp import ORIGINAL_HEAD_DIM
from toast.methods.heads.tcs import HANDLE_ATTR, TcsHandle, TcsOptions, enable_tcs

__all__ = ["PATCH"]

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _linear(path: str, module: nn.Linear) -> dict[str, Any]:
    return {
        "module": path,
        "in_features": int(module.in_features),
        "out_features": int(module.out_features),
        "bias": module.bias is not None,
    }


def _pruned(model: nn.Module) -> dict[str, tuple[Any, int]]:
    """``{attention path: (attention, original head_dim)}`` of densely pruned blocks."""
    found = {}
    for blk in vit_blocks(model).blocks:
        original = getattr(blk.attention, ORIGINAL_HEAD_DIM, None)
        if isinstance(original, int):
            found[f"{blk.path}.attention"] = (blk.attention, original)
    return found


def _tcs_state(model: nn.Module) -> dict[str, Any] | None:
    handle = getattr(model, HANDLE_ATTR, None)
    if not isinstance(handle, TcsHandle):
        return None
    s = handle.schedule
    return {
        "fc1": [float(r) for r in s.fc1],
        "fc2": [float(r) for r in s.fc2],
        "head_sparsity": float(s.head_sparsity),
        "sample_ratio": float(s.sample_ratio),
        "options": asdict(handle.options),
    }


def _describe(model: nn.Module) -> dict[str, Any] | None:
    if getattr(getattr(model, "config", None), "model_type", None) not in SUPPORTED_TYPES:
        return None
    pruned, tcs = _pruned(model), _tcs_state(model)
    if not pruned and tcs is None:
        return None
    linears, attributes = [], []
    for path, (attention, _) in pruned.items():
        for name in _PROJECTIONS:
            linears.append(_linear(f"{path}.{name}", getattr(attention, name)))
        for name in ("head_dim", "scaling"):
            attributes.append({"module": path, "name": name, "value": getattr(attention, name)})
    return {
        "linears": linears,
        "attributes": attributes,
        "state": {"original_head_dim": {p: d for p, (_, d) in pruned.items()}, "tcs": tcs},
        "needs_toast": tcs is not None,
    }


_OPTION_NAMES = frozenset(f.name for f in fields(TcsOptions))


def _check(state: Any) -> None:
    if not isinstance(state, dict) or not isinstance(state.get("original_head_dim"), dict):
        raise ValueError("the toast-vit state must hold 'original_head_dim' (paths to widths)")
    if not all(isinstance(v, int) and v > 0 for v in state["original_head_dim"].values()):
        raise ValueError("'original_head_dim' must map attention paths to positive widths")
    tcs = state.get("tcs")
    if tcs is None:
        return
    if not isinstance(tcs, dict) or not isinstance(tcs.get("options"), dict):
        raise ValueError("'tcs' must hold the schedule ratios and 'options'")
    unknown = set(tcs["options"]) - _OPTION_NAMES
    if unknown:
        raise ValueError(f"unknown TCS options {sorted(unknown)}")
    # The schedule validates its own ratios; build it here so a bad one fails early.
    _schedule(tcs)


def _schedule(tcs: dict[str, Any]) -> Schedule:
    try:
        return Schedule(
            tuple(float(r) for r in tcs["fc1"]),
            tuple(float(r) for r in tcs["fc2"]),
            head_sparsity=float(tcs["head_sparsity"]),
            sample_ratio=float(tcs["sample_ratio"]),
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"the TCS schedule is malformed: {exc}") from None


def _finish(model: nn.Module, state: Any) -> None:
    """Marks the pruned attentions (so they are not pruned twice) and
    enables TCS with the saved schedule, options and seed."""
    for path, width in state["original_head_dim"].items():
        setattr(model.get_submodule(path), ORIGINAL_HEAD_DIM, int(width))
    tcs = state.get("tcs")
    if tcs is None:
        return
    options = dict(tcs["options"])
    seed = options.pop("seed", 0)
    enable_tcs(model, _schedule(tcs), seed=seed, **options)


PATCH = register_model_patch(
    ModelPatch(type="toast-vit", describe=_describe, check=_check, finish=_finish)
)
