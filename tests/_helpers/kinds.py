"""A translator module of any kind in the table (:data:`toast.core.kinds.KINDS`),
built the way a load builds it, so that tests iterate the table instead of
keeping a list of kinds of their own."""

from __future__ import annotations

import torch
from torch import nn

from toast.core.kinds import kind_entry
from toast.translators import build_translator


def spec_of(kind: str, dim: int) -> dict:
    """The spec toast saves for a ``dim``-feature translator of ``kind``
    (a linear kind has a bias when its entry says so)."""
    entry = kind_entry(kind)
    fields = {
        "identity": {},
        "linear": {"in_features": dim, "out_features": dim, "bias": entry.bias},
        "diagonal": {"dim": dim},
        "mlp": {"dim": dim, "hidden": max(1, dim // 2)},
        "resmlp": {"dim": dim, "dropout": 0.2},
    }[entry.module]
    return {"kind": kind, **fields}


def translator_of(kind: str, dim: int, seed: int = 0) -> nn.Module:
    """A translator of ``kind`` on ``dim`` features with random (seeded)
    parameters, in eval mode (Res-MLP's dropout off)."""
    module = build_translator(spec_of(kind, dim))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / dim**0.5)
    return module.eval()
