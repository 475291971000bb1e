"""Multiply-adds of a model's ``nn.Linear`` layers, counted by hooks on one
forward pass: the ``"linear"`` convention of :func:`toast.macs` and the
count ``toast.search``'s ``macs=`` target compares.

It needs no knowledge of the family (any model ``toast`` can run), sees
what surgery left (removed blocks, pruned head widths, translators), and
leaves out attention's own products (``Q·Kᵀ``, ``A·V``), which every plan
keeps per kept block; :func:`toast.macs` with ``convention="all"`` counts
them analytically for the families it knows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from toast.hf.capture.states import forward_inputs
from toast.hf.evaluate.quality import batch_rows
from toast.hf.model.blocks import BlockStack

__all__ = ["LinearCounts", "linear_counts", "linear_macs", "synthetic_example"]


@dataclass(frozen=True)
class LinearCounts:
    """Linear-layer MACs of one sample: ``per_block`` for every block of
    the stack that is not a stand-in, ``translators`` for every stand-in
    (a translator block), ``outside`` every layer outside the block list
    (projections, poolers, heads); ``tokens`` the rows the first block saw."""

    per_block: tuple[int, ...]
    translators: tuple[int, ...]
    outside: int
    tokens: int

    @property
    def parts(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(per_block, translators)``."""
        return self.per_block, self.translators

    @property
    def total(self) -> int:
        return sum(self.per_block) + sum(self.translators) + self.outside


def _first(values: Any, rows: int) -> Any:
    """``values`` (a tuple or dict) with every batch tensor cut to its first row."""

    def cut(v: Any) -> Any:
        is_batch = isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows
        return v[:1] if is_batch else v

    if isinstance(values, dict):
        return {k: cut(v) for k, v in values.items()}
    return tuple(cut(v) for v in values)


def _owners(stack: BlockStack | None) -> dict[int, tuple[str, int]]:
    """``id(module)`` → (``"block"`` or ``"translator"``, index) for every
    module inside the block list."""
    owners: dict[int, tuple[str, int]] = {}
    if stack is None:
        return owners
    counts = {"block": 0, "translator": 0}
    for child in stack.blocks:
        kind = "translator" if getattr(child, "_toast_stand_in", False) else "block"
        for module in child.modules():
            owners[id(module)] = (kind, counts[kind])
        counts[kind] += 1
    return owners


def linear_counts(model: nn.Module, example: Any, stack: BlockStack | None = None) -> LinearCounts:
    """Multiply-adds per sample of every ``nn.Linear`` in one forward of
    ``example``'s first sample (each call: its input rows × in × out
    features), split by the blocks of ``stack`` (None: all outside)."""
    owners = _owners(stack)
    blocks = sum(1 for kind, _ in set(owners.values()) if kind == "block")
    stand_ins = sum(1 for kind, _ in set(owners.values()) if kind == "translator")
    per = {"block": [0] * blocks, "translator": [0] * stand_ins}
    outside, tokens = [0], [0]

    def count(module: nn.Module, args: tuple, output: Any) -> None:
        x = args[0]
        rows = x.numel() // x.shape[-1]
        macs = rows * module.in_features * module.out_features
        owner = owners.get(id(module))
        if owner is None:
            outside[0] += macs
            return
        per[owner[0]][owner[1]] += macs
        if owner == ("block", 0) and not tokens[0]:
            tokens[0] = rows

    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    handles = [m.register_forward_hook(count) for m in linears]
    was_training = model.training
    model.eval()
    try:
        args, kwargs = forward_inputs(model, example)
        rows = batch_rows(args, kwargs)
        with torch.inference_mode():
            model(*_first(args, rows), **_first(kwargs, rows))
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return LinearCounts(tuple(per["block"]), tuple(per["translator"]), outside[0], tokens[0])


def linear_macs(model: nn.Module, example: Any) -> int:
    """Multiply-adds per sample of every ``nn.Linear`` in one forward of
    ``example``'s first sample."""
    return linear_counts(model, example).total


def synthetic_example(model: nn.Module, image_size: Any, seq_len: int | None) -> Any:
    """One input of the size asked: an image batch of one for a vision
    config (``image_size``, default the config's), else ``seq_len`` token
    ids (their values change no linear layer's count)."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no .config to read input sizes from")
    default = getattr(config, "image_size", None)
    if default is not None and seq_len is None:
        size = default if image_size is None else image_size
        h, w = (size, size) if isinstance(size, int) else tuple(size)
        channels = int(getattr(config, "num_channels", 3))
        return torch.zeros(1, channels, int(h), int(w))
    if seq_len is None:
        raise ValueError(
            f"a {getattr(config, 'model_type', type(model).__name__)} model needs seq_len "
            "(the number of tokens per input) or example= (one input batch)"
        )
    ids = torch.zeros(1, int(seq_len), dtype=torch.long)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
