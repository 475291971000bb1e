"""Translator modules and their JSON specs.

Closed-form translators (identity, linear, affine, diagonal, orthogonal) come
from :func:`toast.fit_translator` and become modules through
:func:`toast.translators.translator_module`. The trained ones of TOAST's ablation live
here:

- :class:`MLPTranslator`: ``Linear(d, d/2) → GELU → Linear(d/2, d)``.
- :class:`ResMLPTranslator`: ``x̂ = LN₁(x)``, ``LN₂(x̂ + Linear(SiLU(Linear(x̂))))``
  with dropout between the two linears.

Every translator module has a JSON spec (:func:`translator_spec`) from which
:func:`build_translator` rebuilds an uninitialised module of the same
structure, so a saved model reloads from safetensors without pickling code.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from toast._validation import Interval, check
from toast.core.kinds import KINDS, ModuleShape, kind_entry, kind_names

__all__ = [
    "FITTED_KIND",
    "LINEAR_KINDS",
    "DiagonalMap",
    "MLPTranslator",
    "ResMLPTranslator",
    "build_translator",
    "translator_spec",
]


#: The attribute of a translator module naming the kind it was fitted as
#: (:data:`toast.core.kinds.KINDS`); its spec's ``kind`` is that name.
FITTED_KIND = "toast_fitted_kind"
#: Spec kinds that build an ``nn.Linear`` (a matrix, with or without a bias):
#: those of :data:`~toast.core.kinds.KINDS` stored as ``"linear"``; kept for
#: its importers, toast itself reads the table.
LINEAR_KINDS = kind_names(module="linear")


class DiagonalMap(nn.Module):
    """``y = x * scale + bias`` (a per-feature translator)."""

    def __init__(self, scale: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.scale = nn.Parameter(scale)
        self.bias = nn.Parameter(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.bias


class MLPTranslator(nn.Module):
    """``Linear(dim, hidden) → GELU → Linear(hidden, dim)``; ``hidden`` defaults
    to ``dim // 2`` (TOAST's MLP ablation)."""

    def __init__(self, dim: int, hidden: int | None = None, **factory: Any) -> None:
        super().__init__()
        hidden = max(1, dim // 2) if hidden is None else int(hidden)
        self.dim, self.hidden = int(dim), hidden
        self.net = nn.Sequential(
            nn.Linear(dim, hidden, **factory), nn.GELU(), nn.Linear(hidden, dim, **factory)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ResMLPTranslator(nn.Module):
    """TOAST's Res-MLP: ``x̂ = LN₁(x)``; ``LN₂(x̂ + W₂ · dropout(SiLU(W₁ x̂)))``.

    Both linears are ``dim × dim``; ``dropout`` is 0.2 as in TOAST's code.
    """

    def __init__(self, dim: int, dropout: float = 0.2, **factory: Any) -> None:
        super().__init__()
        check("dropout", dropout, Interval(float, 0, 1, closed="left"))
        self.dim, self.dropout = int(dim), float(dropout)
        self.norm_in = nn.LayerNorm(dim, **factory)
        self.ff = nn.Sequential(
            nn.Linear(dim, dim, **factory),
            nn.SiLU(),
            nn.Dropout(dropout),
            nn.Linear(dim, dim, **factory),
        )
        self.norm_out = nn.LayerNorm(dim, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm_in(x)
        return self.norm_out(h + self.ff(h))


def _spec_kind(module: nn.Module, shape: ModuleShape) -> str:
    """The kind ``module`` was fitted as, when the table stores that kind as
    ``shape``; else ``shape``'s own kind (an ``nn.Linear`` built by hand is
    ``"linear"``), so that a save never names a kind its loader rebuilds
    differently."""
    fitted = getattr(module, FITTED_KIND, shape)
    entry = KINDS.get(fitted) if isinstance(fitted, str) else None
    return fitted if entry is not None and entry.module == shape else shape


def translator_spec(module: nn.Module) -> dict[str, Any]:
    """The JSON-able description of a translator module's structure (not its
    weights): enough for :func:`build_translator` to rebuild it."""
    if isinstance(module, nn.Identity):
        return {"kind": _spec_kind(module, "identity")}
    if isinstance(module, DiagonalMap):
        return {"kind": _spec_kind(module, "diagonal"), "dim": int(module.scale.shape[0])}
    if isinstance(module, MLPTranslator):
        return {"kind": _spec_kind(module, "mlp"), "dim": module.dim, "hidden": module.hidden}
    if isinstance(module, ResMLPTranslator):
        return {"kind": _spec_kind(module, "resmlp"), "dim": module.dim, "dropout": module.dropout}
    if type(module) is nn.Linear:
        return {
            "kind": _spec_kind(module, "linear"),
            "in_features": module.in_features,
            "out_features": module.out_features,
            "bias": module.bias is not None,
        }
    raise TypeError(
        f"cannot describe a translator of type {type(module).__name__}; toast saves "
        "Identity, Linear, DiagonalMap, MLPTranslator and ResMLPTranslator"
    )


def _build_module(shape: ModuleShape, spec: dict[str, Any], **factory: Any) -> nn.Module:
    if shape == "identity":
        return nn.Identity()
    if shape == "diagonal":
        dim = int(spec["dim"])
        return DiagonalMap(torch.ones(dim, **factory), torch.zeros(dim, **factory))
    if shape == "mlp":
        return MLPTranslator(int(spec["dim"]), int(spec["hidden"]), **factory)
    if shape == "resmlp":
        return ResMLPTranslator(int(spec["dim"]), float(spec["dropout"]), **factory)
    in_features, out_features = int(spec["in_features"]), int(spec["out_features"])
    return nn.Linear(in_features, out_features, bias=bool(spec["bias"]), **factory)


def build_translator(spec: dict[str, Any], **factory: Any) -> nn.Module:
    """A translator module of the structure ``spec`` describes (weights
    uninitialised or random: load them afterwards), of the module shape its
    kind has in :data:`toast.core.kinds.KINDS`."""
    if not isinstance(spec, dict) or "kind" not in spec:
        raise ValueError(f"a translator spec is a dict with a 'kind', got {spec!r}")
    name = spec["kind"]
    try:
        shape = kind_entry(name).module
    except ValueError:
        raise ValueError(f"unknown translator kind {name!r} in spec {spec!r}") from None
    try:
        module = _build_module(shape, spec, **factory)
    except KeyError as exc:
        raise ValueError(f"translator spec {spec!r} lacks {exc.args[0]!r}") from None
    setattr(module, FITTED_KIND, name)  # its spec names the kind again when resaved
    return module
