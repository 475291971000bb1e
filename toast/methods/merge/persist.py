"""Token reduction (ToMe, ATM, Token Transforming, RAPID) in a saved plan.

Reduction changes no tensor and no module shape: it replaces the blocks'
forwards at run time, which plain ``transformers`` cannot express. The
``"tome"`` :class:`toast.io.registry.ModelPatch` records the reducer
(its name, absent for ToMe, and its settings: ``r`` per block and the
schedule's name for ToMe), the options (``merge_norm`` only when it is not
the paper's average, so older saves read unchanged) and the reducing
blocks' paths,
with ``needs_toast``: ``toast.load_pretrained`` (and
``AutoModel.from_pretrained(..., trust_remote_code=True)``, which hands the
save to toast) installs it again, so outputs are identical. Importing
this module registers the patch (the ``toast.serializers`` entry point of
the same name imports it).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from toast.io.registry import ModelPatch, register_model_patch
from toast.methods.merge.install import enable_reduction, merging_of
from toast.methods.merge.matching import MERGE_NORMS
from toast.methods.merge.reducers import reducer_from_state
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
        raise ValueError("the tome state must map the reducer's settings and 'blocks'")
    reducer = reducer_from_state(state)
    blocks = state.get("blocks")
    if not (isinstance(blocks, list) and len(blocks) == reducer.num_blocks):
        raise ValueError("the tome state's 'blocks' must list one block path per reducing block")
    if not all(isinstance(state.get(flag), bool) for flag in _FLAGS):
        raise ValueError(f"the tome state must set {list(_FLAGS)} to true or false")
    if state.get("merge_norm", "average") not in MERGE_NORMS:
        raise ValueError(f"the tome state's 'merge_norm' must be one of {list(MERGE_NORMS)}")


def _finish(model: nn.Module, state: Any) -> None:
    """Installs the reducer again on the loaded model, on the saved blocks."""
    sites = find_sites(model)
    paths = [s.path for s in sites.sites]
    if paths != state["blocks"]:
        raise ValueError(
            f"the save merges tokens in blocks {state['blocks']} but the loaded model has {paths}"
        )
    options = {flag: state[flag] for flag in _FLAGS}
    norm = state.get("merge_norm", "average")
    enable_reduction(model, reducer_from_state(state), sites=sites, merge_norm=norm, **options)


PATCH = register_model_patch(
    ModelPatch(type="tome", describe=_describe, check=_check, finish=_finish)
)
