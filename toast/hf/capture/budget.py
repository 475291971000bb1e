"""Whether a checkpoint is calibrated in memory or block by block from disk.

:func:`memory_plan` compares what loading the whole model takes (its
tensor bytes, with a margin for the calibration activations) against a
memory budget (default: the memory the machine has available now) and
gives the bound the sequential path keeps to instead: the larger of one
block and the embedding, twice (the tensors read and the copy the
forward works on), plus a fixed allowance for the interpreter's working
memory. :func:`plan_checkpoint` makes that choice for a model folder once
(for :func:`toast.compress` on a folder) and finds the checkpoint's blocks
only when the model goes block by block. ``benchmarks/bench_sequential.py``
measures both paths.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from toast._validation import format_size, parse_size  # here too: the budget is read here

if TYPE_CHECKING:  # torch stays unimported: the CLI parses sizes before loading anything
    from toast.hf.capture.sequential import DiskModel
    from toast.hf.model.checkpoint import Checkpoint

__all__ = [
    "BudgetError",
    "MemoryPlan",
    "available_memory",
    "memory_plan",
    "parse_size",
    "plan_checkpoint",
    "say_plan",
    "sequential_parts",
]

_log = logging.getLogger(__name__)

#: The in-memory path needs the model plus this fraction for activations.
IN_MEMORY_MARGIN = 0.2
#: The sequential path's allowance besides the weights it holds.
SEQUENTIAL_ALLOWANCE = 512 * 2**20


def available_memory() -> int:
    """Bytes of memory available to a new allocation now (``MemAvailable``
    on Linux; the physical memory elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


@dataclass(frozen=True)
class MemoryPlan:
    """The path chosen for a checkpoint and why: ``sequential`` is True when
    the model does not fit ``budget``; ``in_memory`` is what loading it
    needs, ``bound`` the peak the sequential path keeps to."""

    sequential: bool
    budget: int
    in_memory: int
    bound: int
    asked: bool = False
    #: a reason that no budget gave (the path forced, or the only one there is)
    reason_given: str = field(default="", compare=False)

    @property
    def reason(self) -> str:
        """One line for the log: the path, why, and its peak-memory bound."""
        if self.reason_given:
            return self.reason_given
        if self.asked:
            what = "sequential" if self.sequential else "in-memory"
            fits = dataclasses.replace(self, sequential=self.in_memory > self.budget, asked=False)
            return f"{what} path, as asked ({fits.reason})"
        if self.sequential:
            return (
                f"sequential path (block by block from disk): the model needs about "
                f"{_gib(self.in_memory)} in memory, more than the budget of {_gib(self.budget)}; "
                f"peak memory bound {_gib(self.bound)}"
            )
        return (
            f"in-memory path: the model needs about {_gib(self.in_memory)}, within the budget "
            f"of {_gib(self.budget)}"
        )


def memory_plan(
    checkpoint: Checkpoint,
    max_memory: int | str | None = None,
    *,
    block_bytes: Callable[[], int] | int | None = None,
) -> MemoryPlan:
    """The path for ``checkpoint`` under ``max_memory`` bytes (a size such as
    ``"16GiB"``; default :func:`available_memory`). ``block_bytes`` is the
    largest block's size (or a function giving it) when the caller knows
    it; otherwise the largest tensor stands in for it."""
    budget = available_memory() if max_memory is None else parse_size(max_memory)
    if budget <= 0:
        raise ValueError(f"max_memory must be positive, got {max_memory!r}")
    total = checkpoint.nbytes
    largest = max((t.nbytes for t in checkpoint.tensors.values()), default=0)
    block = block_bytes() if callable(block_bytes) else block_bytes
    heaviest = max(largest, block or 0)
    in_memory = int(total * (1 + IN_MEMORY_MARGIN))
    bound = 2 * heaviest + SEQUENTIAL_ALLOWANCE
    return MemoryPlan(in_memory > budget, budget, in_memory, bound)


def plan_checkpoint(
    folder: str | os.PathLike,
    max_memory: int | str | None = None,
    sequential: bool | None = None,
    *,
    blocks: str | None = None,
    compute: str = "auto",
    progress: bool = True,
    command: str = "toast compress",
) -> tuple[MemoryPlan, DiskModel | None]:
    """The path for the checkpoint in ``folder`` under ``max_memory`` and,
    for the block-by-block path, the checkpoint's structure (its blocks
    found once, on the skeleton, computing in ``compute``:
    :func:`toast.hf.capture.sequential.compute_dtype`). ``sequential=True``/``False`` forces a
    path. The choice and its reason are logged, and printed after
    ``command`` for the block-by-block path (slower, fewer options) or with
    ``progress``.

    Only the headers decide whether the model fits, so the in-memory path
    never builds the skeleton. A folder the block-by-block path cannot read
    (no safetensors weights, a family whose loading merges or splits
    tensors) goes in memory unless that path was asked for: then the
    ``ValueError`` names the problem.
    """
    from toast.hf.capture.sequential import DiskModel
    from toast.hf.model.checkpoint import Checkpoint

    if sequential is False:
        plan = MemoryPlan(False, 0, 0, 0, asked=True, reason_given="in-memory path, as asked")
        return _said(plan, progress, command), None
    try:
        if (Path(folder) / "toast_plan.json").exists():
            raise ValueError(f"{folder} is a toast save, which only loads whole")
        checkpoint = Checkpoint(folder)
        plan = memory_plan(checkpoint, max_memory)
        disk = (
            DiskModel.open(checkpoint, blocks, compute) if plan.sequential or sequential else None
        )
    except ValueError as exc:
        if sequential:
            raise
        why = f"in-memory path (no block-by-block path here: {exc})"
        plan = MemoryPlan(False, 0, 0, 0, reason_given=why)
        return _said(plan, progress, command), None
    if disk is not None:  # the bound from the largest block, now that the blocks are known
        plan = memory_plan(checkpoint, max_memory, block_bytes=disk.largest_block_bytes)
    if sequential is not None:
        plan = dataclasses.replace(plan, sequential=sequential, asked=True)
    return _said(plan, progress, command), disk if plan.sequential else None


def _said(plan: MemoryPlan, progress: bool, command: str) -> MemoryPlan:
    _log.info("%s: %s", command, plan.reason)
    if plan.sequential or progress:
        print(f"{command}: {plan.reason}", file=sys.stderr)
    return plan


class BudgetError(ValueError):
    """A run's memory plan exceeds ``max_memory``: refused before any pass."""


#: Bytes of logits one held-out forward holds at most, with their
#: log-softmax and the fidelity scores (``toast.hf.evaluate.from_disk.LOGIT_BYTES``
#: times three).
LOGIT_ALLOWANCE = 3 * 64 * 2**20


def sequential_parts(disk: DiskModel) -> list[tuple[str, int]]:
    """What the block-by-block path itself holds at its peak, by part: one
    block in the compute dtype with the largest tensor as read (a 16-bit
    checkpoint is widened tensor by tensor), and the larger of the input
    embedding (stage 0) and the head with one held-out forward's logits
    (the held-out passes, which leave an untied embedding unloaded). Not
    counted: the interpreter and its libraries (measured apart, stated in
    ``docs/large-models.md``) and the method's statistics."""
    tensors = disk.checkpoint.tensors
    ratio = _itemsize(disk.dtype) / _itemsize(disk.checkpoint.dtype)
    block = int(disk.largest_block_bytes() * ratio)
    largest = max(
        (tensors[k].nbytes for b in range(disk.num_blocks) for k in disk.block_keys(b).values()),
        default=0,
    )
    parts = [("one block", block + largest)]
    outside = []
    for which in ("input", "output"):
        module = disk.embedding(which)
        weight = getattr(module, "weight", None)
        if weight is not None:
            numel = 1
            for size in weight.shape:
                numel *= int(size)
            outside.append(numel * _itemsize(disk.dtype))
    if len(outside) == 2:
        parts.append(("embedding or head", max(outside[0], outside[1] + LOGIT_ALLOWANCE)))
    elif outside:
        parts.append(("embedding", outside[0]))
    return parts


def _itemsize(dtype: object) -> int:
    import torch

    assert isinstance(dtype, torch.dtype)
    return torch.empty((), dtype=dtype).element_size()


def say_plan(
    command: str,
    parts: list[tuple[str, int]],
    budget: int,
    fix: str = "raise --max-memory (max_memory=)",
) -> None:
    """Prints the memory plan of a block-by-block run (``command: memory
    plan: part X + part Y = Z (max_memory B)``; said as the path is, with
    or without ``progress``) and refuses, before any pass, when its parts
    exceed ``budget``, naming the least budget and ``fix``."""
    total = sum(n for _, n in parts)
    line = " + ".join(f"{label} {format_size(n)}" for label, n in parts)
    plan = f"memory plan: {line} = {format_size(total)} (max_memory {format_size(budget)})"
    _log.info("%s: %s", command, plan)
    print(f"{command}: {plan}", file=sys.stderr)
    if total > budget:
        raise BudgetError(
            f"{command}: {plan}: the block-by-block path needs at least {format_size(total)} "
            f"besides the interpreter; {fix}"
        )
