"""ReplaceMe's held-out check: every fit is compared with plain removal of
the same blocks on calibration batches the fit never saw, and (with
``fallback``) a cut whose fit measures worse is removed plainly instead.

A least-squares fit can lose to plain removal: when the cut removes the
block that creates a massive activation (an attention sink's hidden-state
norm jumps ~100-fold), the few rows that carry it dominate the squared
error and every other token pays. Held-out batches measure what the
calibration objective cannot: the model's own quality (perplexity for a
causal LM, else the mean cosine of its outputs to the original's, see
:class:`toast.hf.quality.Evaluator`), with the fit applied by hooks, before
anything in the model changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from toast.hf.blocks import BlockStack
from toast.hf.quality import Evaluator, quality_metric, skipped_blocks
from toast.methods.replaceme.fold import residual_writer
from toast.spans import Span

__all__ = ["HeldOutCheck", "Holdout", "best_candidate", "check_fits"]


class Holdout:
    """``data`` split by batch: one batch in every ``round(1 / fraction)``
    (the last of each group) is held out. Re-iterable when ``data`` is."""

    def __init__(self, data: Iterable, fraction: float) -> None:
        self.data = data
        self.every = max(2, round(1 / fraction)) if fraction > 0 else 0

    def _part(self, held: bool) -> Iterator[Any]:
        for index, batch in enumerate(self.data):
            is_held = self.every > 0 and index % self.every == self.every - 1
            if is_held == held:
                yield batch

    def has_check(self) -> bool:
        """Whether any batch is held out (the data has at least ``every``)."""
        return next(iter(self.check), None) is not None

    @property
    def fit(self) -> Iterable:
        """The batches the fit uses."""
        return _Part(self, held=False)

    @property
    def check(self) -> Iterable:
        """The held-out batches."""
        return _Part(self, held=True)


@dataclass(frozen=True)
class _Part:
    split: Holdout
    held: bool

    def __iter__(self) -> Iterator[Any]:
        return self.split._part(self.held)


@dataclass(frozen=True)
class HeldOutCheck:
    """One cut measured on the held-out batches: ``fitted`` and ``plain``
    (plain removal) in ``metric`` over ``count`` scored tokens or samples;
    ``used`` is what the model got."""

    span: Span
    metric: str
    fitted: float
    plain: float
    count: int
    used: str

    @property
    def result(self) -> float:
        """What the model measures with what it got."""
        return self.fitted if self.used == "fitted" else self.plain

    def measured(self) -> str:
        """The two measurements, in words."""
        unit = "tokens" if self.metric == "perplexity" else "samples"
        return (
            f"blocks[{self.span.start}:{self.span.stop}]: fitted {self.fitted:.4g}, plain "
            f"removal {self.plain:.4g} ({self.metric}, {self.count:,} held-out {unit})"
        )

    def to_markdown(self) -> str:
        better = _better(self.metric, self.fitted, self.plain)
        winner = "the fit" if better else "plain removal"
        has = "the fit" if self.used == "fitted" else "plain removal"
        return f"{self.measured()}: {winner} measured better; the model has {has}"


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
) -> list[HeldOutCheck | None]:
    """Each cut's fit against plain removal on ``heldout``, the other cuts
    as decided so far (none with ``alone``: candidate cuts that may
    overlap); with ``fallback`` a cut whose fit measures worse is removed
    plainly. One entry per cut (None: no transform to check). Nothing in
    the model changes."""
    evaluator = Evaluator(heldout, progress=False)
    first = next(iter(heldout))
    if quality_metric(model, first) == "cosine":
        evaluator.measure(model, "original")  # the reference the cosine compares with
    current = list(transforms)
    checks: list[HeldOutCheck | None] = []
    for k, span in enumerate(spans):
        if current[k] is None:
            checks.append(None)
            continue
        where: Sequence[Span] = spans
        fitted_t, plain_t = current, [t if j != k else None for j, t in enumerate(current)]
        if alone:
            where, fitted_t, plain_t = [span], [current[k]], [None]
        with applied(stack, where, fitted_t, placement):
            fitted = evaluator.measure(model, "fitted")
        with applied(stack, where, plain_t, placement):
            removed = evaluator.measure(model, "plain removal")
        assert evaluator.metric is not None  # set by the first measurement
        better = _better(evaluator.metric, fitted, removed)
        used = "fitted" if better or not fallback else "plain removal"
        if used == "plain removal":
            current[k] = None
        checks.append(HeldOutCheck(span, evaluator.metric, fitted, removed, evaluator.count, used))
    return checks


def _better(metric: str, a: float, b: float) -> bool:
    """Whether ``a`` measures at least as well as ``b`` (perplexity: lower)."""
    return a <= b if metric == "perplexity" else a >= b


def best_candidate(checks: Sequence[HeldOutCheck]) -> int:
    """The index of the candidate cut whose model (what each check says it
    gets) measured best on the held-out batches; the first on ties."""
    best = 0
    for k, c in enumerate(checks):
        if not _better(c.metric, checks[best].result, c.result):
            best = k
    return best
