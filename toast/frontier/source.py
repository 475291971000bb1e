"""What a search runs on, opened once: the model in memory, or a checkpoint
folder on the path ``toast.compress`` would take (loaded when it fits
``max_memory``, else its skeleton, searched block by block from disk), its
layout, the methods that run on it, the key of its cache entries, and the
bound of the shared moments pass that ``max_memory`` leaves from disk.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from toast.core.chunked import JOIN_BYTES, pair_nbytes, resolve_bound
from toast.hf.capture.budget import (
    MemoryPlan,
    ShapeOnce,
    fit_plan,
    in_memory_parts,
    plan_checkpoint,
)
from toast.hf.capture.compute import forward_dtype, widen_loaded
from toast.hf.capture.sequential import DiskModel
from toast.hf.data.calibration import Calibration
from toast.hf.evaluate.resume import PREFIX_BYTES
from toast.methods.base import Layout, Method, find_layout, staged_methods
from toast.methods.stages import SHARED_BYTES

from .cache import fingerprint, fingerprint_files
from .target import Target

__all__ = [
    "MOMENTS_PEAK_FACTOR",
    "Opened",
    "computed_in",
    "is_path",
    "open_source",
    "plan_statistics",
    "run_beside",
    "statistics_bytes",
    "whole_moments_bytes",
]


@dataclass
class Opened:
    """The model searched: loaded (``disk`` None) or its checkpoint's
    skeleton (``disk``), its layout found once, the methods that run on it
    and the cache's key for it."""

    model: nn.Module
    disk: DiskModel | None
    layout: Layout
    methods: list[Method]
    fingerprint: str
    #: the shared moments pass's bound (:data:`toast.methods.stages.SHARED_BYTES`,
    #: or what ``max_memory`` leaves from disk)
    statistics_bytes: int | str = SHARED_BYTES
    #: the block-by-block path's budget, planned once the batches are known
    plan: MemoryPlan | None = None
    #: a 16-bit checkpoint loaded whole and widened to compute in float32
    #: (:func:`toast.hf.capture.compute.widen_loaded`): its dtype, which the
    #: chosen model is returned in, as the block-by-block path writes it
    written: torch.dtype | None = None


def open_source(
    model: nn.Module | str | os.PathLike,
    goal: Target,
    max_memory: int | str | None,
    sequential: bool | None,
    calibration: Calibration,
    shape: ShapeOnce | None = None,
) -> Opened:
    """The model, or a checkpoint folder on the path ``plan_checkpoint``
    chooses (said once: loaded only where the budget also holds what the
    search's run keeps beside the model, :func:`run_beside`, with the
    largest batch, ``shape``); a target the disk path cannot
    measure is refused before any pass."""
    methods = staged_methods()  # the registry loads every method first
    if isinstance(model, nn.Module):
        if sequential:
            raise ValueError("sequential=True needs a checkpoint folder, not a loaded model")
        layout = find_layout(model, calibration.blocks)  # the call's one discovery
        return Opened(model, None, layout, methods, fingerprint(model))
    if not is_path(model):
        raise TypeError(
            f"model must be a torch.nn.Module or a checkpoint folder; got {type(model).__name__}"
        )
    if os.path.isfile(model):  # a GGUF file is dequantized as it loads: no tensors to stream
        if sequential:
            raise ValueError(f"sequential=True needs a checkpoint folder; {model} is a file")
        if calibration.progress:
            print(
                f"toast search: in-memory path ({os.path.basename(model)} is a file)",
                file=sys.stderr,
            )
        from toast.io.local import load_model

        return open_source(load_model(model), goal, None, None, calibration)
    plan, disk = plan_checkpoint(
        model,
        max_memory,
        sequential,
        blocks=calibration.blocks,
        compute=calibration.compute_dtype,
        progress=calibration.progress,
        command="toast search",
        beside=None if shape is None else functools.partial(run_beside, shape),
    )
    if disk is None:
        from toast.io.local import load_model

        loaded = load_model(model)
        written = widen_loaded(loaded, calibration.compute_dtype)
        return replace(open_source(loaded, goal, None, None, calibration), written=written)
    if goal.kind in ("latency", "macs"):
        raise ValueError(
            f"a {goal.kind}= target needs the model loaded (the block-by-block path never "
            "loads it, so it cannot time or count it): give max_memory enough to load the "
            "model, or ask for params= or quality="
        )
    # the blocks were found with the skeleton, each method's structure with them
    # (sub-layer pruning's sub-layers); methods in memory only are left out later
    layout = find_layout(disk.model, disk.stack)
    return Opened(disk.model, disk, layout, methods, fingerprint_files(model), plan=plan)


#: The moments' peak as a multiple of their stored size: measured on
#: SmolLM2-135M from disk (2.88 GB peak RSS for 1.32 GB of moments beside
#: 0.71 GiB of weights), the finished moments and their working copy.
MOMENTS_PEAK_FACTOR = 2.0


def statistics_bytes(disk: DiskModel, layout: Layout, methods: list[Method]) -> int:
    """Bytes of the shared moments pass the methods need beside the weights
    held block by block: every pair of the ``blocks + 1`` states' ``d × d``
    float64 cross products, times :data:`MOMENTS_PEAK_FACTOR`, or, when
    less, the bound above which the rows wait on disk and the errors form a
    chunk at a time (:func:`toast.core.chunked.resolve_bound`) with the rows
    one replay reads (0 when no method needs it or the width is unknown)."""
    if not any(m.stages is not None and m.stages.needs(layout).moments for m in methods):
        return 0
    width = getattr(disk.model.config, "hidden_size", None)
    if not isinstance(width, int):
        return 0
    return _shared_moments_bytes(layout.num_blocks + 1, width)


def _shared_moments_bytes(states: int, width: int) -> int:
    """The shared pass's moments of ``states`` states of ``width``: whole
    (:func:`whole_moments_bytes`) or, when less, within their bound."""
    whole = _whole_moments_bytes(states, width)
    return min(whole, resolve_bound(SHARED_BYTES, width, 0) + JOIN_BYTES)


def whole_moments_bytes(disk: DiskModel, layout: Layout) -> int:
    """The peak of whole moments of every pair of the block states."""
    width = int(getattr(disk.model.config, "hidden_size", 0) or 0)
    return _whole_moments_bytes(layout.num_blocks + 1, width)


def _whole_moments_bytes(states: int, width: int) -> int:
    return int(MOMENTS_PEAK_FACTOR * states * (states + 1) // 2 * width * width * 8)


def plan_statistics(
    plan: MemoryPlan,
    disk: DiskModel,
    layout: Layout,
    methods: list[Method],
    batches: Iterable | tuple[int, int] | None,
) -> int | str:
    """The shared moments pass's bound: what ``plan.budget`` leaves beside
    the block-by-block path's own parts (with one forward on the largest
    of ``batches``, as few rows at a time as the plan needs:
    :func:`toast.hf.capture.budget.fit_plan`) and one replay's rows, over
    :data:`MOMENTS_PEAK_FACTOR` (whole moments below the bound peak at that
    multiple), at most what every pair needs and never below one pair's
    errors; more room means more source states a replay, fewer replays. Said
    as ``toast compress`` says its plan, and the run refused before any
    pass when even the least does not fit."""
    width = getattr(disk.model.config, "hidden_size", None)
    bound: list[int | str] = [SHARED_BYTES]

    def moments(parts: list[tuple[str, int]]) -> tuple[list, list]:
        if not isinstance(width, int) or not statistics_bytes(disk, layout, methods):
            return parts, []
        room = plan.budget - sum(n for _, n in parts) - JOIN_BYTES
        whole = whole_moments_bytes(disk, layout)
        least = max(int(min(room, whole) // MOMENTS_PEAK_FACTOR), pair_nbytes(width, 0))
        bound[0] = least
        return parts + [("moments of the shared pass", min(2 * least + JOIN_BYTES, whole))], []

    fit_plan(disk, batches, plan.budget, moments, command="toast search")
    return bound[0]


def run_beside(shape: ShapeOnce, config: Any) -> list[tuple[str, int]]:
    """What a search on the loaded model keeps beside it, by part
    (:func:`toast.hf.capture.budget.in_memory_parts`): the shared moments
    pass (every pair of the block states whole, or within their bound when
    less, as :func:`statistics_bytes` counts them), the original's recorded held-out
    states (:data:`toast.hf.evaluate.resume.PREFIX_BYTES`), and one
    forward and one held-out forward's logits on the largest batch."""
    width = int(getattr(config, "hidden_size", 0) or 0)
    blocks = int(getattr(config, "num_hidden_layers", 0) or 0)
    parts: list[tuple[str, int]] = []
    if width and blocks:
        parts.append(("moments of the shared pass", _shared_moments_bytes(blocks + 1, width)))
    parts.append(("recorded held-out states", PREFIX_BYTES))
    return in_memory_parts(config, shape(config), parts)


def is_path(value: Any) -> bool:
    return isinstance(value, (str, os.PathLike))


def computed_in(opened: Opened, calibration: Calibration) -> str:
    """What the forwards compute in, for the cache key: statistics of bf16
    forwards are not those of float32 ones (``"None"``: the model's dtype,
    which its fingerprint holds)."""
    if opened.disk is not None:
        return str(opened.disk.dtype)
    return str(forward_dtype(opened.model, calibration.compute_dtype))
