"""Held-out passes resumed part way down the block stack.

A model that differs from the original only from block ``s`` on receives,
at block ``s``, the very states the original's blocks hand on: its blocks
before ``s`` are the original's, on the same inputs. :class:`PrefixStates`
records, during the original's held-out pass, the hidden states entering
some of its blocks for every batch (as many as fit a memory bound, evenly
spaced); a later pass of such a model then resumes at the nearest recorded
block at or before ``s``: each block before it is a stand-in that hands on
the recorded state of the current batch (as
:class:`toast.hf.evaluate.from_disk.SequentialEvaluator` hands on the final
states of a sweep), so that the embedding, the masks and positions, every
later block and the head run as the model's own forward runs them.

Whether a replay is exactly the whole pass is checked as it goes, where
that is cheap: each batch's embedding output must be the one recorded
(the same data in the same order, the same embedding), and on the first
batch each stand-in must receive the keyword inputs (mask, positions) the
original's block received; a block whose output carries more than the
hidden state (a tuple with something besides ``None`` after it, as T5's
position bias) makes the recording unusable. A replay that finds a
difference raises :class:`PrefixMismatch` before the pass's scores are
formed (before any collective of a distributed pass), and the caller
measures the whole model instead.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from toast.hf.evaluate.quality import Evaluator
from toast.hf.model.blocks import BlockStack, find_blocks

__all__ = ["PREFIX_BYTES", "PrefixMismatch", "PrefixStates", "Resuming", "unchanged_blocks"]

#: Default bound on the recorded states (bytes, all batches and blocks
#: together): at 512 MiB a 135M-parameter LM's 64 x 512 held-out tokens of
#: width 576 keep about six block inputs.
PREFIX_BYTES = 512 * 2**20


class PrefixMismatch(RuntimeError):
    """A resumed pass is not the recorded one (other data, another
    embedding, other block inputs): the whole model must be measured."""


def _hidden(module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor):
        raise PrefixMismatch(
            f"cannot find the hidden states entering {type(module).__name__}: expected the "
            "first positional argument or hidden_states=..."
        )
    return hidden


def _fingerprint(value: Any) -> Any:
    """A comparable summary of a forward input: a tensor's shape, dtype
    and float64 sums (the same computation gives the same bits, so the
    same sums); containers item by item; other objects by type (a cache
    object, say, which differs by identity alone)."""
    if isinstance(value, torch.Tensor):
        wide = value.detach().double()
        sums = (float(wide.sum()), float((wide * wide).sum())) if value.numel() else ()
        # repr: nan compares unequal to itself, its text does not
        return ("tensor", tuple(value.shape), str(value.dtype), repr(sums))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_fingerprint(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((str(k), _fingerprint(v)) for k, v in value.items())))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return ("object", type(value).__qualname__)


def _inputs(kwargs: dict) -> Any:
    """What a block receives besides the hidden state, fingerprinted."""
    return _fingerprint({k: v for k, v in kwargs.items() if k != "hidden_states"})


def _format(output: Any) -> int | None:
    """How a block hands on its state: None as a bare tensor, ``n`` as a
    tuple of ``n`` whose tail is all ``None``; a ``ValueError`` for any
    other output, which a stand-in could not reproduce."""
    if isinstance(output, torch.Tensor):
        return None
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        if all(o is None for o in output[1:]):
            return len(output)
    raise ValueError(f"a block returned {type(output).__name__} carrying more than its state")


class PrefixStates:
    """The hidden states entering some blocks of ``stack`` (its path, in
    whichever model is measured), per
    held-out batch, recorded on one pass (:meth:`recording`) and handed to
    the blocks after them on later passes (:meth:`resumed`).

    ``bound``: the bytes the states may take. All of blocks ``1 .. L-1``
    are recorded while they fit; when a batch takes the total over the
    bound every other recorded block is dropped (blocks ``2k``, then
    ``4k``...: evenly spaced, the same set for every batch); none left,
    nothing is recorded. ``compute``: what the recorded pass computed in
    (:class:`toast.hf.evaluate.quality.Evaluator`'s ``compute``), which a
    replay must share."""

    def __init__(self, stack: BlockStack, bound: int = PREFIX_BYTES) -> None:
        if bound < 0:
            raise ValueError(f"bound={bound!r}: give the bytes the states may take, >= 0")
        self.stack, self.bound = stack, bound
        self._clear()

    def _clear(self) -> None:
        #: block index -> the state entering it, one per batch
        self.states: dict[int, list[torch.Tensor]] = {}
        self.step = 1
        self.batches = 0
        self.compute: str | None = None
        self._inputs: list[Any] = []  # each batch's embedding output, fingerprinted
        self._kwargs: dict[int, Any] = {}  # what each block received on the first batch
        self._formats: dict[int, int | None] = {}
        self._usable = False

    @property
    def blocks(self) -> list[int]:
        """The blocks whose inputs are held, in order."""
        return sorted(self.states) if self._usable else []

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for states in self.states.values() for t in states)

    def _thin(self) -> None:
        """Every other recorded block dropped, until the states fit."""
        while self.states and self.nbytes > self.bound:
            self.step *= 2
            self.states = {i: s for i, s in self.states.items() if i % self.step == 0}

    def _before(self, index: int, usable: list[bool], batch: list[int]) -> Any:
        """The pre-hook of block ``index`` while recording."""

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not usable[0]:
                return
            try:
                hidden = _hidden(module, args, kwargs)
            except PrefixMismatch:
                usable[0] = False
                return
            if index == 0:  # the first block runs once per batch
                batch[0] += 1
                self._inputs.append(_fingerprint(hidden))
            if batch[0] == 0:
                self._kwargs[index] = _inputs(kwargs)
            if index in self.states:
                # a copy: a later block may add into its input in place
                self.states[index].append(hidden.detach().clone())
                self._thin()

        return hook

    def _after(self, index: int, usable: list[bool], batch: list[int]) -> Any:
        """The forward hook of block ``index`` while recording: how it hands on its state."""

        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if usable[0] and batch[0] == 0:
                try:
                    self._formats[index] = _format(output)
                except ValueError:
                    usable[0] = False

        return hook

    @contextlib.contextmanager
    def recording(
        self, model: nn.Module, compute: str, only: Collection[int] | None = None
    ) -> Iterator[None]:
        """Within the block, each forward of ``model`` (one per held-out
        batch) records the states entering the chosen blocks (``only``:
        those of them alone; ``model`` may differ from the original after
        the last of them); what was held before is dropped. A pass that
        fails part way keeps nothing."""
        self._clear()
        blocks = find_blocks(model, self.stack).blocks
        chosen = range(1, len(blocks)) if only is None else sorted(set(only))
        self.states = {i: [] for i in chosen if 1 <= i < len(blocks)}
        usable, batch = [len(blocks) > 1 and self.bound > 0], [-1]
        handles = []
        for index, block in enumerate(blocks):
            before = self._before(index, usable, batch)
            handles.append(block.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(block.register_forward_hook(self._after(index, usable, batch)))
        try:
            yield
        except BaseException:
            self._clear()
            raise
        finally:
            for handle in handles:
                handle.remove()
        self.batches, self.compute = batch[0] + 1, compute
        self._usable = usable[0] and self.batches > 0 and bool(self.states)
        if not self._usable:
            self._clear()

    def resume_point(self, start: int, compute: str) -> int:
        """The recorded block a pass of a model that keeps the original's
        blocks before ``start`` resumes at: the nearest at or before it (0:
        none, the whole model runs). Never under another ``compute``: its
        states would differ."""
        if compute != self.compute:
            return 0
        return max((i for i in self.blocks if i <= start), default=0)

    @contextlib.contextmanager
    def resumed(self, model: nn.Module, at: int) -> Iterator[None]:
        """Within the block, ``model``'s blocks before ``at`` (a block of
        :meth:`resume_point`) do not run: each is replaced in the block
        list by a stand-in, the one before ``at`` handing on the state the
        original's blocks handed block ``at`` for the current batch (their
        hooks do not run either: they ran on the recorded pass).
        :class:`PrefixMismatch` when a batch is not the recorded one."""
        if at not in self.blocks:
            raise ValueError(f"no states recorded for block {at}; recorded: {self.blocks}")
        blocks = find_blocks(model, self.stack).blocks
        recorded = self.states[at]
        batch = [-1]

        def stand_in(index: int) -> Callable[..., Any]:
            def forward(*args: Any, **kwargs: Any) -> Any:
                hidden = _hidden(originals[index], args, kwargs)
                if index == 0:
                    batch[0] += 1
                    if batch[0] >= self.batches:
                        raise PrefixMismatch("the held-out data gave more batches than recorded")
                    if _fingerprint(hidden) != self._inputs[batch[0]]:
                        raise PrefixMismatch(
                            f"batch {batch[0]} enters the blocks unlike the recorded pass's"
                        )
                if batch[0] == 0 and _inputs(kwargs) != self._kwargs[index]:
                    raise PrefixMismatch(f"block {index} receives other inputs than recorded")
                # a copy: the blocks after may write into their input in place
                state = recorded[batch[0]].clone() if index == at - 1 else hidden
                tail = self._formats[index]
                return state if tail is None else (state, *([None] * (tail - 1)))

            return forward

        originals = [blocks[index] for index in range(at)]
        try:
            for index, block in enumerate(originals):
                blocks[index] = _StandIn(block, stand_in(index))
            yield
        finally:
            for index, block in enumerate(originals):
                blocks[index] = block
        if batch[0] + 1 != self.batches:
            # not a PrefixMismatch: found after the pass's scores (and, under
            # torch.distributed, their collectives), so no whole pass may follow;
            # the held-out data must give the same batches on every pass
            raise ValueError("the held-out data gave fewer batches than on the recorded pass")


class Resuming:
    """Held-out passes of models that are the original before a known
    block, on ``evaluator``'s data: the first pass records the states
    entering the blocks the others start at (those at or before its own
    start), each later pass resumes at the nearest recorded block at or
    before its start. ``stack`` None (a checkpoint measured from disk):
    every pass runs whole. For a caller that knows where each model it
    measures first differs from the original (the candidates of a
    measured choice, fits checked against plain removal), so that no block
    before that runs twice on a batch."""

    def __init__(self, evaluator: Evaluator, stack: BlockStack | None, starts: Iterable[int]):
        self.evaluator, self.starts = evaluator, sorted(set(starts))
        self.prefix = PrefixStates(stack) if stack is not None and self.starts else None

    def measure(self, model: nn.Module, label: str, start: int | None = None) -> float:
        """``evaluator.measure(model, label)`` of a model whose blocks
        before ``start`` (None: all of them) are the original's, resumed
        where a block at or before ``start`` was recorded."""
        evaluator, prefix = self.evaluator, self.prefix
        if prefix is None:
            return evaluator.measure(model, label)
        if prefix.batches == 0:  # nothing recorded yet (or a recording was unusable)
            first = self.starts[0] if start is None else start
            only = {min(s, first) for s in self.starts}
            with prefix.recording(model, evaluator.compute, only=only):
                return evaluator.measure(model, label)
        at = prefix.resume_point(0 if start is None else start, evaluator.compute)
        if at == 0:
            return evaluator.measure(model, label)
        try:
            with prefix.resumed(model, at):
                return evaluator.measure(model, label)
        except PrefixMismatch:
            # raised before the pass's scores were formed: measured whole instead
            return evaluator.measure(model, label)


class _StandIn(nn.Module):
    """A block's place in the block list, held by ``forward``; the block's
    attributes read through it (a model's loop may read, say, which mask a
    layer takes), its weights not registered (they do not run)."""

    def __init__(self, block: nn.Module, forward: Callable[..., Any]) -> None:
        super().__init__()
        # plain attributes, not submodules: the stand-in has no parameters
        self.__dict__["block"], self.__dict__["stand_in"] = block, forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.stand_in(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        block = self.__dict__.get("block")
        if block is None:  # while nn.Module sets itself up
            raise AttributeError(name)
        return getattr(block, name)


def _same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    if (a.shape, a.dtype, a.device) != (b.shape, b.dtype, b.device):
        return False
    shared = (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.stride() == b.stride()
    )
    # a copy (the block before a cut is copied whether or not it is written) by value
    return shared or bool(torch.equal(a, b))


_PLAIN = (bool, int, float, str, type(None))
_HOOKS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def _hook_functions(module: nn.Module, kind: str) -> list[Any]:
    """The functions of ``module``'s hooks of ``kind``: a copied model's
    hooks that are bound methods are bound to copies of their objects,
    and run the same code."""
    hooks = getattr(module, kind, {}).values()
    return [getattr(h, "__func__", getattr(h, "func", h)) for h in hooks]


def _same_module(a: nn.Module, b: nn.Module) -> bool:
    """Whether ``a`` and ``b`` (one module, not its children) compute the
    same: class, tensors, hooks, an instance forward and plain settings."""
    if type(a) is not type(b):
        return False
    for tensors in ("_parameters", "_buffers"):
        x, y = getattr(a, tensors), getattr(b, tensors)
        if x.keys() != y.keys() or not all(_same_tensor(x[k], y[k]) for k in x):
            return False
    if any(_hook_functions(a, h) != _hook_functions(b, h) for h in _HOOKS):
        return False
    if a.__dict__.get("forward") is not b.__dict__.get("forward"):
        return False
    plain = {k for k, v in vars(a).items() if isinstance(v, _PLAIN)}
    plain |= {k for k, v in vars(b).items() if isinstance(v, _PLAIN)}
    return all(a.__dict__.get(k, ...) == b.__dict__.get(k, ...) for k in plain)


def _same_block(a: nn.Module, b: nn.Module) -> bool:
    x, y = list(a.named_modules()), list(b.named_modules())
    if [name for name, _ in x] != [name for name, _ in y]:
        return False
    return all(_same_module(m, n) for (_, m), (_, n) in zip(x, y, strict=True))


def unchanged_blocks(original: BlockStack, model: nn.Module, limit: int | None = None) -> int:
    """How many of ``model``'s first blocks (at ``original``'s path, up to
    ``limit``) are ``original``'s in all that a forward reads: the same
    classes, the same weights (shared, or equal), hooks and settings. 0 when
    ``model`` has no block list there."""
    try:
        blocks = find_blocks(model, original).blocks
    except ValueError:
        return 0
    stop = min(len(blocks), len(original.blocks), math.inf if limit is None else limit)
    for index in range(int(stop)):
        if not _same_block(original.blocks[index], blocks[index]):
            return index
    return int(stop)
