"""The checkpoint side of calibration block by block: :class:`DiskModel`, a
checkpoint's structure discovered once on the meta device, which loads the
parts outside the block list and then one block at a time, tensor by tensor
from the safetensors shards (:func:`compute_dtype` says what it computes in).

The sweep that runs those blocks over every calibration batch, and the
buffers its states wait in, are :mod:`toast.hf.capture.sequential`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

from toast._malloc import trim_heap
from toast.hf.capture.compute import NARROW_DTYPES, compute_dtype
from toast.hf.model.blocks import BlockStack, find_blocks
from toast.hf.model.checkpoint import Checkpoint

__all__ = ["DiskModel", "compute_dtype"]


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


#: Bytes of a 16-bit head's weight widened at once when the block-by-block
#: path keeps it narrow (:meth:`DiskModel.narrow`).
HEAD_CHUNK_BYTES = 32 * 2**20


def _narrow_linear_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module``'s output in ``x``'s dtype from its narrower weight, widened
    :data:`HEAD_CHUNK_BYTES` of rows at a time: each output is the dot product
    over the same width the widened weight would give."""
    assert isinstance(module, nn.Linear)
    weight, bias = module.weight, module.bias
    per = max(1, HEAD_CHUNK_BYTES // max(1, weight.shape[1] * x.element_size()))
    out = x.new_empty(*x.shape[:-1], weight.shape[0])
    for lo in range(0, weight.shape[0], per):
        part = weight[lo : lo + per].to(x.dtype)
        shift = None if bias is None else bias[lo : lo + per].to(x.dtype)
        out[..., lo : lo + per] = F.linear(x, part, shift)
    return out


def _widen_output(
    dtype: torch.dtype, module: nn.Module, args: tuple, output: torch.Tensor
) -> torch.Tensor:
    return output.to(dtype)


def narrow_kind(module: nn.Module | None) -> str | None:
    """Whether ``module`` computes the same from a 16-bit weight kept as read
    (``"embedding"``: a plain lookup, exact; ``"linear"``: a plain
    projection, widened a chunk of rows at a time); None when its forward
    may do more (a scaled embedding, a soft-capped head)."""
    if type(module) is nn.Embedding and module.max_norm is None:
        return "embedding"
    if type(module) is nn.Linear:
        return "linear"
    return None


@dataclass
class DiskModel:
    """A checkpoint's structure, discovered once: the model on the meta
    device, its block stack, the base model whose forward prepares each
    block's inputs, and ``dtype``, what the blocks compute in and the states
    between them are kept in (the weights' dtype is ``checkpoint.dtype``).

    ``rows_at_once``: the most rows of a batch one block's forward takes at
    once (None: the whole batch), which the memory plan lowers when a whole
    batch's forward does not fit (:func:`toast.hf.capture.budget.fit_plan`).
    A block treats every row alone, so the states are the same.
    ``logit_bytes``: the most bytes of logits a held-out forward holds at
    once (None: :data:`toast.hf.capture.budget.LOGIT_BYTES`), which the plan
    lowers in turn; positions are scored alone, so the scores are the same.

    A 16-bit checkpoint computed in float32 keeps its input embedding and
    its head in their 16-bit weights (:meth:`narrow`): the embedding's rows
    are widened as they are looked up and the head's a chunk at a time,
    which gives what the widened weights give at half their memory."""

    checkpoint: Checkpoint
    model: nn.Module
    stack: BlockStack
    base_path: str
    dtype: torch.dtype
    rows_at_once: int | None = None
    logit_bytes: int | None = None
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

    def params_without(self, spans: Iterable[tuple[int, int]]) -> tuple[int, int]:
        """The checkpoint's parameters, and those left once the blocks of
        ``spans`` (``(start, stop)``) are cut, counted from its tensors'
        shapes (what a written checkpoint holds)."""
        tensors = self.checkpoint.tensors
        before = sum(math.prod(info.shape) for info in tensors.values())
        removed = sum(
            math.prod(tensors[key].shape)
            for start, stop in spans
            for b in range(start, stop)
            for key in self.block_keys(b).values()
        )
        return before, before - removed

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

    @property
    def head_chunk_bytes(self) -> int:
        """Bytes of a narrow head's weight widened at once (what the memory
        plan counts beside its 16-bit weight)."""
        return HEAD_CHUNK_BYTES

    def narrow(self, which: Literal["input", "output"]) -> bool:
        """Whether the input embedding (or the head) stays in the
        checkpoint's 16-bit dtype while the blocks compute wider: its forward
        is a plain lookup (or projection, :func:`narrow_kind`), and a head
        that shares the embedding's weight is one too."""
        if self.checkpoint.dtype not in NARROW_DTYPES or self.dtype != torch.float32:
            return False
        module = self.embedding(which)
        if narrow_kind(module) is None:
            return False
        other = self.embedding("output" if which == "input" else "input")
        if other is None:
            return True
        return narrow_kind(other) is not None or self._untied_embedding() is not None

    def _narrowed(self) -> dict[str, nn.Module]:
        """The modules :meth:`narrow` keeps 16-bit, by their name in the
        model (the prefix of their state-dict entries)."""
        named = {id(m): n for n, m in self.model.named_modules()}
        found: dict[str, nn.Module] = {}
        sides: tuple[Literal["input", "output"], ...] = ("input", "output")
        for which in sides:
            module = self.embedding(which)
            if module is not None and self.narrow(which) and id(module) in named:
                found[named[id(module)]] = module
        return found

    def _install_narrow(self, modules: Iterable[nn.Module]) -> None:
        """Widens each narrow module's output instead of its weight."""
        for module in modules:
            if module.__dict__.get("_toast_narrow"):
                continue
            if narrow_kind(module) == "linear":
                module.forward = functools.partial(_narrow_linear_forward, module)
                handle = None
            else:
                handle = module.register_forward_hook(functools.partial(_widen_output, self.dtype))
            module.__dict__["_toast_narrow"] = handle or True

    def _remove_narrow(self) -> None:
        for module in self.model.modules():
            mark = module.__dict__.pop("_toast_narrow", None)
            if mark is None:
                continue
            if mark is True:
                module.__dict__.pop("forward", None)
            else:
                mark.remove()

    def largest_block_bytes(self) -> int:
        """Bytes of the largest block's tensors in the checkpoint."""
        tensors = self.checkpoint.tensors
        return max(
            sum(tensors[k].nbytes for k in self.block_keys(i).values())
            for i in range(self.num_blocks)
        )

    def _load(self, module: nn.Module, keys: dict[str, str], keep: Iterable[str] = ()) -> None:
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
        kept = tuple(keep)
        for name, key in keys.items():
            tensor = self.checkpoint.read(key)
            narrow = any(name.startswith(prefix) for prefix in kept)
            _set_tensor(module, name, tensor if narrow else self._widened(tensor))

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
            narrowed = {
                name.removeprefix(prefix) + ".": m
                for name, m in self._narrowed().items()
                if name.startswith(prefix) or not prefix
            }
            self._load(module, keys, keep=narrowed)
            if full:
                _tie_head(self.model)
                _drop_absent(self.model, keep=skipped)
            self._install_narrow(
                m for m in narrowed.values() if not any(p.is_meta for p in m.parameters())
            )
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
        self._remove_narrow()
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
