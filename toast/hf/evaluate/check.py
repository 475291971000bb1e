"""Held-out checks shared by the methods that fit: calibration batches
split into a fit part and a held-out part, and each fitted replacement of a
span measured there against plain removal of the same blocks.

A fit can lose to plain removal: a least-squares fit of a cut that removes
the block creating a massive activation (an attention sink's hidden-state
norm jumps ~100-fold) follows the few rows that carry it, and every other
token pays. Held-out batches measure what a calibration objective cannot:
the model's own quality (perplexity for a causal LM, else the mean cosine
of its outputs to the original's, see :class:`toast.hf.evaluate.quality.Evaluator`),
with the fit applied by hooks, before anything in the model changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from torch import nn

from toast.hf.evaluate.quality import Evaluator, quality_metric
from toast.spans import Span

__all__ = [
    "Applier",
    "RemovalCheck",
    "CheckSplit",
    "best_candidate",
    "check_against_plain",
    "check_lines",
    "unchecked_because",
    "with_fallback",
]

#: ``apply(spans, fits)``: a context within which the model computes as if
#: each span were replaced by its fit (None: plain removal).
Applier = Callable[[Sequence[Span], Sequence[Any]], AbstractContextManager]


class CheckSplit:
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
    split: CheckSplit
    held: bool

    def __iter__(self) -> Iterator[Any]:
        return self.split._part(self.held)


@dataclass(frozen=True)
class RemovalCheck:
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


def check_against_plain(
    model: nn.Module,
    spans: Sequence[Span],
    fits: Sequence[Any],
    apply: Applier,
    heldout: Iterable,
    fallback: bool,
    alone: bool = False,
    evaluator: Evaluator | None = None,
) -> list[RemovalCheck | None]:
    """Each span's fit against plain removal on ``heldout``, the other spans
    as decided so far (none with ``alone``: candidates that may overlap);
    with ``fallback`` a span whose fit measures worse is removed plainly.
    One entry per span (None: no fit to check). Nothing in the model
    changes. ``evaluator`` measures ``model`` on ``heldout`` (default an
    in-memory :class:`~toast.hf.evaluate.quality.Evaluator`; from disk a
    :class:`~toast.hf.evaluate.from_disk.SequentialEvaluator`, ``model`` its
    checkpoint's skeleton and ``apply`` setting its edits)."""
    evaluator = Evaluator(heldout, progress=False) if evaluator is None else evaluator
    first = next(iter(heldout))
    if quality_metric(model, first) == "cosine":
        evaluator.measure(model, "original")  # the reference the cosine compares with
    current = list(fits)
    checks: list[RemovalCheck | None] = []
    for k, span in enumerate(spans):
        if current[k] is None:
            checks.append(None)
            continue
        where: Sequence[Span] = spans
        fitted_t, plain_t = current, [t if j != k else None for j, t in enumerate(current)]
        if alone:
            where, fitted_t, plain_t = [span], [current[k]], [None]
        with apply(where, fitted_t):
            fitted = evaluator.measure(model, "fitted")
        with apply(where, plain_t):
            removed = evaluator.measure(model, "plain removal")
        assert evaluator.metric is not None  # set by the first measurement
        better = _better(evaluator.metric, fitted, removed)
        used = "fitted" if better or not fallback else "plain removal"
        if used == "plain removal":
            current[k] = None
        checks.append(RemovalCheck(span, evaluator.metric, fitted, removed, evaluator.count, used))
    return checks


def with_fallback(fits: Sequence[Any], checks: Sequence[RemovalCheck | None], plain: Any) -> list:
    """``fits`` with ``plain`` (what stands for plain removal) in place of
    each fit whose check gave the model plain removal."""
    return [
        fit if check is None or check.used == "fitted" else plain
        for fit, check in zip(fits, checks, strict=True)
    ]


def _better(metric: str, a: float, b: float) -> bool:
    """Whether ``a`` measures at least as well as ``b`` (perplexity: lower)."""
    return a <= b if metric == "perplexity" else a >= b


def best_candidate(checks: Sequence[RemovalCheck]) -> int:
    """The index of the candidate cut whose model (what each check says it
    gets) measured best on the held-out batches; the first on ties."""
    best = 0
    for k, c in enumerate(checks):
        if not _better(c.metric, checks[best].result, c.result):
            best = k
    return best


def unchecked_because(split: CheckSplit, sequential: bool) -> str:
    """Why fits are not checked on held-out batches ("" when they are)."""
    if sequential:
        return "none (sequential fits are not checked; every batch fits)"
    if split.every == 0:
        return "none (check_fraction=0: every batch fits, as in the paper)"
    if not split.has_check():
        return f"none (fewer than {split.every} calibration batches to hold one out)"
    return ""


def check_lines(checks: Sequence[RemovalCheck | None], note: str) -> list[str]:
    """The report's lines on the held-out checks (or why there are none)."""
    done = [c for c in checks if c is not None]
    if not done:
        return [f"Held-out check: {note}."] if note else []
    return ["", "Held-out check against plain removal:", *(f"- {c.to_markdown()}" for c in done)]
