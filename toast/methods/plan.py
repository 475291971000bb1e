"""A compression recipe (:class:`Plan`) and the parts of it one method owns
(:class:`Part`).

A plan holds what every method's plan has (the blocks removed, the size,
the prediction) and a payload of parts: each a small frozen object of one
method's package (ToaSt's ρ and Token Channel Selection schedule, a token
reducer's setting, the sub-layers removed) that says how it reads in the
plan's key, label and dict. A method with a setting of its own adds a
part in its package; this module stays as it is.

The key is a search cache's key and the dict a result file's entry, so
both keep the format they had before parts existed: :data:`SLOTS` are the
dict entries (and key fields) every plan writes, empty when no part fills
them. This module imports no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = ["SLOTS", "Part", "Plan"]


@runtime_checkable
class Part(Protocol):
    """One method's share of a plan: a frozen, hashable object of the
    method's package (plans are compared and deduplicated whole).

    ``method``: the registered method it belongs to (what
    :meth:`Plan.part` looks up); ``fixes_tokens``: whether the savings
    the plan counts assume every block's token count as it stands (Token
    Channel Selection's analytic count; a reduction already installed), so
    that a token reducer must not extend the plan; ``first_block()``: the
    first of the original's blocks the part changes (0: every block, from
    the first; None: none), so that a measurement may resume past the
    blocks a plan leaves as they were; ``key()``: its field of the plan's
    key ("" adds none); ``label()``: its phrases of the plan's label, in
    order; ``entries()``: its entries of the plan's dict (those named in
    :data:`SLOTS` take their fixed place, and their key field, instead of
    being added)."""

    @property
    def method(self) -> str: ...

    @property
    def fixes_tokens(self) -> bool: ...

    def first_block(self) -> int | None: ...

    def key(self) -> str: ...

    def label(self) -> tuple[str, ...]: ...

    def entries(self) -> dict[str, Any]: ...


#: The dict entries every plan writes after ``translator``, each also a
#: field of its key after the spans: ToaSt's ρ and schedule were plan fields
#: before parts, and search caches and result files keep that format (a part
#: fills them through its entries; None, and an empty key field, otherwise).
SLOTS = ("head_sparsity", "schedule")

_VERB = {"identity": "remove", "linear": "linear", "affine": "affine", "ls": "LS fold"}


def _slot_text(value: Any) -> str:
    """A slot's field of the key: numbers as ``:g`` writes them, "" for None."""
    if value is None:
        return ""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:g}"
    return str(value)


@dataclass(frozen=True)
class Plan:
    """One compression recipe, ready to apply.

    ``methods``: the registered methods that apply it, in order (a plan
    one method extends, such as block removal with ToaSt's head pruning,
    names both); ``family``: the label plans compare within (predicted
    errors of different families do not compare); ``spans``: the
    ``(start, stop)`` block spans removed (original indices);
    ``translator``: what replaces each span (``"identity"``, ``"linear"``,
    ``"affine"``, ``"ls"`` for ReplaceMe's folded transform);
    ``params_after``: the exact parameter count after;
    ``predicted_error``: the method's prediction; ``unseen_macs``: MACs
    per sample the plan saves that linear-layer counts cannot see (Token
    Channel Selection's gathered products), and ``unseen_share`` the MACs
    saved that the parameter count does not show, as a share of the
    original's (that saving; token merging's fewer tokens);
    ``extendable``: whether another method may extend it; ``parts``: the
    methods' own settings (:class:`Part`), in the order the methods added
    them (a plan's key, label and dict name them in that order, so a plan
    without parts keeps the key it had).
    """

    methods: tuple[str, ...]
    family: str
    spans: tuple[tuple[int, int], ...]
    translator: str | None
    params_after: int
    predicted_error: float
    unseen_macs: int = 0
    unseen_share: float = 0.0
    extendable: bool = False
    parts: tuple[Part, ...] = ()

    def part(self, method: str) -> Any:
        """Method ``method``'s part of the plan (None: it has none); typed
        Any, as the method that asks knows its own part's type."""
        return next((p for p in self.parts if p.method == method), None)

    def with_part(self, part: Part, **changes: Any) -> Plan:
        """This plan with ``part`` added after its others (an extension's
        result) and ``changes`` made to its other fields."""
        return dataclasses.replace(self, parts=(*self.parts, part), **changes)

    def _entries(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The parts' dict entries: those of :data:`SLOTS` (every slot, None
        when unfilled) and the others, in the parts' order."""
        slots: dict[str, Any] = dict.fromkeys(SLOTS)
        extra: dict[str, Any] = {}
        for part in self.parts:
            for name, value in part.entries().items():
                (slots if name in slots else extra)[name] = value
        return slots, extra

    @property
    def key(self) -> str:
        """A stable identifier (a search cache's key for its measurement)."""
        spans = ",".join(f"{a}-{b}" for a, b in self.spans)
        slots, _ = self._entries()
        fields = [self.family, self.translator or "", spans, *map(_slot_text, slots.values())]
        fields += [text for text in (p.key() for p in self.parts) if text]
        return "|".join(fields)

    @property
    def blocks_removed(self) -> int:
        return sum(b - a for a, b in self.spans)

    @property
    def label(self) -> str:
        """A short name: the family and what it does."""
        phrases = []
        if self.spans:
            spans = " ".join(f"[{a}:{b}]" for a, b in self.spans)
            phrases.append(f"{_VERB.get(self.translator or '', self.translator)} blocks{spans}")
        for part in self.parts:
            phrases += part.label()
        return f"{self.family}: " + ", ".join(phrases)

    def to_dict(self) -> dict:
        slots, extra = self._entries()
        return {
            "key": self.key,
            "methods": list(self.methods),
            "family": self.family,
            "label": self.label,
            "spans": [list(s) for s in self.spans],
            "translator": self.translator,
            **slots,
            "params": self.params_after,
            "predicted": self.predicted_error,
            **extra,
        }
