"""The widths token merging's MAC count needs (:class:`toast.methods.merge.macs.MergeWidths`),
read from a model's modules and one forward of an example input, so that
what other methods changed (pruned heads, removed blocks) is counted as it is."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from toast.hf.model.blocks import BlockStack
from toast.linear_macs import linear_counts, synthetic_example
from toast.methods.merge.macs import BlockWidths, MergeWidths
from toast.methods.merge.sites import MergeSites, Site

__all__ = ["example_input", "merge_widths"]


def _linear_macs(module: nn.Module) -> int:
    """MACs per token of every ``nn.Linear`` inside ``module``."""
    return sum(m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear))


def _block_widths(site: Site) -> BlockWidths:
    heads, head_dim, _ = site.heads()
    return BlockWidths(_linear_macs(site.attention), _linear_macs(site.block.mlp), heads * head_dim)


def _patch_embed(model: nn.Module, patches: int) -> int:
    """MACs per image of the first convolution (the patch embedding), 0 without one."""
    conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    if conv is None:
        return 0
    kh, kw = conv.kernel_size
    return patches * conv.out_channels * (conv.in_channels // conv.groups) * kh * kw


def example_input(model: nn.Module, data: Any = None, image_size: int | None = None) -> Any:
    """One input for ``model`` at the size it will run at: the first batch
    of ``data`` when given (token counts follow the images, not the
    config: DINOv2's config says 518 while it runs at 224), else an image
    of ``image_size``, else of its config's size or a timm-layout model's
    ``patch_embed.img_size``; ``ValueError`` when none says."""
    if data is not None:
        first = next(iter(data), None)
        if first is not None:
            return first
    if getattr(model, "config", None) is not None:
        return synthetic_example(model, image_size, None)
    if image_size is not None:
        return torch.zeros(1, 3, image_size, image_size)
    size = getattr(getattr(model, "patch_embed", None), "img_size", None)
    if size is None:
        raise ValueError(
            f"cannot tell the image size of {type(model).__name__}: pass example= (one image batch)"
        )
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    return torch.zeros(1, 3, int(h), int(w))


def merge_widths(
    model: nn.Module, sites: MergeSites, stack: BlockStack, example: Any = None
) -> MergeWidths:
    """``model``'s widths (call it before merging is installed): the tokens
    entering the first block and the linear MACs outside the blocks come
    from one forward of ``example`` (default :func:`example_input`)."""
    counts = linear_counts(model, example_input(model) if example is None else example, stack)
    tokens = counts.tokens
    return MergeWidths(
        tokens=tokens,
        prefix=sites.prefix,
        blocks=tuple(_block_widths(s) for s in sites.sites),
        patch_embed=_patch_embed(model, tokens - sites.prefix),
        outside=counts.outside,
    )
