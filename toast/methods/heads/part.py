"""ToaSt's share of a plan (:class:`HeadsPart`): its ρ and Token Channel
Selection schedule, the setting its stages read back when they apply a
plan. Its entries fill the plan's fixed ``head_sparsity`` and ``schedule``
slots (:data:`toast.methods.plan.SLOTS`), where they stood before plans
had parts, so keys and result files keep their format."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["METHOD", "HeadsPart", "heads_parts"]

#: The registered method the part belongs to.
METHOD = "toast-vit"


@dataclass(frozen=True)
class HeadsPart:
    """``head_sparsity``: SCWP's ρ (None: no head pruning); ``schedule``:
    the Token Channel Selection schedule's name (None: none)."""

    head_sparsity: float | None = None
    schedule: str | None = None

    @property
    def method(self) -> str:
        return METHOD

    @property
    def fixes_tokens(self) -> bool:
        # TCS's saving is counted analytically at the full token count
        return self.schedule is not None

    def first_block(self) -> int | None:
        return 0  # every block's heads or channels change

    def key(self) -> str:
        return ""  # its fields are the key's slots

    def label(self) -> tuple[str, ...]:
        phrases = []
        if self.head_sparsity is not None:
            phrases.append(f"heads ρ={self.head_sparsity:g}")
        if self.schedule is not None:
            phrases.append(f"TCS {self.schedule}")
        return tuple(phrases)

    def entries(self) -> dict[str, Any]:
        return {"head_sparsity": self.head_sparsity, "schedule": self.schedule}


def heads_parts(head_sparsity: float | None, schedule: str | None) -> tuple[HeadsPart, ...]:
    """The plan's parts for this setting: none when it prunes nothing and
    selects no channel (the plan then changes no block)."""
    if head_sparsity is None and schedule is None:
        return ()
    return (HeadsPart(head_sparsity, schedule),)
