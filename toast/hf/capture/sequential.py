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
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from toast._malloc import trim_heap
from toast._scratch import scratch_file, scratch_place
from toast._validation import format_size
from toast.hf.capture.states import calibration_inputs, rss_mib, without_kv_cache
from toast.hf.data.calibration import Calibration
from toast.hf.data.progress import progress_bar
from toast.hf.model.blocks import BlockStack, find_blocks
from toast.hf.model.checkpoint import Checkpoint

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


def _base_path(model: nn.Module, block_path: str) -> str:
    """The nearest ancestor of the block list that is a transformers model
    (``model`` for Llama, ``transformer`` for GPT-2, ``""`` for a bare
    ViTModel): its forward builds the masks and position embeddings."""
    from transformers import PreTrainedModel

    parts = block_path.split(".")[:-1]
    for end in range(len(parts), 0, -1):
        path = ".".join(parts[:end])
        if isinstance(model.get_submodule(path), PreTrainedModel):
            return path
    return ""


def _set_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    parent_path, _, leaf = name.rpartition(".")
    parent = module.get_submodule(parent_path) if parent_path else module
    if leaf in parent._parameters:
        parent._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        parent._buffers[leaf] = value


_WIDENED = (torch.float16, torch.bfloat16)


def compute_dtype(weights: torch.dtype, option: str = "auto") -> torch.dtype:
    """The dtype the block-by-block path computes in for weights of dtype
    ``weights`` (see :class:`toast.hf.data.calibration.Calibration`): this
    path runs on the CPU, where ``"auto"`` widens 16-bit weights to float32."""
    if option == "checkpoint":
        return weights
    if option == "float32" or (option == "auto" and weights in _WIDENED):
        return torch.float32
    if option == "auto":
        return weights
    raise ValueError(f"compute_dtype must be 'auto', 'float32' or 'checkpoint'; got {option!r}")


@dataclass
class DiskModel:
    """A checkpoint's structure, discovered once: the model on the meta
    device, its block stack, the base model whose forward prepares each
    block's inputs, and ``dtype``, what the blocks compute in and the states
    between them are kept in (the weights' dtype is ``checkpoint.dtype``)."""

    checkpoint: Checkpoint
    model: nn.Module
    stack: BlockStack
    base_path: str
    dtype: torch.dtype
    _ready: bool = field(default=False, repr=False)
    _full: bool = field(default=False, repr=False)
    _names: dict[str, str] | None = field(default=None, repr=False)

    @classmethod
    def open(
        cls,
        folder: str | os.PathLike | Checkpoint | DiskModel,
        blocks: str | None = None,
        compute: str = "auto",
    ) -> DiskModel:
        """The structure of the checkpoint in ``folder`` (one already
        discovered is returned as it is), computing in ``compute``
        (:func:`compute_dtype`)."""
        if isinstance(folder, DiskModel):
            return folder
        checkpoint = folder if isinstance(folder, Checkpoint) else Checkpoint(folder)
        dtype = compute_dtype(checkpoint.dtype, compute)
        # built in the compute dtype, as from_pretrained(dtype=...) builds it
        model = checkpoint.skeleton(dtype)
        model.eval()
        stack = find_blocks(model, blocks)
        base_path = _base_path(model, stack.path)
        disk = cls(checkpoint, model, stack, base_path, dtype)
        disk._names = checkpoint.names(model)  # with the blocks in place
        return disk

    @property
    def base(self) -> nn.Module:
        return self.model.get_submodule(self.base_path) if self.base_path else self.model

    @property
    def num_blocks(self) -> int:
        return self.stack.num_blocks

    def _key(self, name: str) -> str:
        if self._names is None:
            self._names = self.checkpoint.names(self.model)
        if name not in self._names:
            raise KeyError(f"{self.checkpoint.folder} has no tensor for {name!r}")
        return self._names[name]

    def key_of(self, name: str) -> str | None:
        """The checkpoint key of the model's state-dict entry ``name``, or
        None when the checkpoint lacks it."""
        return (self._names or {}).get(name)

    def block_keys(self, index: int) -> dict[str, str]:
        """Block ``index``'s state-dict names and their checkpoint keys."""
        block = self.stack.blocks[index]
        prefix = f"{self.stack.path}.{index}."
        return {name: self._key(prefix + name) for name in block.state_dict()}

    def renumbered(self, removed: Iterable[int]) -> tuple[dict[str, str | None], list[int]]:
        """With the blocks ``removed`` left out: every block's checkpoint key
        mapped to its key under the block's new index (None: left out), and
        the kept blocks' original indices (what a pruned checkpoint's
        writer takes)."""
        gone = set(removed)
        kept = [b for b in range(self.num_blocks) if b not in gone]
        renames: dict[str, str | None] = {}
        for b in range(self.num_blocks):
            new = self.block_keys(kept.index(b)) if b in kept else {}
            for name, key in self.block_keys(b).items():
                renames[key] = new[name] if new else None
        return renames, kept

    def largest_block_bytes(self) -> int:
        """Bytes of the largest block's tensors in the checkpoint."""
        tensors = self.checkpoint.tensors
        return max(
            sum(tensors[k].nbytes for k in self.block_keys(i).values())
            for i in range(self.num_blocks)
        )

    def _load(self, module: nn.Module, keys: dict[str, str]) -> None:
        # Non-persistent buffers (rotary frequencies, embedding scales) are
        # not in the checkpoint: transformers computes them in _init_weights,
        # which may also write random weights, so it runs before the load.
        init = getattr(self.model, "_init_weights", None)
        for _, sub in module.named_modules():
            transient = [n for n in sub._buffers if n in sub._non_persistent_buffers_set]
            for name in transient:
                buffer = sub._buffers[name]
                if buffer is not None:
                    sub._buffers[name] = torch.empty_like(buffer, device="cpu")
            if transient and init is not None:
                _writable(sub)
                init(sub)
        for name, key in keys.items():
            _set_tensor(module, name, self._widened(self.checkpoint.read(key)))

    def _widened(self, tensor: torch.Tensor) -> torch.Tensor:
        # one tensor at a time: its 16-bit copy is freed before the next read
        if tensor.is_floating_point() and tensor.dtype != self.dtype:
            return tensor.to(self.dtype)
        return tensor

    def _outside(self, full: bool) -> tuple[nn.Module, str]:
        """The module whose parts outside the block list :meth:`prepare`
        loads, and its prefix among the model's state-dict names."""
        if full:
            return self.model, ""
        return self.base, f"{self.base_path}." if self.base_path else ""

    @contextlib.contextmanager
    def _without_blocks(self) -> Iterator[None]:
        # the blocks stay on the meta device while the rest moves
        holder_path, _, attr = self.stack.path.rpartition(".")
        holder = self.model.get_submodule(holder_path) if holder_path else self.model
        setattr(holder, attr, nn.ModuleList())
        try:
            yield
        finally:
            setattr(holder, attr, self.stack.blocks)

    def prepare(self, full: bool = False, embedding: bool = True) -> None:
        """Loads everything of the base model outside the block list (the
        embeddings, the final norm, rotary buffers), once; with ``full``,
        of the whole model (the head too: the held-out measurements need
        its outputs). Without ``embedding`` the input embedding stays on the
        meta device unless the head shares its weight (a replay of recorded
        final states never reads it: see :meth:`skipped_embedding`)."""
        if self._ready:
            return
        with self._without_blocks():
            module, prefix = self._outside(full)
            names = self._names or {}
            skipped = None if embedding else self._untied_embedding()
            # what the checkpoint lacks (a tied head, an unused pooler) stays
            # on the meta device: the forward stops at the last block
            keys = {
                n: names[prefix + n]
                for n in module.state_dict()
                if prefix + n in names and not (skipped and (prefix + n).startswith(skipped))
            }
            self._load(module, keys)
            if full:
                _tie_head(self.model)
                _drop_absent(self.model, keep=skipped)
        self._ready = True
        self._full = full

    def _untied_embedding(self) -> str | None:
        """The state-dict prefix of the input embedding when the checkpoint
        has a head of its own (so the embedding can stay unloaded)."""
        inputs, head = self.embedding("input"), self.embedding("output")
        if inputs is None or head is None:
            return None
        named = {id(m): n for n, m in self.model.named_modules()}
        head_name, input_name = named.get(id(head)), named.get(id(inputs))
        names = self._names or {}
        if head_name is None or input_name is None or f"{head_name}.weight" not in names:
            return None
        if names[f"{head_name}.weight"] == names.get(f"{input_name}.weight"):
            return None  # one tensor serves both
        return input_name + "."

    def embedding(self, which: Literal["input", "output"]) -> nn.Module | None:
        """The model's input embedding or its head (None: it has none)."""
        get = getattr(self.model, f"get_{which}_embeddings", None)
        found = get() if callable(get) else None
        return found if isinstance(found, nn.Module) else None

    def skipped_embedding(self) -> nn.Module | None:
        """The input embedding when :meth:`prepare` left it unloaded."""
        inputs = self.embedding("input")
        params = list(inputs.parameters()) if inputs is not None else []
        return inputs if params and all(p.is_meta for p in params) else None

    def release(self) -> None:
        """Frees what :meth:`prepare` loaded: after stage 0 the blocks'
        inputs are recorded and the embedding is no longer needed."""
        if not self._ready:
            return
        with self._without_blocks():
            self._outside(self._full)[0].to("meta")
        self._ready = False
        trim_heap()

    def load_block(self, index: int) -> nn.Module:
        """Block ``index`` with its weights read from the checkpoint."""
        block = self.stack.blocks[index]
        self._load(block, self.block_keys(index))
        return block.eval()

    def unload_block(self, index: int) -> None:
        """Frees block ``index``'s weights (back to the meta device)."""
        self.stack.blocks[index].to("meta")
        trim_heap()


def _tie_head(model: nn.Module) -> None:
    """A head tied to the input embedding is not in the checkpoint: tie it
    to the loaded embedding, as ``from_pretrained`` does."""
    tie = getattr(model, "tie_weights", None)
    if tie is not None:
        tie()


def _drop_absent(model: nn.Module, keep: str | None = None) -> None:
    """Removes the parts the checkpoint lacks entirely (a pooler the saved
    model was built without), as the saved model has none: the forward
    skips a part that is None. The part at the prefix ``keep`` stays."""
    absent: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(a + ".") for a in absent):
            continue
        if keep is not None and (name + ".").startswith(keep):
            continue
        params = list(module.parameters())
        if params and all(p.is_meta for p in params):
            absent.append(name)
    for name in absent:
        parent_path, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, leaf, None)


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
) -> None:
    """Block ``index`` (``run``) on every batch: read, run, write, report."""
    with torch.inference_mode():
        for b, batch in enumerate(batches):
            args, kwargs = batch.inputs[index]
            output = run(source.read(b), *args, **kwargs)
            form.learn(output)
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            if after is not None:
                hidden = after(hidden)
            target.write(b, hidden)
            on_state(index + 1, b, hidden, batch.mask)
            bar.update(1)
            bar.set_postfix(block=index, rss=f"{rss_mib():.0f}MiB")


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
                block, index, source, target, self.batches, self.on_state, bar, self.form, after
            )
        finally:
            if cleanup is not None:
                cleanup()
            self.disk.unload_block(index)


def _writable(module: nn.Module) -> None:
    """``module``'s own tensors made writable by ``_init_weights`` outside
    inference mode: one loaded while a held-out measurement ran (in
    inference mode) is an inference tensor, which an in-place write outside
    it refuses; a copy is not (the checkpoint's values are loaded after)."""
    if torch.is_inference_mode_enabled():
        return
    for name, param in list(module._parameters.items()):
        if param is not None and param.is_inference():
            module._parameters[name] = nn.Parameter(param.clone(), param.requires_grad)
    for name, buffer in list(module._buffers.items()):
        if buffer is not None and buffer.is_inference():
            module._buffers[name] = buffer.clone()
