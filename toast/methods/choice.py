"""How a method's plans are chosen without measuring them: grouped by
family, best predicted first (:func:`by_family`, the order a search
measures in), and the plan one measurement would take
(:func:`first_choice`, what ``toast.compress`` applies by default)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

__all__ = ["by_family", "first_choice"]


class _Planned(Protocol):
    """What choosing reads of a plan (:class:`toast.methods.stages.Plan`,
    which imports this module, so it is named by what it has)."""

    @property
    def methods(self) -> tuple[str, ...]: ...
    @property
    def family(self) -> str: ...
    @property
    def predicted_error(self) -> float: ...
    @property
    def params_after(self) -> int: ...
    @property
    def key(self) -> str: ...
    @property
    def blocks_removed(self) -> int: ...


Plan = TypeVar("Plan", bound=_Planned)


def by_family(candidates: Sequence[Plan]) -> dict[str, list[Plan]]:
    """Plans grouped by family, best predicted first (ties: the
    smaller model, then the key, so the order is deterministic); single
    methods before their combinations, and a variant of a family (named
    ``"<family>-<variant>"`` with the same methods, e.g. ``"tome-delayed"``,
    a schedule of ``"tome"``) after every family that is not one, so that a
    budget smaller than the number of families measures every method alone
    before a variant of one or any combination."""
    families: dict[str, list[Plan]] = {}
    for c in sorted(candidates, key=lambda c: (c.predicted_error, c.params_after, c.key)):
        families.setdefault(c.family, []).append(c)

    def rank(f: str) -> tuple[int, bool, str]:
        methods = families[f][0].methods
        variant = any(f.startswith(f"{g}-") and families[g][0].methods == methods for g in families)
        return len(methods), variant, f

    return {f: families[f] for f in sorted(families, key=rank)}


def first_choice(
    plans: Sequence[Plan], count: int, amount: Callable[[Plan], int] | None = None
) -> Plan | None:
    """The plan a measurement budget of one takes among ``plans`` removing
    exactly ``count`` (blocks, or the units ``amount(plan)`` counts): the
    best predicted of the first family (:func:`by_family`); None when no
    plan has that size."""
    size = amount or (lambda p: p.blocks_removed)
    exact = [p for p in plans if size(p) == count and math.isfinite(p.predicted_error)]
    families = by_family(exact)
    return next(iter(families.values()))[0] if families else None
