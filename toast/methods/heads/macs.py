"""Multiply-accumulates of ViTs in ToaSt's convention, from a config alone.

ToaSt's "GFLOPs" (paper Tables 1-26; the convention of ToMe/DiffRate and of
the reference code's ``flops.py``) are GMACs of the matmuls only:

- MHSA per block: ``κ · (4·N·D² + 2·N²·D)`` with ``κ = floor(d_k (1 − ρ)) / d_k``
  (Q, K, V and the output projection ``4ND²``, ``QKᵀ`` and ``AV`` ``2N²D``;
  every term scales with the kept head width). Swin's windowed attention
  replaces ``2N²D`` by ``2·N·w²·D`` (``w²`` = 49 tokens per window).
- FFN per block: ``N·D·F·[(1 − r_FC1) + (1 − r_FC2)]`` (``4ND²[...]`` with
  the usual ``F = 4D``); the TCS fractions are not floored, and scoring is
  not counted (the reference code's convention).
- Patch embedding ``N_p · D · (C_in · P²)``; classifier ``D · classes``
  (1000 by default); Swin patch merging ``N_s · 4C_{s−1} · C_s`` between
  stages. LayerNorm, softmax, GELU and residuals are not counted.

Supported configs: ViT (``vit``), DeiT (``deit``, two prefix tokens),
DINOv2 (``dinov2``, the plain MLP), ViT-MAE (``vit_mae``: the fine-tuned
classifier sees every patch, so ``mask_ratio`` is ignored) and Swin
(``swin``). Block 0 is dense by default (``skip=(0,)``); a named schedule
brings its own head sparsity unless ``head_sparsity`` is given.

:func:`toast.macs` (:mod:`toast.accounting`) counts the other conventions
(plain MACs, torch's FLOPs, TOAST's fvcore-style GFLOPs) of dense and
block-removed models; ToaSt's pruned widths and TCS fractions are counted
here only.

This module does not import torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from toast._validation import Interval, check
from toast.accounting import pair
from toast.methods.heads.schedules import (
    Schedule,
    get_schedule,
    head_keep,
    per_block_sparsity,
    skip_blocks,
)

__all__ = ["BlockMacs", "ToastMacReport", "VitArch", "toast_macs", "vit_arch"]

_VIT_TYPES = ("vit", "deit", "dinov2", "dinov2_with_registers", "vit_mae")


@dataclass(frozen=True)
class _Stage:
    dim: int  # D (Swin: C_s)
    heads: int
    head_dim: int
    ffn: int
    depth: int
    tokens: int  # N per image
    window: int  # tokens per attention window (= tokens for a ViT)


@dataclass(frozen=True)
class VitArch:
    """The sizes :func:`toast_macs` needs, read from a config."""

    model_type: str
    stages: tuple[_Stage, ...]
    patch_tokens: int  # patches the embedding produces
    patch_macs_per_token: int  # C_in · P² · D
    prefix: int  # CLS-like tokens (0 for Swin)
    swiglu: bool

    @property
    def num_blocks(self) -> int:
        return sum(s.depth for s in self.stages)

    def stage_of(self) -> list[int]:
        """The stage index of every global block."""
        return [k for k, s in enumerate(self.stages) for _ in range(s.depth)]

    def stage_firsts(self) -> list[int]:
        """Global index of each stage's first block."""
        firsts: list[int] = []
        b = 0
        for s in self.stages:
            firsts.append(b)
            b += s.depth
        return firsts


def vit_arch(config: Any, image_size: int | tuple[int, int] | None = None) -> VitArch:
    """Reads a ViT / DeiT / DINOv2 / ViT-MAE / Swin config (``ValueError``
    for anything else)."""
    mt = getattr(config, "model_type", None)
    image = pair(image_size if image_size is not None else config.image_size)
    patch = pair(config.patch_size)
    channels = int(getattr(config, "num_channels", 3))
    if mt == "swin":
        return _swin_arch(config, image, patch, channels)
    if mt not in _VIT_TYPES:
        raise ValueError(
            f"ToaSt's MAC counter reads {sorted(_VIT_TYPES + ('swin',))} configs, got "
            f"model_type {mt!r} ({type(config).__name__})"
        )
    d = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or d // heads)
    swiglu = bool(getattr(config, "use_swiglu_ffn", False))
    if mt.startswith("dinov2"):
        ffn = int(d * config.mlp_ratio)
    else:
        ffn = int(config.intermediate_size)
    prefix = {"deit": 2}.get(mt, 1) + int(getattr(config, "num_register_tokens", 0) or 0)
    n_p = (image[0] // patch[0]) * (image[1] // patch[1])
    n = n_p + prefix
    stage = _Stage(d, heads, head_dim, ffn, int(config.num_hidden_layers), n, n)
    return VitArch(mt, (stage,), n_p, channels * patch[0] * patch[1] * d, prefix, swiglu)


def _swin_arch(
    config: Any, image: tuple[int, int], patch: tuple[int, int], channels: int
) -> VitArch:
    c = int(config.embed_dim)
    grid = (image[0] // patch[0], image[1] // patch[1])
    window = int(config.window_size)
    stages: list[_Stage] = []
    for k, (depth, heads) in enumerate(zip(config.depths, config.num_heads, strict=True)):
        dim = c * 2**k
        h, w = grid[0] // 2**k, grid[1] // 2**k
        # HF Swin shrinks the window to the feature map when it is smaller.
        win = min(window, h) * min(window, w)
        stages.append(
            _Stage(
                dim,
                int(heads),
                dim // int(heads),
                int(config.mlp_ratio * dim),
                int(depth),
                h * w,
                win,
            )
        )
    return VitArch(
        "swin", tuple(stages), grid[0] * grid[1], channels * patch[0] * patch[1] * c, 0, False
    )


@dataclass(frozen=True)
class BlockMacs:
    """One block's MACs per image, by operation (floats: TCS fractions are
    not floored). ``head_keep`` is the kept width per head."""

    qkv: float
    scores: float  # Q·Kᵀ
    context: float  # A·V
    proj: float
    fc1: float
    fc2: float
    head_keep: int
    head_dim: int

    @property
    def mhsa(self) -> float:
        return self.qkv + self.scores + self.context + self.proj

    @property
    def ffn(self) -> float:
        return self.fc1 + self.fc2

    @property
    def total(self) -> float:
        return self.mhsa + self.ffn


@dataclass(frozen=True)
class ToastMacReport:
    """MACs of one forward pass in ToaSt's convention, part by part."""

    patch_embed: float
    blocks: tuple[BlockMacs, ...]
    merging: tuple[float, ...]  # Swin patch merging, one per stage transition
    classifier: float
    batch: int
    schedule: Schedule

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def mhsa(self) -> float:
        return sum(b.mhsa for b in self.blocks)

    @property
    def ffn(self) -> float:
        return sum(b.ffn for b in self.blocks)

    @property
    def macs(self) -> float:
        """All MACs (per batch)."""
        return self.patch_embed + self.mhsa + self.ffn + sum(self.merging) + self.classifier

    @property
    def gmacs(self) -> float:
        """``macs / 1e9`` — the number in ToaSt's "GFLOPs" columns at batch 1."""
        return self.macs / 1e9

    def shares(self) -> dict[str, float]:
        """Fraction of the blocks' MACs per operation (paper Table 6):
        ``qkv``, ``scores`` (QKᵀ), ``context`` (AV), ``proj``, ``fc1``, ``fc2``."""
        total = self.mhsa + self.ffn
        keys = ("qkv", "scores", "context", "proj", "fc1", "fc2")
        return {k: sum(getattr(b, k) for b in self.blocks) / total for k in keys}

    def to_markdown(self) -> str:
        """A per-block table (MACs in millions per batch)."""
        lines = [
            "| block | d_k' / d_k | MHSA (M) | FC1 ratio | FC2 ratio | FFN (M) |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for b, blk in enumerate(self.blocks):
            lines.append(
                f"| {b} | {blk.head_keep}/{blk.head_dim} | {blk.mhsa / 1e6:.1f} | "
                f"{self.schedule.fc1[b]:g} | {self.schedule.fc2[b]:g} | {blk.ffn / 1e6:.1f} |"
            )
        lines.append("")
        lines.append(
            f"Total {self.gmacs:.3f} GMACs (patch embedding {self.patch_embed / 1e9:.3f}, "
            f"MHSA {self.mhsa / 1e9:.3f}, FFN {self.ffn / 1e9:.3f}, merging "
            f"{sum(self.merging) / 1e9:.3f}, classifier {self.classifier / 1e9:.4f})."
        )
        return "\n".join(lines)


def _block(stage: _Stage, rho: float, r1: float, r2: float) -> BlockMacs:
    n, d, f = stage.tokens, stage.dim, stage.ffn
    keep = head_keep(stage.head_dim, rho) if rho > 0 else stage.head_dim
    inner = stage.heads * keep  # D' = H · d_k'
    return BlockMacs(
        qkv=3.0 * n * d * inner,
        scores=float(n * stage.window * inner),
        context=float(n * stage.window * inner),
        proj=float(n * inner * d),
        fc1=n * d * f * (1.0 - r1),
        fc2=n * f * d * (1.0 - r2),
        head_keep=keep,
        head_dim=stage.head_dim,
    )


def toast_macs(
    config: Any,
    *,
    head_sparsity: float | Sequence[float] | Mapping[int, float] | None = None,
    schedule: Any = None,
    skip: Sequence[int] | str = (0,),
    image_size: int | tuple[int, int] | None = None,
    num_classes: int = 1000,
    batch: int = 1,
) -> ToastMacReport:
    """MACs of ``config``'s model compressed by ToaSt (see the module
    docstring for the convention).

    ``head_sparsity`` is ρ (one number, one per block, or ``{block: ρ}``);
    ``None`` takes the named schedule's ρ, or 0. ``schedule`` is anything
    :func:`toast.methods.heads.schedules.get_schedule` accepts (``None``: no TCS).
    ``skip`` lists blocks kept dense (default ``(0,)``; ``"stage_first"``
    skips the first block of every Swin stage, the Table 13 caption's
    reading). ``batch`` multiplies everything.
    """
    batch = check("batch", batch, Interval(int, 1, None))
    num_classes = check("num_classes", num_classes, Interval(int, 0, None))
    arch = vit_arch(config, image_size)
    sched = get_schedule(schedule, arch.num_blocks)
    if arch.swiglu and sched.active_blocks:
        raise ValueError("TCS (fc1/fc2 ratios) is defined for fc1-GELU-fc2 MLPs, not SwiGLU")
    if head_sparsity is None:
        head_sparsity = sched.head_sparsity
    rho = per_block_sparsity(head_sparsity, arch.num_blocks, skip_blocks(skip, arch.stage_firsts))
    stage_of = arch.stage_of()
    blocks = tuple(
        _block(arch.stages[stage_of[b]], rho[b], sched.fc1[b], sched.fc2[b])
        for b in range(arch.num_blocks)
    )
    merging = tuple(
        float(cur.tokens * 4 * prev.dim * cur.dim)
        for prev, cur in zip(arch.stages, arch.stages[1:], strict=False)
    )
    scale = float(batch)
    return ToastMacReport(
        patch_embed=scale * arch.patch_tokens * arch.patch_macs_per_token,
        blocks=tuple(_scaled(b, scale) for b in blocks),
        merging=tuple(scale * m for m in merging),
        classifier=scale * arch.stages[-1].dim * num_classes,
        batch=batch,
        schedule=sched,
    )


def _scaled(b: BlockMacs, s: float) -> BlockMacs:
    if s == 1.0:
        return b
    return BlockMacs(
        b.qkv * s,
        b.scores * s,
        b.context * s,
        b.proj * s,
        b.fc1 * s,
        b.fc2 * s,
        b.head_keep,
        b.head_dim,
    )
