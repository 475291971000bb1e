"""The calibration a search needs, in as few passes as possible: the
union of what the methods declare (:class:`toast.methods.base.Needs`)
decides whether the one shared pass runs (moments of every pair of block
states, and the massive rows); each method then calibrates from it, with a
pass of its own where it needs one (ReplaceMe's transforms for the cuts
it will propose). The result is what the cache keeps, so a new target
needs no pass again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import nn

from toast.hf.calibration import Calibration
from toast.hf.params import count_params
from toast.methods.base import Layout, Method, Needs, Sizes, Stats, capture_shared

__all__ = ["Calibrated", "calibrate", "model_sizes"]


@dataclass
class Calibrated:
    """Every searched method's :class:`~toast.methods.base.Stats`, by
    name, and how many passes over the data they took."""

    stats: dict[str, Stats] = field(default_factory=dict)
    passes: int = 0

    @property
    def notes(self) -> list[str]:
        """Why a method proposes nothing, where it said."""
        return [s.note for s in self.stats.values() if s.note]


def calibrate(
    model: nn.Module,
    data: Iterable,
    layout: Layout,
    methods: list[Method],
    calibration: Calibration,
    backend: str,
    max_blocks: int,
) -> Calibrated:
    """The shared pass if any method needs it, then each method's calibration."""
    needs = Needs()
    for method in methods:
        assert method.stages is not None  # the search takes staged methods only
        needs = needs | method.stages.needs(layout)
    shared = capture_shared(model, data, layout, calibration, backend) if needs.moments else None
    stats = {}
    for method in methods:
        assert method.stages is not None
        stats[method.name] = method.stages.calibrate(
            model, data, layout, shared, calibration, max_blocks
        )
    passes = int(needs.moments) + sum(s.passes for s in stats.values())
    return Calibrated(stats, passes)


def model_sizes(model: nn.Module, layout: Layout) -> Sizes:
    """The model's :class:`Sizes`, read from its modules once."""
    block_params = tuple(sum(p.numel() for p in b.parameters()) for b in layout.stack.blocks)
    return Sizes(count_params(model), block_params)
