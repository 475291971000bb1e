"""Sub-layer pruning's share of a plan (:class:`SublayerPart`): the
sub-layers it removes, what its stages apply, size and report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from toast.methods.stages import Plan

__all__ = ["METHOD", "SublayerPart", "removed_sublayers"]

#: The registered method the part belongs to.
METHOD = "sublayer"

_SHORT = {"attention": "attn"}


@dataclass(frozen=True)
class SublayerPart:
    """``removed``: the ``(block, kind)`` sub-layers removed, ``kind``
    ``"attention"`` or ``"mlp"``, in block order."""

    removed: tuple[tuple[int, str], ...]

    @property
    def method(self) -> str:
        return METHOD

    @property
    def fixes_tokens(self) -> bool:
        return False

    def first_block(self) -> int | None:
        return min((block for block, _ in self.removed), default=None)

    def _text(self, sep: str) -> str:
        """The removed sub-layers as ``attn3`` / ``mlp5``, joined by ``sep``."""
        return sep.join(f"{_SHORT.get(k, k)}{b}" for b, k in self.removed)

    def key(self) -> str:
        return f"sub{self._text(',')}"

    def label(self) -> tuple[str, ...]:
        return (f"remove sub-layers {self._text(' ')}",)

    def entries(self) -> dict[str, Any]:
        return {"sublayers": [[b, k] for b, k in self.removed]}


def removed_sublayers(plan: Plan) -> tuple[tuple[int, str], ...]:
    """The sub-layers ``plan`` removes (none for a plan without the part)."""
    part: SublayerPart | None = plan.part(METHOD)
    return () if part is None else part.removed
