"""TOAST's held-out measurements, on calibration batches the analysis never
saw (see :mod:`toast.hf.evaluate.check`), with each translator applied by
hooks where the surgery would put it: the candidate plans of a measured
choice (:func:`measure_plans`), and each span's translator against plain
removal of the same blocks (:func:`check_translators`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from toast.core import Translator
from toast.hf.evaluate.check import Applier, RemovalCheck, best_measured, check_against_plain
from toast.hf.evaluate.quality import Evaluator, quality_metric, skipped_blocks
from toast.hf.evaluate.resume import Resuming
from toast.hf.model.blocks import BlockStack
from toast.hf.model.surgery import translator_like
from toast.spans import Span

__all__ = ["MeasuredPlans", "check_translators", "measure_plans", "translated"]


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
    removed: dict[Any, Any] | None = None,
) -> list[RemovalCheck | None]:
    """Each span's translator against plain removal on ``heldout``
    (:func:`toast.hf.evaluate.check.check_against_plain`; ``removed`` keeps
    plain removal's figures across calls)."""

    def apply(where: Sequence[Span], chosen: Sequence[Any]) -> contextlib.AbstractContextManager:
        return translated(stack, where, chosen)

    with torch.no_grad():
        return check_against_plain(
            model, spans, fits, apply, heldout, fallback, removed=removed, stack=stack
        )


@dataclass(frozen=True)
class MeasuredPlans:
    """Candidate plans, each with every span replaced by its fit, measured
    on held-out batches (``metric`` over ``count`` tokens or samples): the
    held-out part of the calibration, or with ``folds`` every batch, each
    by fits of the other folds. ``chosen`` indexes the best measured (the
    first on ties)."""

    plans: list[list[Span]]
    values: list[float]
    metric: str
    count: int
    #: cross-validation folds over the calibration batches (0: one held-out part)
    folds: int = 0

    @property
    def chosen(self) -> int:
        return best_measured(self.metric, self.values)

    def lines(self) -> list[str]:
        """The report's lines: every candidate's figure, the kept one marked."""
        unit = "tokens" if self.metric == "perplexity" else "samples"
        where = (
            f"{self.folds}-fold cross-validation over the calibration batches"
            if self.folds
            else "held-out batches"
        )
        head = (
            f"Measured choice ({self.metric} on {self.count:,} {unit}, {where}, every span "
            "fitted; planned first, then the single windows of lowest predicted error):"
        )
        rows = []
        for k, (plan, value) in enumerate(zip(self.plans, self.values, strict=True)):
            where = " + ".join(f"[{s.start}:{s.stop}]" for s in plan)
            error = sum(s.error for s in plan)
            kept = " (kept)" if k == self.chosen else ""
            rows.append(f"- {where}: predicted error {error:.4g}, measured {value:.4g}{kept}")
        return ["", head, *rows]


def measure_plans(
    model: nn.Module,
    plans: Sequence[Sequence[Span]],
    fits: Sequence[Sequence[Translator | nn.Module | None]],
    apply: Applier,
    heldout: Iterable,
    evaluator: Evaluator | None = None,
    stack: BlockStack | None = None,
) -> MeasuredPlans:
    """Each plan with its spans replaced by ``fits`` (one list per plan),
    applied by ``apply`` and measured on ``heldout`` by ``evaluator``
    (default: in memory; from disk a
    :class:`~toast.hf.evaluate.from_disk.SequentialEvaluator`). Nothing in
    the model changes.

    With ``stack`` (in memory), the passes after the first resume where
    their plan first changes the model: the first pass (the original's,
    where the metric compares with it, else the first plan's) records the
    states entering those blocks (:class:`~toast.hf.evaluate.resume.PrefixStates`),
    so that no block before them runs twice on a batch."""
    if evaluator is None:
        evaluator = Evaluator(heldout, progress=False, fidelity=False)
    starts = [min(s.start for s in plan) for plan in plans]
    passes = Resuming(evaluator, stack, starts)
    if quality_metric(model, next(iter(heldout))) == "cosine":
        passes.measure(model, "original")  # the reference the cosine compares with
    values = []
    with torch.no_grad():
        for k, (plan, fitted) in enumerate(zip(plans, fits, strict=True)):
            with apply(plan, fitted):
                values.append(passes.measure(model, f"candidate {k + 1}", starts[k]))
    assert evaluator.metric is not None  # set by the first measurement
    return MeasuredPlans([list(p) for p in plans], values, evaluator.metric, evaluator.count)
