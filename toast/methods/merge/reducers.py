"""What a token reducer is: the rule a reducing block asks, after its
attention, which tokens to merge, prune or mix before its MLP.

A reducer sees a :class:`TokenView` of the block (the merge metric, the
hidden states, the token sizes, the class token's attention when it asks
for it) and returns a :class:`~toast.methods.merge.matching.Matching`
(None: nothing this block). The installed forward
(:mod:`toast.methods.merge.install`) does everything else the same for
every reducer: proportional attention, the size-weighted reduction, the
source map and the unmerged output.

Reducers register by name (:func:`register_reducer`), so a save records
``{"reducer": name, **state}`` and a load rebuilds it with
:func:`reducer_from_state`. ToMe's constant-``r`` matching is
:class:`TomeReducer`; ATM, Token Transforming and RAPID live in their own
modules.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from toast.methods.merge.macs import tokens_per_block
from toast.methods.merge.matching import Matching, bipartite_soft_matching

__all__ = [
    "Reducer",
    "TokenView",
    "TomeReducer",
    "is_int",
    "is_real",
    "reducer_from_state",
    "register_reducer",
]


def is_int(value: Any) -> bool:
    """Whether ``value`` is an int (a bool is not): a reducer's settings check."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """Whether ``value`` is a finite real number (a bool is not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class TokenView:
    """One reducing block's tokens after its attention: ``metric`` (the
    keys averaged over heads, ``(B, N, d)``), ``x`` (the hidden states,
    ``(B, N, D)``), ``sizes`` (``(B, N, 1)``; None: every token stands for
    one patch), ``cls_attention`` (the first token's attention over the
    keys averaged over heads, ``(B, N)``, proportional to the sizes; None
    unless the reducer asks for it) and the ``prefix`` of protected tokens."""

    metric: torch.Tensor
    x: torch.Tensor
    sizes: torch.Tensor | None
    cls_attention: torch.Tensor | None
    prefix: int

    def size_column(self) -> torch.Tensor:
        """The sizes as ``(B, N)`` (ones when none were kept)."""
        if self.sizes is None:
            return torch.ones(self.x.shape[:2], dtype=self.x.dtype, device=self.x.device)
        return self.sizes[..., 0]


@runtime_checkable
class Reducer(Protocol):
    """A token reduction rule (see the module docstring).

    ``name``: what saves record; ``needs_attention``: whether
    :class:`TokenView` must carry the class token's attention;
    ``num_blocks``: the blocks it is set for; ``reduce(position, view)``:
    block ``position``'s reduction (None: none); ``state()``: the JSON-able
    settings :func:`reducer_from_state` rebuilds it from; ``tokens(n,
    prefix)``: ``(entering, after)`` per block for ``n`` input tokens, or
    None when the count depends on the images (ATM's thresholds)."""

    name: ClassVar[str]
    needs_attention: ClassVar[bool]

    @property
    def num_blocks(self) -> int: ...

    def reduce(self, position: int, view: TokenView) -> Matching | None: ...

    def state(self) -> dict[str, Any]: ...

    def tokens(self, tokens: int, prefix: int) -> tuple[tuple[int, int], ...] | None: ...


_BUILDERS: dict[str, Callable[[Mapping[str, Any]], Reducer]] = {}

#: Where each reducer registers itself (imported on first use by name).
_MODULES = {
    "tome": "toast.methods.merge.reducers",
    "atm": "toast.methods.merge.atm",
    "rapid": "toast.methods.merge.rapid",
    "token-transforming": "toast.methods.merge.transforming",
    "pitome": "toast.methods.merge.pitome",
}


def register_reducer(name: str, build: Callable[[Mapping[str, Any]], Reducer]) -> None:
    """Makes :func:`reducer_from_state` rebuild ``name``'s reducer with ``build``."""
    _BUILDERS[name] = build


def reducer_from_state(state: Mapping[str, Any]) -> Reducer:
    """The reducer a save's state describes (``"reducer"`` names it; a state
    without one is ToMe's, as saves before other reducers wrote it);
    ``ValueError`` for an unknown name or settings."""
    name = state.get("reducer", "tome")
    if name not in _MODULES:
        raise ValueError(f"the save's reducer must be one of {sorted(_MODULES)}; got {name!r}")
    importlib.import_module(_MODULES[name])
    return _BUILDERS[name](state)


@dataclass(frozen=True)
class TomeReducer:
    """ToMe's bipartite soft matching: ``r[i]`` tokens merged in block
    ``i`` (``schedule`` names how the counts were spread)."""

    r: tuple[int, ...]
    schedule: str = "constant"

    name: ClassVar[str] = "tome"
    needs_attention: ClassVar[bool] = False

    @property
    def num_blocks(self) -> int:
        return len(self.r)

    def reduce(self, position: int, view: TokenView) -> Matching | None:
        return bipartite_soft_matching(view.metric, self.r[position], view.prefix)

    def state(self) -> dict[str, Any]:
        return {"r": list(self.r), "schedule": self.schedule}

    def tokens(self, tokens: int, prefix: int) -> tuple[tuple[int, int], ...]:
        return tokens_per_block(tokens, self.r, prefix)


def _tome_from_state(state: Mapping[str, Any]) -> TomeReducer:
    r, schedule = state.get("r"), state.get("schedule")
    if not (isinstance(r, list) and all(isinstance(v, int) and v >= 0 for v in r)):
        raise ValueError(f"the tome state's 'r' must be a list of ints >= 0; got {r!r}")
    if not isinstance(schedule, str):
        raise ValueError("the tome state's 'schedule' must be a name")
    return TomeReducer(tuple(r), schedule)


register_reducer("tome", _tome_from_state)
