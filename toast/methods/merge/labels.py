"""How a token reducer's setting is named, wherever it comes from (the
search's grid, :mod:`toast.methods.merge.stages`, or a user's config,
:mod:`toast.methods.merge.configured`): its key in its plan (``MergePart.setting``), its
plan family, and the token-block visits its proxy counts. One naming, so
that ``compress`` with a setting the search has gives the search's plan.
Imports no torch."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

__all__ = [
    "NORM_LABELS",
    "atm_key",
    "family",
    "pitome_key",
    "rapid_key",
    "schedule_suffix",
    "tome_key",
    "transforming_key",
    "visits",
]

#: How a setting's label names its merge norm.
NORM_LABELS = {"average": "", "max": ", MLERP", "mean": ", mean norm"}


def schedule_suffix(schedule: str) -> str:
    """A setting label's schedule part: none for the constant schedule."""
    return "" if schedule == "constant" else f", {schedule}"


def tome_key(r: int, schedule: str, norm: str) -> Hashable:
    """A ToMe setting's key: ``r`` for the paper's own (as before other
    settings existed), else its label."""
    if schedule == "constant" and norm == "average":
        return r
    return f"ToMe r={r}{schedule_suffix(schedule)}{NORM_LABELS[norm]}"


def rapid_key(r: int | Sequence[int], prune_until: int, schedule: str) -> str:
    """A RAPID setting's key: ``r`` (or one count per block), the first
    merging block, the schedule."""
    return f"RAPID r={r}, prune<{prune_until}{schedule_suffix(schedule)}"


def transforming_key(r: int | Sequence[int], temperature: float) -> str:
    """A Token Transforming setting's key: a constant ``r`` and the temperature."""
    return f"Token Transforming r={r}, τ={temperature:g}"


def atm_key(alpha: float, beta: float) -> str:
    """An ATM setting's key: the threshold schedule's ``alpha`` and ``beta``."""
    return f"ATM α={alpha:g}, β={beta:g}"


def pitome_key(r: int | Sequence[int], margin: float) -> str:
    """A PiToMe setting's key: a constant ``r`` and the first block's margin."""
    return f"PiToMe r={r}, margin {margin:g}"


def family(name: str, schedule: str, norm: str) -> str:
    """The family of a plan of reducer ``name`` alone: the name, suffixed
    by the schedule unless it is the constant one and by the merge norm
    unless it is the paper's average."""
    parts = [name]
    if schedule != "constant":
        parts.append(schedule)
    if norm != "average":
        parts.append(norm)
    return "-".join(parts)


def visits(tokens: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """Token-block visits, and those reduced away."""
    pairs = list(tokens)
    return sum(n for n, _ in pairs), sum(n - kept for n, kept in pairs)
