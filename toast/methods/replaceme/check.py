"""ReplaceMe's held-out check: every fit is compared with plain removal of
the same blocks on calibration batches the fit never saw (see
:mod:`toast.hf.evaluate.check`), with the transform applied by hooks where the
surgery would put it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from toast.hf.evaluate.check import CheckSplit, RemovalCheck, best_candidate, check_against_plain
from toast.hf.evaluate.quality import skipped_blocks
from toast.hf.model.blocks import BlockStack
from toast.methods.replaceme.fold import residual_writer
from toast.spans import Span

__all__ = ["RemovalCheck", "CheckSplit", "applied", "best_candidate", "check_fits"]


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


def _times(transform: np.ndarray) -> Any:
    t64 = torch.as_tensor(np.asarray(transform, dtype=np.float64))

    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        hidden = _first(output)
        moved = (hidden.double() @ t64.to(hidden.device)).to(hidden.dtype)
        if isinstance(output, tuple):
            return (moved, *output[1:])
        if isinstance(output, list):
            return [moved, *output[1:]]
        return moved

    return hook


@contextlib.contextmanager
def applied(
    stack: BlockStack, spans: Sequence[Span], transforms: Sequence[Any], placement: str
) -> Iterator[None]:
    """Within the block the model computes as if the cuts were made: the
    blocks of ``spans`` pass their input on, and each T (None: plain
    removal) multiplies the writer's output of the block before its cut
    (its whole output for ``placement="block"``)."""
    handles = []
    try:
        for span, t in zip(spans, transforms, strict=True):
            if t is None:
                continue
            block = stack.blocks[span.start - 1]
            module = block if placement == "block" else residual_writer(block).module
            handles.append(module.register_forward_hook(_times(t)))
        with skipped_blocks(stack, spans):
            yield
    finally:
        for handle in handles:
            handle.remove()


def check_fits(
    model: nn.Module,
    stack: BlockStack,
    spans: Sequence[Span],
    transforms: Sequence[np.ndarray | None],
    placement: str,
    heldout: Iterable,
    fallback: bool,
    alone: bool = False,
    removed: dict[Any, Any] | None = None,
) -> list[RemovalCheck | None]:
    """Each cut's T against plain removal on ``heldout``
    (:func:`toast.hf.evaluate.check.check_against_plain`, plain removal
    measured once for ``removed``), applied by hooks as ``placement`` puts it."""

    def apply(where: Sequence[Span], fits: Sequence[Any]) -> contextlib.AbstractContextManager:
        return applied(stack, where, fits, placement)

    return check_against_plain(
        model, spans, transforms, apply, heldout, fallback, alone, removed=removed, stack=stack
    )
