"""Where token merging reads a block's parts: Hugging Face ViT-family blocks
(found with the shared :func:`toast.hf.model.vit.vit_blocks`) and timm's
layout (blocks of an ``nn.Sequential`` with ``norm1``, ``attn.qkv`` (fused),
``attn.proj``, ``attn.num_heads``, optional ``ls1`` / ``ls2``, ``norm2``,
``mlp``).

Every part is read from the block at call time, so changes other methods
make after merging is installed compose: ToaSt's head pruning rebuilds the
projections and sets ``head_dim`` / ``scaling``, Token Channel Selection
swaps the ``mlp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from toast.hf.model.blocks import BlockStack, find_blocks
from toast.hf.model.vit import SUPPORTED_TYPES, vit_blocks

__all__ = ["MergeSites", "Site", "find_sites", "timm_sites"]

#: The HF model types token merging supports (Swin's windowed attention has
#: no global token set to merge).
MERGE_TYPES = tuple(t for t in SUPPORTED_TYPES if t != "swin")


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass(frozen=True)
class Site:
    """One block token merging runs in: its position ``index`` in the block
    list, its ``path``, the ``block`` and its ``kind`` (``"hf"`` or ``"timm"``)."""

    index: int
    path: str
    block: Any  # an nn.Module whose parts are looked up by name at call time
    kind: str

    # -- the parts, read at call time -------------------------------------------

    def norms(self) -> tuple[nn.Module, nn.Module]:
        b = self.block
        if self.kind == "timm" or hasattr(b, "norm1"):
            return b.norm1, b.norm2
        return b.layernorm_before, b.layernorm_after

    def scales(self) -> tuple[nn.Module | None, nn.Module | None]:
        """The layer scales after attention and MLP (None: none)."""
        names = ("ls1", "ls2") if self.kind == "timm" else ("layer_scale1", "layer_scale2")
        return getattr(self.block, names[0], None), getattr(self.block, names[1], None)

    def heads(self) -> tuple[int, int, float]:
        """``(heads, head_dim, softmax scale)`` now."""
        if self.kind == "timm":
            attn = self.block.attn
            heads = int(attn.num_heads)
            head_dim = attn.qkv.out_features // 3 // heads
            return heads, head_dim, float(getattr(attn, "scale", head_dim**-0.5))
        a = self.block.attention
        return int(a.num_attention_heads), int(a.head_dim), float(a.scaling)

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of ``h`` (``(B, N, D)``), each ``(B, H, N, d)``."""
        b, n, _ = h.shape
        heads, head_dim, _ = self.heads()
        if self.kind == "timm":
            attn = self.block.attn
            q, k, v = attn.qkv(h).reshape(b, n, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
            q_norm = getattr(attn, "q_norm", None) or _identity
            k_norm = getattr(attn, "k_norm", None) or _identity
            return q_norm(q), k_norm(k), v
        a = self.block.attention
        shape = (b, n, -1, head_dim)
        q = a.q_proj(h).view(shape).transpose(1, 2)
        k = a.k_proj(h).view(shape).transpose(1, 2)
        return q, k, a.v_proj(h).view(shape).transpose(1, 2)

    def out(self, context: torch.Tensor) -> torch.Tensor:
        """The output projection of the attention ``context`` (``(B, H, N, d)``)."""
        b, _, n, _ = context.shape
        flat = context.transpose(1, 2).reshape(b, n, -1)
        if self.kind == "timm":
            attn = self.block.attn
            norm = getattr(attn, "norm", None)
            return attn.proj(norm(flat) if isinstance(norm, nn.Module) else flat)
        return self.block.attention.o_proj(flat)

    @property
    def attention(self) -> nn.Module:
        attention: nn.Module = self.block.attn if self.kind == "timm" else self.block.attention
        return attention


@dataclass(frozen=True)
class MergeSites:
    """The blocks of one model token merging runs in, in forward order, and
    ``prefix``, the protected tokens at the start of the sequence."""

    sites: tuple[Site, ...]
    prefix: int
    kind: str

    @property
    def num_blocks(self) -> int:
        return len(self.sites)


def _is_timm_block(block: nn.Module) -> bool:
    attn = getattr(block, "attn", None)
    return (
        all(isinstance(getattr(block, n, None), nn.Module) for n in ("norm1", "norm2", "mlp"))
        and isinstance(getattr(attn, "qkv", None), nn.Linear)
        and isinstance(getattr(attn, "proj", None), nn.Linear)
        and isinstance(getattr(attn, "num_heads", None), int)
    )


def _timm_prefix(model: nn.Module) -> int:
    declared = getattr(model, "num_prefix_tokens", None)
    if isinstance(declared, int):
        return declared
    tokens = sum(getattr(model, n, None) is not None for n in ("cls_token", "dist_token"))
    registers = getattr(model, "reg_token", None)
    return tokens + (int(registers.shape[1]) if isinstance(registers, torch.Tensor) else 0)


def timm_sites(model: nn.Module, stack: BlockStack | None = None) -> MergeSites | None:
    """The sites of a timm-layout ViT (None when ``model`` is not one)."""
    try:
        stack = find_blocks(model, stack)
    except ValueError:
        return None
    blocks = list(stack.blocks)
    if not isinstance(stack.blocks, nn.Sequential) or not all(map(_is_timm_block, blocks)):
        return None
    sites = tuple(Site(i, f"{stack.path}.{i}", b, "timm") for i, b in enumerate(blocks))
    return MergeSites(sites, _timm_prefix(model), "timm")


def find_sites(model: nn.Module, stack: BlockStack | None = None) -> MergeSites:
    """The merge sites of an HF ViT, DeiT, DINOv2 (with or without registers),
    ViT-MAE encoder or timm-layout ViT; ``ValueError`` for other models."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in MERGE_TYPES:
        vm = vit_blocks(model)
        sites = tuple(Site(b.index, b.path, b.block, "hf") for b in vm.blocks)
        return MergeSites(sites, vm.prefix, "hf")
    found = timm_sites(model, stack)
    if found is None:
        raise ValueError(
            f"token merging supports Hugging Face {list(MERGE_TYPES)} models and timm-layout "
            f"ViTs (blocks with norm1, attn.qkv, attn.proj, norm2, mlp); got "
            f"{type(model).__name__} (model_type {model_type!r})"
        )
    return found
