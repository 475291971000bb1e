"""Finding the parts of a Hugging Face transformer that toast works on.

:func:`find_blocks` locates the stack of repeated transformer blocks (the
``nn.ModuleList``, or timm's ``nn.Sequential``, whose children are all
instances of one class); the final norm is looked up next to it. Every family
in ``transformers`` that keeps its blocks in one list works without an
adapter: ViT, DeiT, DINOv2, the CLIP vision tower, BERT, ModernBERT, Llama,
Qwen2, GPT-2 and their task heads; so do timm-style vision transformers.
Where discovery is ambiguous or fails, pass the dotted path of the list,
e.g. ``blocks="encoder.layer"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from toast._validation import Predicate, check

__all__ = [
    "BlockParts",
    "BlockStack",
    "Projection",
    "block_parts",
    "find_blocks",
    "find_head",
    "find_projections",
]

# Attribute names of the norm applied after the last block, by family.
#: The constraint every entry point puts on its ``model`` argument.
MODEL = Predicate(lambda value: isinstance(value, nn.Module), "a torch.nn.Module")

_FINAL_NORM_NAMES = (
    "layernorm",  # ViT, DeiT, DINOv2
    "post_layernorm",  # CLIP vision
    "final_norm",  # ModernBERT
    "final_layer_norm",  # OPT
    "norm",  # Llama, Qwen2, Mistral
    "ln_f",  # GPT-2
)


@dataclass(frozen=True)
class BlockStack:
    """Where the blocks of a model live.

    ``path`` is the dotted attribute path of the ``nn.ModuleList`` inside the
    model, ``blocks`` the list itself, ``final_norm`` the norm applied to the
    last block's output (or None) and ``final_norm_path`` its path.
    ``views`` caches what was found beside the stack (e.g. a ViT's blocks,
    :func:`toast.hf.model.vit.vit_view`), so every method shares one discovery.
    """

    path: str
    blocks: nn.ModuleList | nn.Sequential
    final_norm: nn.Module | None
    final_norm_path: str | None
    views: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


# Containers of blocks: transformers' nn.ModuleList, and timm's nn.Sequential
# (whose forward chains the blocks: each takes and returns a (batch, tokens, dim) tensor).
BLOCK_CONTAINERS = (nn.ModuleList, nn.Sequential)


def _is_block_list(module: nn.Module) -> bool:
    if not isinstance(module, BLOCK_CONTAINERS) or len(module) == 0:
        return False
    # Blocks standing in for removed ones (a class attribute _toast_stand_in = True,
    # e.g. translator blocks) do not count.
    blocks = [child for child in module if not getattr(child, "_toast_stand_in", False)]
    if not blocks or len({type(child) for child in blocks}) != 1:
        return False
    # A transformer block has several parameterised submodules; a list of
    # bare Linear or Dropout layers does not qualify.
    first = blocks[0]
    with_params = [m for m in first.children() if any(True for _ in m.parameters())]
    return len(with_params) >= 2


def _get(model: nn.Module, path: str) -> nn.Module:
    module = model
    for part in path.split("."):
        if not hasattr(module, part):
            raise ValueError(
                f"{type(model).__name__} has no attribute path {path!r} "
                f"(stopped at {part!r}); pass blocks='a.b.c' naming its block list"
            )
        module = getattr(module, part)
    return module


def _parent_path(path: str) -> str:
    return path.rpartition(".")[0]


def _find_final_norm(model: nn.Module, block_path: str) -> tuple[nn.Module | None, str | None]:
    # Walk up from the list's parent: the norm sits beside the block list
    # (ViT, Llama, GPT-2) or beside the encoder that holds it (DINOv2, CLIP).
    parent = _parent_path(block_path)
    while True:
        holder = _get(model, parent) if parent else model
        for name in _FINAL_NORM_NAMES:
            norm = getattr(holder, name, None)
            if isinstance(norm, nn.Module) and not isinstance(norm, nn.ModuleList):
                return norm, f"{parent}.{name}" if parent else name
        if not parent:
            return None, None
        parent = _parent_path(parent)


def find_blocks(model: nn.Module, blocks: str | BlockStack | None = None) -> BlockStack:
    """Locates the transformer blocks of ``model``.

    ``blocks`` names the ``nn.ModuleList`` explicitly (a dotted path such as
    ``"encoder.layer"``, or a :class:`BlockStack` found before: its path is
    looked up again, so a stack stays valid across surgery without a new
    search); without it the longest list of identical, multi-part modules is
    taken. Raises ``ValueError`` when nothing (or more than one equally good
    candidate) is found.
    """
    check("model", model, MODEL)
    if isinstance(blocks, BlockStack):
        blocks = blocks.path
    if blocks is not None:
        found = _get(model, blocks)
        if not isinstance(found, BLOCK_CONTAINERS) or len(found) == 0:
            raise ValueError(
                f"blocks={blocks!r} is a {type(found).__name__}, not a non-empty nn.ModuleList "
                "or nn.Sequential"
            )
        path = blocks
    else:
        candidates = [(name, m) for name, m in model.named_modules() if _is_block_list(m)]
        if not candidates:
            raise ValueError(
                f"cannot find the transformer blocks of {type(model).__name__}: no "
                "nn.ModuleList or nn.Sequential of identical blocks; pass blocks='...' with the "
                "dotted path "
                "of the block list (e.g. blocks='encoder.layer')"
            )
        longest = max(len(m) for _, m in candidates)
        best = [(name, m) for name, m in candidates if len(m) == longest]
        if len(best) > 1:
            names = ", ".join(repr(name) for name, _ in best)
            raise ValueError(
                f"{type(model).__name__} has several block lists of length {longest} "
                f"({names}); pass blocks='...' to choose one"
            )
        path = best[0][0]
    block_list = _get(model, path)
    assert isinstance(block_list, BLOCK_CONTAINERS)  # checked when the path was chosen
    norm, norm_path = _find_final_norm(model, path)
    return BlockStack(path, block_list, norm, norm_path)


# -- the parts of one block -------------------------------------------------

# Path suffixes (inside a block) of each projection, by family:
# ViT/DeiT/DINOv2/CLIP/Llama/Qwen2 (q_proj...), BERT (attention.self.query,
# attention.output.dense, intermediate.dense, output.dense), GPT-2 (attn.c_attn,
# attn.c_proj, mlp.c_fc, mlp.c_proj; Conv1D), ModernBERT (attn.Wqkv, attn.Wo,
# mlp.Wi, mlp.Wo).
_PART_SUFFIXES: dict[str, tuple[str, ...]] = {
    "q": ("q_proj", "self.query"),
    "k": ("k_proj", "self.key"),
    "v": ("v_proj", "self.value"),
    "qkv": ("attn.c_attn", "attn.Wqkv", "qkv_proj", "query_key_value"),
    "out": ("o_proj", "out_proj", "attention.output.dense", "attn.c_proj", "attn.Wo"),
    "gate": ("gate_proj",),
    # Phi-3's gate_up_proj and ModernBERT's Wi hold the gate and up halves together
    "up": ("fc1", "up_proj", "gate_up_proj", "intermediate.dense", "mlp.c_fc", "mlp.Wi"),
    "down": ("fc2", "down_proj", "mlp.c_proj", "mlp.Wo"),
}
# BERT's MLP output is the block's bare `output.dense`.
_EXACT_PATHS = {"down": ("output.dense",)}


@dataclass(frozen=True)
class Projection:
    """One dense projection of a block.

    ``path`` is its dotted path inside the block. ``layout`` says how its
    weight is stored: ``"linear"`` is torch's ``(out_features, in_features)``;
    ``"conv1d"`` is GPT-2's ``Conv1D``, ``(in_features, out_features)``.
    """

    path: str
    module: nn.Module
    layout: str

    @property
    def weight(self) -> torch.Tensor:
        weight = self.module.weight
        assert isinstance(weight, torch.Tensor)
        return weight

    @property
    def in_features(self) -> int:
        w = self.weight
        return int(w.shape[1] if self.layout == "linear" else w.shape[0])

    @property
    def out_features(self) -> int:
        w = self.weight
        return int(w.shape[0] if self.layout == "linear" else w.shape[1])


@dataclass(frozen=True)
class BlockParts:
    """The projections of one transformer block that toast rewrites.

    Attention: ``q``, ``k``, ``v`` separately, or ``qkv`` when fused (GPT-2,
    ModernBERT); ``out`` writes into the residual stream. MLP: ``up`` (and
    ``gate`` for gated MLPs such as Llama's; ModernBERT's ``Wi`` holds both
    halves), ``down`` writes into the residual stream.
    """

    q: Projection | None
    k: Projection | None
    v: Projection | None
    qkv: Projection | None
    out: Projection
    up: Projection
    gate: Projection | None
    down: Projection


def find_projections(block: nn.Module) -> dict[str, Projection]:
    """Every projection of ``block`` whose path toast recognises, by part
    (``"q"``, ``"qkv"``, ``"out"``, ``"up"``, ``"down"``...), without
    requiring the full set that :func:`block_parts` does: a block whose
    attention toast cannot name may still show its MLP down-projection.
    Raises ``ValueError`` when two modules match one part."""
    found: dict[str, Projection] = {}
    for path, module in block.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
            continue
        if isinstance(module, nn.Linear):
            layout = "linear"
        elif type(module).__name__ == "Conv1D":
            layout = "conv1d"
        else:
            continue
        for part, suffixes in _PART_SUFFIXES.items():
            exact = _EXACT_PATHS.get(part, ())
            if path in exact or any(path == s or path.endswith("." + s) for s in suffixes):
                if part in found:
                    raise ValueError(
                        f"{type(block).__name__} has two candidates for its {part!r} "
                        f"projection ({found[part].path!r} and {path!r})"
                    )
                found[part] = Projection(path, module, layout)
    return found


def block_parts(block: nn.Module) -> BlockParts:
    """The attention and MLP projections of ``block`` (see :class:`BlockParts`).

    Raises ``ValueError`` naming what is missing when the block's layout is
    not one toast knows.
    """
    found = find_projections(block)
    separate = all(p in found for p in ("q", "k", "v"))
    missing = [p for p in ("out", "up", "down") if p not in found]
    if not separate and "qkv" not in found:
        missing.insert(0, "q/k/v (or a fused qkv)")
    if missing:
        raise ValueError(
            f"cannot find the {', '.join(missing)} projection(s) of {type(block).__name__}; "
            f"found {sorted(p.path for p in found.values())}"
        )
    return BlockParts(
        q=found.get("q") if separate else None,
        k=found.get("k") if separate else None,
        v=found.get("v") if separate else None,
        qkv=None if separate else found["qkv"],
        out=found["out"],
        up=found["up"],
        gate=found.get("gate"),
        down=found["down"],
    )


# Names of the modules that read the final state: poolers and task heads.
_HEAD_NAMES = ("pooler", "classifier", "lm_head", "score", "head", "qa_outputs", "cls")


def find_head(model: nn.Module, blocks: str | None = None) -> dict[str, nn.Module]:
    """The pooler and task-head modules of ``model`` by dotted path (possibly
    empty), i.e. the known head names outside the block list."""
    stack = find_blocks(model, blocks)
    heads: dict[str, nn.Module] = {}
    for path, module in model.named_modules():
        name = path.rpartition(".")[2]
        inside = path == stack.path or path.startswith(stack.path + ".")
        if name in _HEAD_NAMES and not inside and isinstance(module, nn.Module):
            if not any(path.startswith(h + ".") for h in heads):
                heads[path] = module
    return heads
