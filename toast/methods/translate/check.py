"""TOAST's held-out check: each span's translator against plain removal of
the same blocks on calibration batches the analysis never saw (see
:mod:`toast.hf.evaluate.check`), applied by hooks where the surgery would put it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from toast.core import Translator
from toast.hf.evaluate.check import RemovalCheck, check_against_plain
from toast.hf.evaluate.quality import skipped_blocks
from toast.hf.model.blocks import BlockStack
from toast.hf.model.surgery import translator_like
from toast.spans import Span

__all__ = ["check_translators", "translated"]


def _through(module: nn.Module) -> Any:
    def hook(block: nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, tuple):
            return (module(output[0]), *output[1:])
        return module(output)

    return hook


@contextlib.contextmanager
def translated(
    stack: BlockStack, spans: Sequence[Span], fits: Sequence[Translator | nn.Module | None]
) -> Iterator[None]:
    """Within the block the model computes as if each span were replaced by
    its translator (None: plain removal): the span's blocks pass their input
    on and the last one's output goes through the translator."""
    handles = []
    try:
        with skipped_blocks(stack, spans):
            # registered after the pass-through hooks, so they run after them
            for span, fit in zip(spans, fits, strict=True):
                if fit is not None:
                    last = stack.blocks[span.stop - 1]
                    module = translator_like(fit, stack.blocks[span.start])
                    handles.append(last.register_forward_hook(_through(module)))
            yield
    finally:
        for handle in handles:
            handle.remove()


def check_translators(
    model: nn.Module,
    stack: BlockStack,
    spans: Sequence[Span],
    fits: Sequence[Translator | nn.Module | None],
    heldout: Iterable,
    fallback: bool,
) -> list[RemovalCheck | None]:
    """Each span's translator against plain removal on ``heldout``
    (:func:`toast.hf.evaluate.check.check_against_plain`)."""

    def apply(where: Sequence[Span], chosen: Sequence[Any]) -> contextlib.AbstractContextManager:
        return translated(stack, where, chosen)

    with torch.no_grad():
        return check_against_plain(model, spans, fits, apply, heldout, fallback)
