"""Counting a model's parameters: the one counter every method reports with."""

from __future__ import annotations

from torch import nn

__all__ = ["count_params"]


def count_params(model: nn.Module) -> int:
    """Number of parameters, a tensor shared by several modules counted once
    (tied embeddings count once, as ``model.num_parameters()`` does)."""
    unique = {id(p): p for p in model.parameters()}
    return sum(p.numel() for p in unique.values())
