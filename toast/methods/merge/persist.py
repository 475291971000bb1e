"""Token merging in a saved plan.

Merging changes no tensor and no module shape: it replaces the blocks'
forwards at run time, which plain ``transformers`` cannot express. The
``"tome"`` :class:`toast.io.registry.ModelPatch` records the merge state
(``r`` per block, the schedule's name, the options and the merging
blocks' paths) with ``needs_toast``: ``toast.load_pretrained`` (and
``AutoModel.from_pretrained(..., trust_remote_code=True)``, which hands the
save to toast) installs merging again, so outputs are identical. Importing
this module registers the patch (the ``toast.serializers`` entry point of
the same name imports it).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from toast.io.registry import ModelPatch, register_model_patch
from toast.methods.merge.install import enable_merging, merging_of
from toast.methods.merge.sites import find_sites

__all__ = ["PATCH"]

_FLAGS = ("proportional_attention", "unmerge_output")


def _describe(model: nn.Module) -> dict[str, Any] | None:
    handle = merging_of(model)
    if handle is None:
        return None
    return {"linears": [], "attributes": [], "state": handle.state(), "needs_toast": True}


def _check(state: Any) -> None:
    if not isinstance(state, dict):
        raise ValueError("the tome state must be a mapping with 'r', 'schedule' and 'blocks'")
    r, blocks = state.get("r"), state.get("blocks")
    if not (isinstance(r, list) and all(isinstance(v, int) and v >= 0 for v in r)):
        raise ValueError(f"the tome state's 'r' must be a list of ints >= 0; got {r!r}")
    if not (isinstance(blocks, list) and len(blocks) == len(r)):
        raise ValueError("the tome state's 'blocks' must list one block path per merge count")
    if not all(isinstance(state.get(flag), bool) for flag in _FLAGS):
        raise ValueError(f"the tome state must set {list(_FLAGS)} to true or false")
    if not isinstance(state.get("schedule"), str):
        raise ValueError("the tome state's 'schedule' must be a name")


def _finish(model: nn.Module, state: Any) -> None:
    """Installs merging again on the loaded model, on the saved blocks."""
    sites = find_sites(model)
    paths = [s.path for s in sites.sites]
    if paths != state["blocks"]:
        raise ValueError(
            f"the save merges tokens in blocks {state['blocks']} but the loaded model has {paths}"
        )
    options = {flag: state[flag] for flag in _FLAGS}
    enable_merging(model, state["r"], schedule=state["schedule"], sites=sites, **options)


PATCH = register_model_patch(
    ModelPatch(type="tome", describe=_describe, check=_check, finish=_finish)
)
