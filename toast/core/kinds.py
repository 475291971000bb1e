"""The translator kinds toast knows: one table that fitting, saving,
loading and the parameter and MAC counts all read.

A translator's *kind* names how it was obtained (``"affine"``: least
squares with a bias; ``"patch_ridge"``: least squares shrunk towards
LinearPatch's map). What a reader needs of a kind is an entry of
:data:`KINDS`:

- ``module``: the shape of module it is stored as, one of
  :data:`MODULES` (``"linear"``: one ``nn.Linear``; ``"diagonal"``:
  :class:`toast.translators.DiagonalMap`; ``"mlp"``, ``"resmlp"``: the
  trained modules of :mod:`toast.translators`; ``"identity"``). A save
  records the kind and rebuilds the module of this shape on load, so the
  loaders need nothing else to know a kind;
- ``bias``: whether the map has a bias (the config-only counts of
  :mod:`toast.accounting` count ``d`` parameters for it; a saved spec
  records whether the fitted module actually kept one);
- ``hadamard``: a ``d × d`` map in the Hadamard basis
  (:mod:`toast.core.patch`);
- ``fit``: how toast obtains it: ``"moments"`` in closed form from the
  moments of two states, ``"scales"`` from a pass over the data
  (LinearPatch's per-sample magnitudes), ``"trained"`` by gradient steps.

Adding a kind stored as one of these modules is one entry here; the
parameter and MAC counts follow from its module (:meth:`Kind.params`,
:meth:`Kind.macs`). The exception is ``toast_modeling.py``
(:mod:`toast.io.hub_model`), which loads saves where toast is not installed
and so keeps one copy of the kinds' modules, checked equal to this table by
a test. Readers look a kind up when they run, not when they are imported,
so a kind added to :data:`KINDS` (a test does so) is seen by all of them.

No torch here: the counts and the NumPy core read this table too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "KINDS",
    "MODULES",
    "Fit",
    "Kind",
    "ModuleShape",
    "TranslatorKind",
    "kind_entry",
    "kind_names",
]

#: The shapes of module a translator is stored as (see the module docstring).
ModuleShape = Literal["identity", "linear", "diagonal", "mlp", "resmlp"]
MODULES: tuple[ModuleShape, ...] = ("identity", "linear", "diagonal", "mlp", "resmlp")
#: How toast obtains a translator of a kind.
Fit = Literal["moments", "scales", "trained"]
#: A translator kind's name: a key of :data:`KINDS` (a ``Literal`` of the
#: names would be a second list of them to keep equal to the table).
TranslatorKind = str


@dataclass(frozen=True)
class Kind:
    """One translator kind (see the module docstring for the fields)."""

    name: str
    module: ModuleShape
    bias: bool = False
    hadamard: bool = False
    fit: Fit = "moments"

    def params(self, dim: int) -> int:
        """Parameters of one translator of this kind on ``dim`` features:
        identity 0, a linear map ``d²`` (``d² + d`` with a bias), diagonal
        ``2d``, MLP ``2·d·(d//2) + d//2 + d``, Res-MLP ``2(d² + d) + 4d``."""
        d, hidden = int(dim), max(1, int(dim) // 2)
        return {
            "identity": 0,
            "linear": d * d + (d if self.bias else 0),
            "diagonal": 2 * d,
            "mlp": d * hidden + hidden + hidden * d + d,
            "resmlp": 2 * (d * d + d) + 4 * d,
        }[self.module]

    def macs(self, dim: int) -> tuple[int, int]:
        """``(dense, norm)``: the multiply-adds of its matrix products and the
        elements its LayerNorms normalise, per token on ``dim`` features
        (element-wise scales and biases are not counted)."""
        d, hidden = int(dim), max(1, int(dim) // 2)
        return {
            "identity": (0, 0),
            "linear": (d * d, 0),
            "diagonal": (0, 0),
            "mlp": (2 * d * hidden, 0),
            "resmlp": (2 * d * d, 2 * d),
        }[self.module]


#: Every translator kind, by name. The order is the order readers list them
#: in (options in error messages, the aliases derived from it).
KINDS: dict[str, Kind] = {
    entry.name: entry
    for entry in (
        Kind("identity", "identity"),
        Kind("linear", "linear"),
        Kind("affine", "linear", bias=True),
        Kind("diagonal", "diagonal", bias=True),
        Kind("orthogonal", "linear"),
        Kind("linearpatch", "linear", hadamard=True, fit="scales"),
        Kind("rotated_diagonal", "linear", hadamard=True),
        Kind("patch_ridge", "linear", hadamard=True),
        Kind("mlp", "mlp", bias=True, fit="trained"),
        Kind("resmlp", "resmlp", bias=True, fit="trained"),
    )
}


def kind_entry(name: str) -> Kind:
    """The entry of ``name``; ``ValueError`` naming the kinds when there is none."""
    entry = KINDS.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ValueError(f"unknown translator kind {name!r}; toast knows {list(KINDS)}")
    return entry


def kind_names(
    *, module: ModuleShape | None = None, hadamard: bool | None = None, fit: Fit | None = None
) -> tuple[str, ...]:
    """The names of the kinds whose entries match every field given, in
    table order (``kind_names()``: all of them)."""
    return tuple(
        entry.name
        for entry in KINDS.values()
        if (module is None or entry.module == module)
        and (hadamard is None or entry.hadamard == hadamard)
        and (fit is None or entry.fit == fit)
    )
