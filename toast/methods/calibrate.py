"""The calibration ``toast.search`` and ``toast.compress`` need (one code
for both: :mod:`toast.methods.driver`), in as few passes as possible: the
union of what the methods declare (:class:`toast.methods.base.Needs`)
decides whether the one shared pass runs (moments of every pair of block
states at most ``max_blocks`` apart, all a plan can join, and the massive
rows; above :data:`~toast.methods.stages.SHARED_BYTES` the rows wait on
disk, every metric's errors form in one replay, and what the stats keep is
the tables and the two-state moments of the spans the plans use); each
method then calibrates from it, with a pass of its own where it needs
one (ReplaceMe's transforms for the cuts it will propose). The result is
what the cache keeps, so a new target
needs no pass again. On a checkpoint on disk the same passes run block by
block (:func:`calibrate_from_disk`); a method that needs the model in
memory is left out there, with a note.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from torch import nn

from toast.hf.capture.sequential import DiskModel
from toast.hf.data.calibration import Calibration
from toast.hf.model.params import count_params
from toast.methods.stages import (
    SHARED_BYTES,
    Layout,
    Needs,
    Sizes,
    Stages,
    Stats,
    capture_shared,
    capture_shared_from_disk,
)

__all__ = ["Calibrated", "Staged", "calibrate", "calibrate_from_disk", "model_sizes"]


class Staged(Protocol):
    """What calibration reads of a method: its name and its stages (a
    registered :class:`toast.methods.base.Method`, or a method's stages
    configured by a user's options)."""

    @property
    def name(self) -> str: ...

    @property
    def stages(self) -> Stages | None: ...


@dataclass
class Calibrated:
    """Every searched method's :class:`~toast.methods.base.Stats`, by
    name, and how many passes over the data they took."""

    stats: dict[str, Stats] = field(default_factory=dict)
    passes: int = 0
    left_out: list[str] = field(default_factory=list)

    @property
    def notes(self) -> list[str]:
        """Why a method proposes nothing, where it said, and which methods
        the disk path left out."""
        notes = [s.note for s in self.stats.values() if s.note]
        if self.left_out:
            names = ", ".join(self.left_out)
            notes.append(f"left out on the block-by-block path (in memory only): {names}")
        return notes


def calibrate(
    model: nn.Module,
    data: Iterable,
    layout: Layout,
    methods: Sequence[Staged],
    calibration: Calibration,
    backend: str,
    max_blocks: int,
) -> Calibrated:
    """The shared pass if any method needs it, then each method's calibration."""
    needs = _needs(methods, layout)
    shared = (
        capture_shared(model, data, layout, calibration, backend, max_blocks)
        if needs.moments
        else None
    )
    stats = {}
    for method in methods:
        assert method.stages is not None
        stats[method.name] = method.stages.calibrate(
            model, data, layout, shared, calibration, max_blocks
        )
    if shared is not None:
        shared.close()  # the stats keep tables and pair moments, never the rows on disk
    passes = int(needs.moments) + sum(s.passes for s in stats.values())
    return Calibrated(stats, passes)


def _needs(methods: Sequence[Staged], layout: Layout) -> Needs:
    needs = Needs()
    for method in methods:
        assert method.stages is not None  # the search takes staged methods only
        needs = needs | method.stages.needs(layout)
    return needs


def calibrate_from_disk(
    disk: DiskModel,
    data: Iterable,
    layout: Layout,
    methods: Sequence[Staged],
    calibration: Calibration,
    backend: str,
    max_blocks: int,
    statistics_bytes: int | str = SHARED_BYTES,
) -> Calibrated:
    """:func:`calibrate` on the checkpoint ``disk``, block by block: the
    same shared pass (its moments bounded by ``statistics_bytes``) and each
    method's ``calibrate_from_disk`` (a method without one is left out)."""
    needs = _needs(methods, layout)
    shared = (
        capture_shared_from_disk(disk, data, calibration, backend, max_blocks, statistics_bytes)
        if needs.moments
        else None
    )
    stats, left_out = {}, []
    for method in methods:
        assert method.stages is not None
        found = method.stages.calibrate_from_disk(
            disk, data, layout, shared, calibration, max_blocks
        )
        if found is None:
            left_out.append(method.name)
        else:
            stats[method.name] = found
    if shared is not None:
        shared.close()
    passes = int(needs.moments) + sum(s.passes for s in stats.values())
    return Calibrated(stats, passes, left_out)


def model_sizes(model: nn.Module, layout: Layout) -> Sizes:
    """The model's :class:`Sizes`, read from its modules once (a skeleton
    on the meta device counts the same)."""
    block_params = tuple(sum(p.numel() for p in b.parameters()) for b in layout.stack.blocks)
    return Sizes(count_params(model), block_params)
