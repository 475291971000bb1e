"""The transformer blocks of a Hugging Face ViT-like model, in global order.

Shared by the methods that work inside ViT blocks (ToaSt's heads and TCS,
token merging). ToaSt rewrites two parts of every block: the attention's ``q_proj``,
``k_proj``, ``v_proj``, ``o_proj`` (with ``head_dim``, ``scaling`` and
``num_attention_heads`` on the attention module, as HF ViT, DeiT, DINOv2,
ViT-MAE and Swin define them in transformers 5.x) and the MLP's ``fc1`` /
``fc2``. Blocks are numbered globally in forward order: a Swin model's
stages are concatenated (block 0 is the first block of stage 0). An MAE
pre-training decoder is not part of the encoder and is left out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from torch import nn

from toast._validation import check
from toast.hf.model.blocks import MODEL, BlockStack

__all__ = [
    "SUPPORTED_TYPES",
    "TOKEN_MAP_ATTR",
    "Attention",
    "VitBlock",
    "VitModel",
    "merged_row",
    "vit_blocks",
    "vit_view",
]


class Attention(Protocol):
    """The attention attributes ToaSt reads and rewrites (HF's ViT-family
    self-attention in transformers 5.x): the four projections, the heads and
    their width, and the softmax scale."""

    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear
    num_attention_heads: int
    head_dim: int
    scaling: float


#: The attention-module attribute through which a method that merges tokens
#: between a block's attention and its MLP (token merging) publishes, for
#: the MLP call only, where each attention token went: a ``(B, N_attention)``
#: index into the MLP's tokens (None: no merge). A method reading the
#: attention inside the MLP (Token Channel Selection's CLS row) maps its
#: rows with :func:`merged_row`.
TOKEN_MAP_ATTR = "toast_token_map"

SUPPORTED_TYPES = ("vit", "deit", "dinov2", "dinov2_with_registers", "vit_mae", "swin")
_STAGE = re.compile(r"(?:^|\.)layers\.(\d+)\.blocks\.\d+$")


@dataclass(frozen=True)
class VitBlock:
    """One block: its global ``index``, Swin ``stage`` (0 for plain ViTs),
    dotted ``path`` and the modules ToaSt rewrites."""

    index: int
    stage: int
    path: str
    block: nn.Module
    attention: Attention
    mlp: nn.Module

    @property
    def heads(self) -> int:
        return int(self.attention.num_attention_heads)

    @property
    def head_dim(self) -> int:
        """The current width per head (after dense pruning: the kept width)."""
        return int(self.attention.head_dim)


@dataclass(frozen=True)
class VitModel:
    """The blocks of a model and the layout facts TCS needs: ``prefix`` is
    the number of non-patch tokens at the start of the sequence (CLS, DeiT's
    distillation token, DINOv2 registers; 0 for Swin) and ``has_cls``
    whether token 0 is a CLS token."""

    model_type: str
    blocks: tuple[VitBlock, ...]
    prefix: int

    @property
    def has_cls(self) -> bool:
        return self.prefix > 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def stage_firsts(self) -> list[int]:
        """Global indices of the first block of every stage."""
        seen: dict[int, int] = {}
        for b in self.blocks:
            seen.setdefault(b.stage, b.index)
        return sorted(seen.values())


def _attention(module: object) -> Attention | None:
    """``module`` as an :class:`Attention`, or None if it is not one."""
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    if not all(isinstance(getattr(module, n, None), nn.Linear) for n in names):
        return None
    if not all(hasattr(module, n) for n in ("num_attention_heads", "head_dim", "scaling")):
        return None
    return cast(Attention, module)


def vit_blocks(model: nn.Module) -> VitModel:
    """Finds the encoder blocks of an HF ViT, DeiT, DINOv2 (with or without
    registers), ViT-MAE or Swin model (base model or a task model around
    one). Raises ``ValueError`` for other models."""
    check("model", model, MODEL)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_TYPES:
        raise ValueError(
            f"ToaSt for ViTs supports Hugging Face {list(SUPPORTED_TYPES)} models, got "
            f"{type(model).__name__} (model_type {model_type!r})"
        )
    found: list[tuple[str, nn.Module, Attention, nn.Module, int]] = []
    for path, module in model.named_modules():
        if "decoder" in path.split("."):
            continue
        attention = _attention(getattr(module, "attention", None))
        mlp = getattr(module, "mlp", None)
        if attention is None or not isinstance(mlp, nn.Module):
            continue
        match = _STAGE.search(path)
        stage = int(match.group(1)) if match else 0
        found.append((path, module, attention, mlp, stage))
    if not found:
        raise ValueError(
            f"no ViT blocks (attention.q_proj..o_proj + mlp) in {type(model).__name__}"
        )
    blocks = tuple(
        VitBlock(i, stage, path, module, attention, mlp)
        for i, (path, module, attention, mlp, stage) in enumerate(found)
    )
    if model_type == "swin":
        prefix = 0
    else:
        prefix = (2 if model_type == "deit" else 1) + int(
            getattr(config, "num_register_tokens", 0) or 0
        )
    return VitModel(model_type, blocks, prefix)


def merged_row(attention: object, row: torch.Tensor) -> torch.Tensor:
    """``row`` (``(B, N_attention)``, e.g. the CLS token's attention over
    the keys) carried to the MLP's tokens when the block merged tokens in
    between (:data:`TOKEN_MAP_ATTR`): a merged token gets the summed
    attention of the tokens it stands for (a mixed one, their attention in
    the shares it took: the map is then ``(B, N_mlp, N_attention)``; the
    map may be a callable that builds it).
    Unchanged without a merge."""
    index = getattr(attention, TOKEN_MAP_ATTR, None)
    if index is None:
        return row
    if callable(index):  # built on demand (see the merge's installed forward)
        index = index()
    if index.dim() == 3:
        return (index.to(row.dtype) @ row.unsqueeze(-1))[..., 0]
    out = torch.zeros(row.shape[0], int(index.max()) + 1, dtype=row.dtype, device=row.device)
    return out.scatter_add_(1, index, row)


def vit_view(model: nn.Module, stack: BlockStack) -> VitModel | None:
    """The ViT blocks of ``model`` found with its block ``stack``, or None
    (not a supported ViT, or its ViT blocks are not the stack's: Swin's
    stages). Cached on the stack, so every method that asks during one
    public call shares a single discovery."""
    if "vit" not in stack.views:
        stack.views["vit"] = _discover(model, stack)
    view: VitModel | None = stack.views["vit"]
    return view


def _discover(model: nn.Module, stack: BlockStack) -> VitModel | None:
    if getattr(getattr(model, "config", None), "model_type", None) not in SUPPORTED_TYPES:
        return None
    try:
        vm = vit_blocks(model)
    except (ValueError, TypeError):
        return None
    return vm if vm.num_blocks == stack.num_blocks else None
