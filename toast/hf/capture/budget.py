"""Whether a checkpoint is calibrated in memory or block by block from disk.

:func:`memory_plan` compares what the run on the loaded model takes (its
tensor bytes with a margin for the activations, plus what the run holds
beside them: :func:`in_memory_parts`) against a memory budget (default:
the memory the machine has available now) and gives the bound the
sequential path keeps to instead: the larger of one
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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toast._malloc import return_freed_memory
from toast._validation import format_size, parse_size  # here too: the budget is read here

if TYPE_CHECKING:  # torch stays unimported: the CLI parses sizes before loading anything
    from toast.hf.capture.sequential import DiskModel
    from toast.hf.model.checkpoint import Checkpoint

__all__ = [
    "BudgetError",
    "MemoryPlan",
    "ShapeOnce",
    "available_memory",
    "batch_shape",
    "fit_plan",
    "forward_bytes",
    "forward_part",
    "in_memory_parts",
    "logit_bytes",
    "logit_positions",
    "logit_rows",
    "memory_plan",
    "parse_size",
    "plan_checkpoint",
    "plan_total",
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
    #: what the run holds beside the loaded model, by part (in ``in_memory``)
    beside: tuple[tuple[str, int], ...] = field(default=(), compare=False)

    @property
    def reason(self) -> str:
        """One line for the log: the path, why, and its peak-memory bound."""
        if self.reason_given:
            return self.reason_given
        if self.asked:
            what = "sequential" if self.sequential else "in-memory"
            fits = dataclasses.replace(self, sequential=self.in_memory > self.budget, asked=False)
            return f"{what} path, as asked ({fits.reason})"
        needs = f"the model needs about {_gib(self.in_memory)}"
        if self.beside:
            parts = ", ".join(f"{label} {_gib(n)}" for label, n in self.beside)
            needs += f" in memory with its run ({parts})"
        if self.sequential:
            return (
                f"sequential path (block by block from disk): {needs}, more than the budget "
                f"of {_gib(self.budget)} (its memory plan follows)"
            )
        return f"in-memory path: {needs}, within the budget of {_gib(self.budget)}"


def memory_plan(
    checkpoint: Checkpoint,
    max_memory: int | str | None = None,
    *,
    block_bytes: Callable[[], int] | int | None = None,
    compute: str = "auto",
    beside: Sequence[tuple[str, int]] = (),
) -> MemoryPlan:
    """The path for ``checkpoint`` under ``max_memory`` bytes (a size such as
    ``"16GiB"``; default :func:`available_memory`). ``block_bytes`` is the
    largest block's size (or a function giving it) when the caller knows
    it; otherwise the largest tensor stands in for it. In memory, a 16-bit
    checkpoint that ``compute`` widens (:func:`toast.hf.capture.compute.loaded_dtype`)
    counts at float32's size, and the run needs ``beside`` too (by part:
    :func:`in_memory_parts`), which the block-by-block path bounds."""
    budget = available_memory() if max_memory is None else parse_size(max_memory)
    if budget <= 0:
        raise ValueError(f"max_memory must be positive, got {max_memory!r}")
    from toast.hf.capture.compute import loaded_dtype

    total = checkpoint.nbytes
    loaded = loaded_dtype(checkpoint.dtype, compute)
    if loaded != checkpoint.dtype:
        total = total * loaded.itemsize // checkpoint.dtype.itemsize
    largest = max((t.nbytes for t in checkpoint.tensors.values()), default=0)
    block = block_bytes() if callable(block_bytes) else block_bytes
    heaviest = max(largest, block or 0)
    in_memory = int(total * (1 + IN_MEMORY_MARGIN)) + sum(n for _, n in beside)
    bound = 2 * heaviest + SEQUENTIAL_ALLOWANCE
    return MemoryPlan(in_memory > budget, budget, in_memory, bound, beside=tuple(beside))


def plan_checkpoint(
    folder: str | os.PathLike,
    max_memory: int | str | None = None,
    sequential: bool | None = None,
    *,
    blocks: str | None = None,
    compute: str = "auto",
    progress: bool = True,
    command: str = "toast compress",
    beside: Callable[[Any], Parts] | None = None,
) -> tuple[MemoryPlan, DiskModel | None]:
    """The path for the checkpoint in ``folder`` under ``max_memory`` and,
    for the block-by-block path, the checkpoint's structure (its blocks
    found once, on the skeleton, computing in ``compute``:
    :func:`toast.hf.capture.disk_model.compute_dtype`). ``sequential=True``/``False`` forces a
    path. ``beside(config)``: what the run on the loaded model holds
    beside it (:func:`in_memory_parts`), from the checkpoint's
    ``transformers`` config. The choice and its reason are logged, and
    printed after ``command`` for the block-by-block path (slower, fewer
    options) or with ``progress``.

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
        run = () if beside is None else beside(checkpoint.config)
        plan = memory_plan(checkpoint, max_memory, compute=compute, beside=run)
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
        plan = memory_plan(
            checkpoint,
            max_memory,
            block_bytes=disk.largest_block_bytes,
            compute=compute,
            beside=run,
        )
    if disk is not None or max_memory is not None:
        # a budget asked for holds in memory too: the heap's freed
        # activations drifted 300 MiB above the loaded run's plan without this
        return_freed_memory()
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


#: Bytes of logits a held-out forward holds at once: the evaluator cuts a
#: batch into runs of rows whose logits stay within this (a row alone may
#: be more), :func:`logit_rows`.
LOGIT_BYTES = 64 * 2**20

#: Bytes of logits one held-out forward holds at most when the batches are
#: unknown, with their log-softmax and the fidelity scores
#: (:data:`LOGIT_BYTES` times three).
LOGIT_ALLOWANCE = 3 * LOGIT_BYTES


#: The least :data:`LOGIT_BYTES` the plan lowers a held-out run to (a
#: few dozen positions of a 50k vocabulary; fewer makes the head's widened
#: chunks, not the logits, the cost).
LEAST_LOGIT_BYTES = 4 * 2**20


def logit_rows(rows: int, tokens: int, vocabulary: int, bound: int | None = None) -> int:
    """How many of a batch's ``rows`` (of ``tokens`` tokens) one run of the
    held-out evaluator takes: as many as keep the logits within ``bound``
    (:data:`LOGIT_BYTES` by default), at least one."""
    per = max(1, (bound or LOGIT_BYTES) // max(1, tokens * vocabulary * 4))
    return min(per, rows)


def logit_positions(vocabulary: int, bound: int | None = None) -> int:
    """Positions of one row whose logits stay within ``bound``
    (:data:`LOGIT_BYTES` by default), at least one: the run
    :class:`toast.hf.evaluate.quality.HeadRuns` takes at a time."""
    return max(1, (bound or LOGIT_BYTES) // max(1, vocabulary * 4))


def logit_bytes(
    rows: int, tokens: int, vocabulary: int, width: int, bound: int | None = None
) -> int:
    """Bytes one held-out forward's logits hold at once, with their
    log-softmax and the scores (three times over): a run of rows within
    ``bound`` (:data:`LOGIT_BYTES` by default, :func:`logit_rows`), or, when
    one row alone has more, a run of that row's positions within it and the
    row's final states, from which the head makes them
    (:class:`toast.hf.evaluate.quality.HeadRuns`)."""
    row = tokens * vocabulary * 4
    if row <= (bound or LOGIT_BYTES):
        return 3 * logit_rows(rows, tokens, vocabulary, bound) * row
    run = logit_positions(vocabulary, bound)
    return 3 * run * vocabulary * 4 + tokens * width * 4


#: The labels of :func:`sequential_parts`'s part outside the blocks.
OUTSIDE_LABELS = ("embedding or head", "embedding")


Parts = list[tuple[str, int]]

#: The label of the forward part when a whole batch runs at once.
FORWARD_LABEL = "one batch's forward"


def sequential_parts(
    disk: DiskModel,
    batches: Iterable | None = None,
    *,
    shape: tuple[int, int] | None = None,
    rows_at_once: int | None = None,
    dtype: object = None,
    logits: int | None = None,
) -> Parts:
    """What the block-by-block path itself holds at its peak, by part: one
    block in the compute dtype with the largest tensor as read (a 16-bit
    checkpoint is widened tensor by tensor); the larger of the input
    embedding (stage 0) and the head with one held-out forward's logits
    (the held-out passes, which leave an untied embedding unloaded), each
    in its 16-bit weight where :meth:`DiskModel.narrow` keeps it so (the
    head with a widened chunk); and, with ``batches`` (or their ``shape``,
    :func:`batch_shape`), one block's forward on the largest of them,
    ``rows_at_once`` rows at a time (:func:`forward_part`), whose logits,
    ``logits`` bytes at a time (:data:`LOGIT_BYTES` by default), then
    replace the fixed :data:`LOGIT_ALLOWANCE`. ``dtype``: a compute dtype
    other than the checkpoint's own (what the plan would be with it). Not
    counted: the interpreter and its libraries (measured apart, stated in
    ``docs/large-models.md``) and the method's statistics."""
    compute = disk.dtype if dtype is None else dtype
    tensors = disk.checkpoint.tensors
    ratio = _itemsize(compute) / _itemsize(disk.checkpoint.dtype)
    block = int(disk.largest_block_bytes() * ratio)
    largest = max(
        (tensors[k].nbytes for b in range(disk.num_blocks) for k in disk.block_keys(b).values()),
        default=0,
    )
    parts = [("one block", block + largest)]
    if shape is None and batches is not None:
        shape = batch_shape(batches, disk.model.config)
    outside = []
    vocabulary = 0
    narrow = dtype is None or dtype == disk.dtype  # another compute dtype: widened whole
    for which in ("input", "output"):
        module = disk.embedding(which)
        weight = getattr(module, "weight", None)
        if weight is not None:
            numel = 1
            for size in weight.shape:
                numel *= int(size)
            if narrow and disk.narrow(which):
                held = numel * _itemsize(disk.checkpoint.dtype)
                if which == "output":
                    held += min(numel * _itemsize(compute), disk.head_chunk_bytes)
            else:
                held = numel * _itemsize(compute)
            outside.append(held)
            vocabulary = int(weight.shape[0])
    held_logits = LOGIT_ALLOWANCE if logits is None else 3 * logits
    if shape is not None and vocabulary:
        width = int(getattr(disk.model.config, "hidden_size", 0) or 0)
        held_logits = logit_bytes(*shape, vocabulary, width, logits)
    if len(outside) == 2:
        parts.append((OUTSIDE_LABELS[0], max(outside[0], outside[1] + held_logits)))
    elif outside:
        parts.append((OUTSIDE_LABELS[1], outside[0]))
    if shape is not None:
        parts.append(forward_part(disk.model.config, shape, rows_at_once))
    return parts


def forward_part(
    config: object, shape: tuple[int, int], rows_at_once: int | None = None
) -> tuple[str, int]:
    """The forward part of a plan for batches of ``shape`` (rows, tokens):
    :func:`forward_bytes` of a whole batch, or, ``rows_at_once`` rows at a
    time (:attr:`toast.hf.capture.disk_model.DiskModel.rows_at_once`), of
    that many rows plus the whole batch's input and output states."""
    rows, tokens = shape
    if rows_at_once is None or rows_at_once >= rows:
        return FORWARD_LABEL, forward_bytes(config, rows, tokens)
    width = int(getattr(config, "hidden_size", 0) or 0)
    whole = 2 * 4 * rows * tokens * width
    label = f"one forward on {rows_at_once} of a batch's {rows} rows at a time"
    return label, forward_bytes(config, rows_at_once, tokens) + whole


def plan_total(parts: Parts, apart: Parts | None = None) -> int:
    """A plan's peak (:func:`say_plan`): every part, but the larger of the
    parts outside the blocks and ``apart`` (which never sit beside them)."""
    if not apart:
        return sum(n for _, n in parts)
    outside = sum(n for label, n in parts if label in OUTSIDE_LABELS)
    beside = sum(n for label, n in parts if label not in OUTSIDE_LABELS)
    return beside + max(outside, sum(n for _, n in apart))


#: ``statistics(parts) -> (parts, apart)``: the plan with a method's
#: statistics fitted to what the budget leaves beside the path's own ``parts``.
AddStatistics = Callable[[Parts], tuple[Parts, Parts]]


def fit_plan(
    disk: DiskModel,
    batches: Iterable | tuple[int, int] | None,
    budget: int,
    statistics: AddStatistics | None = None,
    *,
    command: str = "toast compress",
) -> tuple[Parts, Parts]:
    """The block-by-block path's plan within ``budget``, lowering first what
    changes no result: the bytes of logits a held-out forward holds at once
    (:attr:`DiskModel.logit_bytes <toast.hf.capture.disk_model.DiskModel>`,
    halved down to :data:`LEAST_LOGIT_BYTES`) and the rows of a batch one
    forward takes at once (:attr:`DiskModel.rows_at_once`), both set on
    ``disk``, as far as the method's ``statistics`` gain room from them
    (their own bound, e.g. chunked moments, is theirs to lower), then as
    far as the plan needs to fit. Printed (:func:`say_plan`); refused
    before any pass when even one row at a time and the least statistics
    do not fit, naming every setting that alone would make it fit
    (:class:`BudgetError`). ``batches``: the data, or their
    :func:`batch_shape`. Returns the plan's parts and its parts apart."""
    config = disk.model.config
    shape: tuple[int, int] | None
    if (
        isinstance(batches, tuple)
        and len(batches) == 2
        and all(isinstance(n, int) for n in batches)
    ):
        shape = (int(batches[0]), int(batches[1]))
    else:
        shape = None if batches is None else batch_shape(batches, config)
    add = statistics or (lambda parts: (parts, []))

    def plan(
        rows_at_once: int | None,
        shape: Any = shape,
        dtype: object = None,
        logits: int | None = LEAST_LOGIT_BYTES,
    ) -> Any:
        own = sequential_parts(
            disk, shape=shape, rows_at_once=rows_at_once, dtype=dtype, logits=logits
        )
        parts, apart = add(own)
        theirs = [p for p in parts if p not in own] + apart
        return parts, apart, theirs, plan_total(parts, apart)

    rows = shape[0] if shape is not None else 1
    bounds = [LOGIT_BYTES]
    while bounds[-1] // 2 >= LEAST_LOGIT_BYTES:
        bounds.append(bounds[-1] // 2)
    _, _, most, least = plan(1)
    chosen = None
    for fitting in (lambda theirs: theirs == most, lambda theirs: True):
        for r in range(rows, 0, -1):
            for bound in bounds:
                parts, apart, theirs, total = plan(r, logits=bound)
                if total <= budget and fitting(theirs):
                    chosen = r, bound
                    break
            if chosen is not None:
                break
        if chosen is not None:
            break
    if chosen is None:  # refused: the plan at its least, with every way out
        parts, apart, _, _ = plan(1)
        fixes = [f"raise --max-memory to {format_size(least)} (max_memory=)"]
        fixes += _other_fixes(disk, shape, budget, plan)
        say_plan(command, parts, budget, "; or ".join(fixes), apart)
        raise AssertionError("say_plan refuses a plan over its budget")  # pragma: no cover
    disk.rows_at_once = chosen[0] if chosen[0] < rows else None
    disk.logit_bytes = chosen[1] if chosen[1] < LOGIT_BYTES else None
    parts, apart, _, _ = plan(disk.rows_at_once, logits=chosen[1])
    settings = [f"held-out logits {format_size(chosen[1])} at a time"] if disk.logit_bytes else []
    narrow = [w for w in ("input", "output") if disk.narrow(w)]
    if narrow:
        names = {"input": "embedding", "output": "head"}
        kept = " and ".join(names[w] for w in narrow)
        dtype = str(disk.checkpoint.dtype).removeprefix("torch.")
        settings.append(f"{kept} kept in {dtype}")
    say_plan(command, parts, budget, apart=apart, chosen=settings)
    return parts, apart


def _largest(most: int, fits: Callable[[int], bool]) -> int:
    """The largest ``n`` in ``1..most`` that ``fits`` (monotone: what fits,
    fits smaller), or 0."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _other_fixes(
    disk: DiskModel, shape: tuple[int, int] | None, budget: int, plan: Callable[..., Any]
) -> list[str]:
    """The settings other than the budget that alone bring the least plan
    within ``budget``: fewer tokens a text, fewer texts a batch, computing
    in a 16-bit checkpoint's own dtype."""
    import torch

    fixes = []
    if shape is not None:
        rows, tokens = shape
        length = _largest(tokens - 1, lambda t: plan(1, (rows, t))[3] <= budget)
        if length >= 16:  # fewer tokens than that is no calibration
            fixes.append(f"texts of at most {length} tokens (--max-length {length})")
        size = _largest(rows - 1, lambda b: plan(1, (b, tokens))[3] <= budget)
        if size:
            fixes.append(f"batches of at most {size} texts (--batch-size {size})")
    own = disk.checkpoint.dtype
    if own in (torch.float16, torch.bfloat16) and disk.dtype != own:
        if plan(1, shape, own)[3] <= budget:
            fixes.append(
                f"computing in the checkpoint's {str(own).removeprefix('torch.')} "
                "(--compute-dtype checkpoint; compute_dtype='checkpoint')"
            )
    return fixes


def batch_shape(batches: Iterable, config: object) -> tuple[int, int] | None:
    """The most rows and the most tokens a row of any batch has (token ids,
    or an image's patches and its class token), read from the batches'
    shapes; None when no batch says."""
    rows = tokens = 0
    for batch in batches:
        found = _shape_of(batch, config)
        if found is not None:
            rows, tokens = max(rows, found[0]), max(tokens, found[1])
    return (rows, tokens) if rows and tokens else None


class ShapeOnce:
    """:func:`batch_shape` of ``batches()`` and ``held()`` (the calibration
    and the held-out batches), read at the first call and kept with the
    calibration's tokens (:meth:`tokens`): the path's choice and the
    block-by-block plan read the same figures, and raw text is tokenized for
    them once."""

    def __init__(
        self, batches: Callable[[], Iterable], held: Callable[[], Iterable] | None = None
    ) -> None:
        self._batches, self._held = batches, held
        self._read: tuple[tuple[int, int] | None, tuple[int, ...] | None] | None = None

    def _figures(self, config: object) -> tuple[tuple[int, int] | None, tuple[int, ...] | None]:
        if self._read is None:
            counted = _Counted(self._batches(), config)
            held = () if self._held is None else self._held()
            self._read = (batch_shape(chain(counted, held), config), counted.tokens)
        return self._read

    def __call__(self, config: object) -> tuple[int, int] | None:
        return self._figures(config)[0]

    def tokens(self, config: object) -> tuple[int, ...] | None:
        """Each calibration batch's tokens (the unmasked ones where a batch
        has an attention mask; an image's patches and class token); None
        when a batch does not say, or there are none."""
        return self._figures(config)[1]


class _Counted:
    """``batches`` passed through, each one's tokens kept as they go."""

    def __init__(self, batches: Iterable, config: object) -> None:
        self._batches, self._config = batches, config
        self.tokens: tuple[int, ...] | None = None

    def __iter__(self) -> Iterator:
        found: list[int | None] = []
        for batch in self._batches:
            found.append(_tokens_of(batch, self._config))
            yield batch
        known = [n for n in found if n is not None]
        self.tokens = tuple(known) if known and len(known) == len(found) else None


def _tokens_of(batch: object, config: object) -> int | None:
    shape = _shape_of(batch, config)
    if shape is None:
        return None
    mask: Any = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if mask is not None and getattr(mask, "ndim", 0) == 2 and tuple(mask.shape) == shape:
        return int(mask.sum())
    return shape[0] * shape[1]


def _shape_of(batch: object, config: object) -> tuple[int, int] | None:
    if not isinstance(batch, Mapping):
        return None
    ids: Any = batch.get("input_ids")
    if getattr(ids, "ndim", 0) == 2:
        return int(ids.shape[0]), int(ids.shape[1])
    pixels: Any = batch.get("pixel_values")
    patch = getattr(config, "patch_size", None)
    if getattr(pixels, "ndim", 0) == 4 and isinstance(patch, int) and patch > 0:
        b, _, h, w = (int(n) for n in pixels.shape)
        return b, (h // patch) * (w // patch) + 1
    return None


def forward_bytes(config: object, rows: int, tokens: int) -> int:
    """Bytes one block's forward holds at once on ``rows`` x ``tokens``
    tokens in float32: the residual stream in and out, the normed input,
    the attention's queries, keys, values and output, its scores and their
    softmax (every head's ``tokens²``: the unfused attention's worst case),
    and the MLP's gate, up and product."""
    width = int(getattr(config, "hidden_size", 0) or 0)
    heads = int(getattr(config, "num_attention_heads", 0) or 1)
    kv = int(getattr(config, "num_key_value_heads", 0) or heads)
    mlp = int(getattr(config, "intermediate_size", 0) or getattr(config, "n_inner", 0) or 4 * width)
    head_dim = width // heads if heads else width
    per_token = 4 * width + 2 * kv * head_dim + 3 * mlp
    scores = 2 * heads * tokens * tokens
    return 4 * rows * (tokens * per_token + scores)


def _itemsize(dtype: object) -> int:
    import torch

    assert isinstance(dtype, torch.dtype)
    return torch.empty((), dtype=dtype).element_size()


def say_plan(
    command: str,
    parts: list[tuple[str, int]],
    budget: int,
    fix: str = "raise --max-memory (max_memory=)",
    apart: list[tuple[str, int]] | None = None,
    chosen: Iterable[str] = (),
) -> None:
    """Prints the memory plan of a block-by-block run (``command: memory
    plan: part X + part Y = Z (max_memory B)``; said as the path is, with
    or without ``progress``) and refuses, before any pass, when its parts
    exceed ``budget``, naming the least budget and ``fix``. ``apart`` are
    parts that never sit beside the embedding or the head (formed after
    stage 0, freed before the held-out passes): the plan counts the larger
    of the two. ``chosen``: the settings the plan lowered to fit, said
    after the budget."""
    outside = [p for p in parts if p[0] in OUTSIDE_LABELS] if apart else []
    beside = [p for p in parts if p not in outside]
    terms = [f"{label} {format_size(n)}" for label, n in beside]
    total = plan_total(parts, apart)
    if apart:
        either = [" + ".join(f"{label} {format_size(n)}" for label, n in group) or "nothing"
                  for group in (outside, apart)]  # fmt: skip
        terms.append(f"the larger of ({either[0]}) and ({either[1]})")
    plan = (
        f"memory plan: {' + '.join(terms)} = {format_size(total)} "
        f"(max_memory {format_size(budget)}{''.join('; ' + c for c in chosen)})"
    )
    _log.info("%s: %s", command, plan)
    print(f"{command}: {plan}", file=sys.stderr)
    if total > budget:
        raise BudgetError(
            f"{plan}: the block-by-block path needs at least {format_size(total)} "
            f"besides the interpreter; {fix}"
        )


def in_memory_parts(
    config: object, shape: tuple[int, int] | None, statistics: Parts | None = None
) -> Parts:
    """What a run on the loaded model holds beside its weights, by part:
    the method's ``statistics`` (whole, as
    :meth:`~toast.methods.stages.Stages.within_memory` gives them), one
    forward on the largest batch (``shape``: rows, tokens;
    :func:`forward_bytes`) and, for a causal language model, one held-out
    forward's logits of that batch with their log-softmax and scores
    (three times ``rows × tokens × vocabulary`` floats: the evaluator of a
    loaded model scores a batch at once). The block-by-block path bounds
    every one of these; in memory only the budget can."""
    parts = list(statistics or [])
    if shape is None:
        return parts
    rows, tokens = shape
    parts.append((FORWARD_LABEL, forward_bytes(config, rows, tokens)))
    vocabulary = int(getattr(config, "vocab_size", 0) or 0)
    names = getattr(config, "architectures", None) or []
    if vocabulary and any(str(name).endswith("ForCausalLM") for name in names):
        parts.append(("held-out logits", 3 * rows * tokens * vocabulary * 4))
    return parts
