"""Calibration block by block from a checkpoint on disk, for models bigger
than memory.

The in-memory passes (:func:`toast.hf.capture.states.stream_states`) run the
whole model on one batch at a time. Here the order is turned around, as
in llm-compressor's sequential pipeline: the embedding runs on every
calibration batch, then block 0 on all of them, then block 1, and so on.
Only one block's weights are in memory at a time (read tensor by tensor
from the safetensors shards into a block built on the meta device), and
the hidden states of every batch wait between blocks in a disk-backed
buffer (two files with no name in the temporary directory, written and read
with positioned I/O, freed on every exit, ``kill -9`` included).

The inputs each block receives besides the hidden states (attention masks,
position ids, rotary embeddings, the attention type of its layer: sliding
window or full, Gemma 3's patterns) are produced by the model's own
forward: the base model runs once per batch with every block replaced by
a recorder that stores what it was called with and passes the hidden
states through; the last recorder stops the forward.

:func:`stream_blocks` is method-agnostic: it hands every state (0 = the
embedding output, ``i`` = the output of block ``i - 1``, before the final
norm, as the in-memory hooks see it) of every batch to a callback, in the
order state 0 of every batch, state 1 of every batch, ...

This module holds the sweep and the buffers the states wait in
(:class:`DiskStates`); the checkpoint it loads the blocks from,
:class:`DiskModel` and :func:`compute_dtype`, is
:mod:`toast.hf.capture.disk_model` (both importable from here too).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from toast._scratch import scratch_file, scratch_place
from toast._validation import format_size
from toast.hf.capture.disk_model import DiskModel, compute_dtype
from toast.hf.capture.states import calibration_inputs, rss_mib, without_kv_cache
from toast.hf.data.calibration import Calibration
from toast.hf.data.progress import progress_bar

__all__ = [
    "BlockEdits",
    "DiskModel",
    "DiskStates",
    "OnBlock",
    "OnState",
    "Swept",
    "compute_dtype",
    "stream_blocks",
    "sweep",
]

#: ``on_state(state, batch, hidden, mask)``: one batch's ``(batch, tokens,
#: dim)`` state and its padding mask (None without one).
OnState = Callable[[int, int, torch.Tensor, "torch.Tensor | None"], None]
#: ``on_block(index, block)``, before a loaded block runs; returns a
#: cleanup called after it has run on every batch (or None).
OnBlock = Callable[[int, nn.Module], "Callable[[], None] | None"]


class DiskStates:
    """Per-batch tensors ``(batch, tokens, dim)`` of one dtype in a file with
    no name in ``directory`` (:func:`toast._scratch.scratch_file`: the kernel
    frees it when the process dies, however it ends), written and read whole
    with positioned I/O (nothing memory-mapped, so what was written does not
    count towards the process's memory). ``shapes`` fixes the layout up
    front; without it batches are appended."""

    def __init__(
        self,
        directory: str | os.PathLike | None,
        dtype: torch.dtype,
        shapes: list[tuple[int, ...]] | None = None,
    ) -> None:
        self.dtype = dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.shapes: list[tuple[int, ...]] = []
        self.offsets = [0]
        for shape in shapes or []:
            self._extend(shape)
        self._file = scratch_file(directory)
        self._fd = self._file.fileno()

    def _extend(self, shape: tuple[int, ...]) -> None:
        self.shapes.append(tuple(int(s) for s in shape))
        self.offsets.append(self.offsets[-1] + self.itemsize * _numel(shape))

    @property
    def nbytes(self) -> int:
        return self.offsets[-1]

    def append(self, tensor: torch.Tensor) -> None:
        """Adds one more batch at the end of the file (the first sets the dtype)."""
        if not self.shapes:
            self.dtype = tensor.dtype
            self.itemsize = tensor.element_size()
        self._extend(tuple(tensor.shape))
        self.write(len(self.shapes) - 1, tensor)

    def write(self, batch: int, tensor: torch.Tensor) -> None:
        data = tensor.detach().to("cpu", self.dtype).contiguous()
        if tuple(data.shape) != self.shapes[batch]:
            raise ValueError(
                f"batch {batch} has shape {tuple(data.shape)}, expected {self.shapes[batch]}"
            )
        os.pwrite(self._fd, data.view(-1).view(torch.uint8).numpy().tobytes(), self.offsets[batch])

    def read(self, batch: int) -> torch.Tensor:
        out = torch.empty(self.shapes[batch], dtype=self.dtype)
        size = self.offsets[batch + 1] - self.offsets[batch]
        data = os.pread(self._fd, size, self.offsets[batch])
        if len(data) != size:
            raise RuntimeError(f"batch {batch} of a state buffer was never written")
        out.view(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return out

    def close(self) -> None:
        """Closes the file, which frees its disk space."""
        if self._fd >= 0:
            self._file.close()
            self._fd = -1


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class _Stop(Exception):
    """Raised by the last recorder: the rest of the forward is not needed."""


@dataclass
class _Batch:
    """What stage 0 recorded for one batch: the padding mask (boolean) and, per block,
    the positional and keyword inputs besides the hidden states."""

    mask: torch.Tensor | None
    inputs: list[tuple[tuple, dict]]


def _record_inputs(disk: DiskModel, args: tuple, kwargs: dict) -> tuple[torch.Tensor, _Batch]:
    """Runs the base model on one batch with every block replaced by a
    recorder; returns the embedding output and the inputs of each block."""
    blocks = disk.stack.blocks
    seen: list[tuple[tuple, dict]] = []
    first: list[torch.Tensor] = []

    def recorder(index: int) -> Callable[..., torch.Tensor]:
        def forward(*a: Any, **kw: Any) -> torch.Tensor:
            hidden = a[0] if a else kw.pop("hidden_states")
            seen.append((tuple(a[1:]), kw))
            if index == 0:
                first.append(hidden)
            if index == len(blocks) - 1:
                raise _Stop
            return hidden

        return forward

    for index, block in enumerate(blocks):
        block.forward = recorder(index)  # an instance attribute shadows the class's
    try:
        disk.base(*args, **kwargs)
    except _Stop:
        pass
    finally:
        for block in blocks:
            del block.forward
    if len(seen) != len(blocks):
        raise RuntimeError(
            f"the forward of {type(disk.base).__name__} called {len(seen)} of its "
            f"{len(blocks)} blocks; sequential calibration needs every block run in order"
        )
    mask = kwargs.get("attention_mask")
    # a boolean row mask, as the in-memory passes hand their consumers
    return first[0], _Batch(mask.bool() if isinstance(mask, torch.Tensor) else None, seen)


def _embed(
    disk: DiskModel, loader: Iterable, cal: Calibration, states: DiskStates, on_state: OnState
) -> list[_Batch]:
    """Stage 0: the embedding output of every batch, appended to ``states``."""
    disk.prepare()
    base = disk.base
    batches: list[_Batch] = []
    try:
        with torch.inference_mode():
            for args, kwargs in calibration_inputs(base, loader, cal, torch.device("cpu")):
                hidden, batch = _record_inputs(disk, args, without_kv_cache(base, kwargs))
                states.append(hidden)
                batches.append(batch)
                on_state(0, len(batches) - 1, hidden, batch.mask)
    finally:  # interrupted too: the embedding is not kept
        disk.release()
    if not batches:
        raise ValueError("the loader yielded no batches")
    return batches


def _announce(states: DiskStates, directory: str | os.PathLike | None) -> None:
    tokens = sum(s[0] * s[1] for s in states.shapes)
    print(
        f"toast: activation buffer of 2 x {format_size(states.nbytes)} ({tokens:,} tokens x "
        f"{states.shapes[0][-1]} x {str(states.dtype).removeprefix('torch.')}) in "
        f"{scratch_place(directory)}",
        file=sys.stderr,
    )


@dataclass(frozen=True)
class BlockEdits:
    """A model described by what changes in the checkpoint's blocks as they
    load, for measuring a compressed model without writing it: the blocks
    of ``skip`` are not run (their input is handed on: plain removal),
    ``after[i]`` maps block ``i``'s output (or, when it is skipped, its
    input) to what the next block receives (a translator standing in for
    a span ending at ``i``), and ``edit(i, block)`` rewrites a block's
    loaded weights before it runs (a transform folded into them). None of
    them changes the checkpoint."""

    skip: frozenset[int] = frozenset()
    after: Mapping[int, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    edit: Callable[[int, nn.Module], None] | None = None

    def changes(self, index: int) -> bool:
        """Whether block ``index`` runs as the checkpoint has it."""
        return index in self.skip or index in self.after


@dataclass
class _Form:
    """The form of a block's output (a tensor, or a tuple with the hidden
    states first), learnt from the first block run, so that the replayed
    final states reach the model's head as a block hands them on."""

    rest: tuple | None = None

    def learn(self, output: Any) -> None:
        if isinstance(output, (tuple, list)) and self.rest is None:
            self.rest = tuple(output[1:])

    def wrap(self, hidden: torch.Tensor) -> Any:
        return hidden if self.rest is None else (hidden, *self.rest)


def _run_block(
    run: Callable[..., Any],
    index: int,
    source: DiskStates,
    target: DiskStates,
    batches: list[_Batch],
    on_state: OnState,
    bar: Any,
    form: _Form,
    after: Callable[[torch.Tensor], torch.Tensor] | None = None,
    rows_at_once: int | None = None,
) -> None:
    """Block ``index`` (``run``) on every batch: read, run (``rows_at_once``
    rows at a time, :func:`_in_rows`), write, report."""
    with torch.inference_mode():
        for b, batch in enumerate(batches):
            args, kwargs = batch.inputs[index]
            output = _in_rows(run, source.read(b), args, kwargs, rows_at_once)
            form.learn(output)
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            if after is not None:
                hidden = after(hidden)
            target.write(b, hidden)
            on_state(index + 1, b, hidden, batch.mask)
            bar.update(1)
            bar.set_postfix(block=index, rss=f"{rss_mib():.0f}MiB")


def _in_rows(
    run: Callable[..., Any], hidden: torch.Tensor, args: tuple, kwargs: dict, per: int | None
) -> Any:
    """``run(hidden, *args, **kwargs)`` on ``per`` rows at a time, the outputs
    joined along the rows: what a block's forward holds at once shrinks
    with the rows, and rows never meet in a block (attention mixes tokens
    of one row), so the states are the whole batch's. The inputs recorded
    for the batch are cut alike: every tensor of two or more dimensions
    whose first is the batch's rows (masks, position ids, rotary tables);
    others (cache positions, tables broadcast over rows) are passed whole."""
    rows = int(hidden.shape[0])
    if per is None or per >= rows:
        return run(hidden, *args, **kwargs)
    joined: torch.Tensor | None = None  # written run by run: never the runs and their join at once
    rest: tuple = ()
    for lo in range(0, rows, per):
        cut = slice(lo, lo + per)
        out = run(hidden[cut], *_rows_of(args, rows, cut), **_rows_of(kwargs, rows, cut))
        states = out[0] if isinstance(out, (tuple, list)) else out
        if joined is None:
            joined = states.new_empty((rows, *states.shape[1:]))
            rest = tuple(out[1:]) if isinstance(out, (tuple, list)) else ()
        joined[cut] = states
    assert joined is not None
    # the hidden states first, the rest as a block gives it
    return (joined, *rest) if rest or isinstance(out, (tuple, list)) else joined


def _rows_of(value: Any, rows: int, cut: slice) -> Any:
    if isinstance(value, torch.Tensor):
        return value[cut] if value.dim() >= 2 and value.shape[0] == rows else value
    if isinstance(value, dict):
        return {k: _rows_of(v, rows, cut) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_rows_of(v, rows, cut) for v in value)
    return value


def _skipped(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return hidden


@dataclass
class Swept:
    """What a sweep over the blocks leaves: the final states of every batch
    (the last block's outputs, on disk), each batch's recorded inputs, and
    the form of a block's output."""

    states: DiskStates
    batches: list[_Batch]
    form: _Form


def stream_blocks(
    disk: DiskModel,
    loader: Iterable,
    on_state: OnState,
    calibration: Calibration | None = None,
    *,
    upto: int | None = None,
    on_block: OnBlock | None = None,
    buffer_dir: str | os.PathLike | None = None,
    desc: str = "sequential",
) -> None:
    """Runs the checkpoint's blocks ``0 .. upto - 1`` (default all) one at a
    time over every batch of ``loader``, handing each state to ``on_state``
    (state 0 of every batch first, then state 1, ...). ``on_block`` sees
    each loaded block before it runs (to hook it). Hidden states wait in two
    files with no name in ``buffer_dir`` (default the system's temporary
    directory), freed on every exit. ``calibration`` bounds the batches as
    for the in-memory passes."""
    with sweep(
        disk,
        loader,
        on_state,
        calibration,
        upto=upto,
        on_block=on_block,
        buffer_dir=buffer_dir,
        desc=desc,
    ):
        pass


@contextlib.contextmanager
def sweep(
    disk: DiskModel,
    loader: Iterable,
    on_state: OnState,
    calibration: Calibration | None = None,
    *,
    upto: int | None = None,
    on_block: OnBlock | None = None,
    edits: BlockEdits | None = None,
    buffer_dir: str | os.PathLike | None = None,
    desc: str = "sequential",
) -> Iterator[Swept]:
    """:func:`stream_blocks` with the blocks changed as ``edits`` say (a
    skipped block hands no state on), yielding what it leaves before its
    buffers are freed."""
    cal = Calibration.from_options(calibration)
    upto = disk.num_blocks if upto is None else upto
    if not 0 <= upto <= disk.num_blocks:
        raise ValueError(f"upto={upto} is outside 0..{disk.num_blocks}")
    files: list[DiskStates] = []
    try:
        source = DiskStates(buffer_dir, disk.dtype)
        files.append(source)
        batches = _embed(disk, loader, cal, source, on_state)
        if cal.progress:
            _announce(source, buffer_dir)
        target = DiskStates(buffer_dir, source.dtype, source.shapes)
        files.append(target)
        run = _Run(disk, batches, on_state, on_block, edits or BlockEdits(), cal, desc)
        yield Swept(run.blocks(source, target, upto), batches, run.form)
    finally:
        for f in files:
            f.close()


@dataclass
class _Run:
    """One sweep's blocks, run one at a time over every batch."""

    disk: DiskModel
    batches: list[_Batch]
    on_state: OnState
    on_block: OnBlock | None
    edits: BlockEdits
    cal: Calibration
    desc: str
    form: _Form = field(default_factory=_Form)

    def blocks(self, source: DiskStates, target: DiskStates, upto: int) -> DiskStates:
        """Runs blocks ``0 .. upto - 1``; returns the buffer holding the last
        states."""
        total = upto * len(self.batches)
        bar = progress_bar(self.desc, total, "batch", not self.cal.progress)
        try:
            for index in range(upto):
                self._block(index, source, target, bar)
                source, target = target, source
        finally:
            bar.close()
        return source

    def _block(self, index: int, source: DiskStates, target: DiskStates, bar: Any) -> None:
        after = self.edits.after.get(index)
        if index in self.edits.skip:
            _run_block(
                _skipped, index, source, target, self.batches, self.on_state, bar, _Form(), after
            )
            return
        block = self.disk.load_block(index)
        if self.edits.edit is not None:
            self.edits.edit(index, block)
        cleanup = self.on_block(index, block) if self.on_block is not None else None
        try:
            _run_block(
                block, index, source, target, self.batches, self.on_state, bar, self.form, after,
                self.disk.rows_at_once,
            )  # fmt: skip
        finally:
            if cleanup is not None:
                cleanup()
            self.disk.unload_block(index)
