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

import warnings
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from toast.hf.evaluate.quality import Evaluator, quality_metric
from toast.hf.evaluate.resume import Resuming
from toast.hf.model.blocks import BlockStack
from toast.spans import Span

__all__ = [
    "Applier",
    "RemovalCheck",
    "CheckSplit",
    "best_candidate",
    "best_measured",
    "check_against_plain",
    "check_lines",
    "measures_better",
    "unchecked_because",
    "with_fallback",
]

#: ``apply(spans, fits)``: a context within which the model computes as if
#: each span were replaced by its fit (None: plain removal).
Applier = Callable[[Sequence[Span], Sequence[Any]], AbstractContextManager]


class CheckSplit:
    """``data`` split by batch into a fit part and a held-out part; each
    batch goes to exactly one of them, the same way on every iteration
    (re-iterable when ``data`` is; no ``len`` needed).

    With ``fraction > 0``, one batch in every ``round(1 / fraction)`` (at
    least 2; the last of each group) is held out. Data with at least two
    batches but fewer than one group hold out their last batch all the same
    (a one-batch look-ahead finds it), so that the defaults measure what
    they choose whenever the data allow: with ``check_fraction=0.1`` and 8
    batches the old rule held out none, and every measured choice fell back
    to an unmeasured prediction. A single batch of at least two sequences
    is split by sequence: its last ``max(1, n // round(1 / fraction))``
    sequences are held out. A single batch of one sequence holds nothing
    out (:func:`unchecked_because` says so and warns). ``fraction=0``
    (the papers' protocols) holds nothing out."""

    def __init__(self, data: Iterable, fraction: float) -> None:
        self.data = data
        self.every = max(2, round(1 / fraction)) if fraction > 0 else 0

    def _labelled(self) -> Iterator[tuple[bool, Any]]:
        """Every batch (or part of the only batch) with whether it is held out."""
        if self.every == 0:
            for batch in self.data:
                yield False, batch
            return
        index, pending, seen = -1, None, False
        for index, batch in enumerate(self.data):
            if seen:  # ``pending`` is not the last batch
                yield self._in_group(index - 1), pending
            pending, seen = batch, True
        if not seen:
            return
        if index == 0:
            yield from self._split_only(pending)
        elif index + 1 < self.every:  # fewer than one group: the last one
            yield True, pending
        else:
            yield self._in_group(index), pending

    def _in_group(self, index: int) -> bool:
        return index % self.every == self.every - 1

    def _split_only(self, batch: Any) -> Iterator[tuple[bool, Any]]:
        """The only batch: its last sequences held out when it has two or more."""
        n = leading_rows(batch)
        if n < 2:
            yield False, batch
            return
        held = max(1, n // self.every)
        yield False, take_rows(batch, slice(0, n - held), n)
        yield True, take_rows(batch, slice(n - held, n), n)

    def _part(self, held: bool) -> Iterator[Any]:
        for is_held, batch in self._labelled():
            if is_held == held:
                yield batch

    def has_check(self) -> bool:
        """Whether anything is held out (at least two batches, or one batch
        of at least two sequences, and ``fraction > 0``)."""
        return next(iter(self.check), None) is not None

    @property
    def fit(self) -> Iterable:
        """The batches the fit uses."""
        return _Part(self, held=False)

    @property
    def check(self) -> Iterable:
        """The held-out batches."""
        return _Part(self, held=True)


def leading_rows(batch: Any) -> int:
    """The number of sequences (samples) of ``batch``: the leading dimension
    of its first tensor or array (0 when it has none)."""
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return int(batch.shape[0]) if batch.ndim > 0 else 0
    if isinstance(batch, Mapping):
        values = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        values = list(batch)
    else:
        return 0
    for value in values:
        n = leading_rows(value)
        if n:
            return n
    return 0


def take_rows(batch: Any, part: slice, n: int) -> Any:
    """``batch`` with only the rows ``part`` of each tensor or array whose
    leading dimension is ``n`` (the batch's); everything else as it is."""
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return batch[part] if batch.ndim > 0 and batch.shape[0] == n else batch
    if isinstance(batch, Mapping):
        items = {k: take_rows(v, part, n) for k, v in batch.items()}
        try:  # the batch's own mapping type (a BatchEncoding) where it rebuilds so
            kind: Any = type(batch)
            return kind(items)
        except TypeError:
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(take_rows(v, part, n) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(take_rows(v, part, n) for v in batch)
    return batch


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
        better = measures_better(self.metric, self.fitted, self.plain)
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
    removed: dict[Any, Any] | None = None,
    stack: BlockStack | None = None,
) -> list[RemovalCheck | None]:
    """Each span's fit against plain removal on ``heldout``, the other spans
    as decided so far (none with ``alone``: candidates that may overlap);
    with ``fallback`` a span whose fit measures worse is removed plainly.
    One entry per span (None: no fit to check). Nothing in the model
    changes. ``evaluator`` measures ``model`` on ``heldout`` (default an
    in-memory :class:`~toast.hf.evaluate.quality.Evaluator`; from disk a
    :class:`~toast.hf.evaluate.from_disk.SequentialEvaluator`, ``model`` its
    checkpoint's skeleton and ``apply`` setting its edits). ``removed``
    keeps what plain removal of spans measured on ``heldout`` (the other
    spans kept), across calls on the same model: a caller checking several
    fits of the same cuts measures their plain removal once. With ``stack``
    (in memory) the passes after the first resume at the block before
    their first span (a fit may sit on that block's output, as ReplaceMe's
    transform does), past the blocks every pass shares
    (:class:`~toast.hf.evaluate.resume.Resuming`)."""
    if evaluator is None:  # one figure compared: perplexity without a report's fidelity
        evaluator = Evaluator(heldout, progress=False, fidelity=False)

    def changes(where: Sequence[Span]) -> int:
        return max(min(s.start for s in where) - 1, 0)

    passes = Resuming(evaluator, stack, [changes([s] if alone else spans) for s in spans])
    first = next(iter(heldout))
    if quality_metric(model, first) == "cosine":
        passes.measure(model, "original")  # the reference the cosine compares with
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
            fitted = passes.measure(model, "fitted", changes(where))
        key = _removal_key(heldout, where) if all(t is None for t in plain_t) else None
        if removed is not None and key in removed:
            plain = removed[key][1]
        else:
            with apply(where, plain_t):
                plain = passes.measure(model, "plain removal", changes(where))
            if removed is not None and key is not None:
                removed[key] = (heldout, plain)  # the data kept: an id is not reused meanwhile
        assert evaluator.metric is not None  # set by the first measurement
        better = measures_better(evaluator.metric, fitted, plain)
        used = "fitted" if better or not fallback else "plain removal"
        if used == "plain removal":
            current[k] = None
        checks.append(RemovalCheck(span, evaluator.metric, fitted, plain, evaluator.count, used))
    return checks


def _removal_key(heldout: Iterable, spans: Sequence[Span]) -> Hashable:
    """What identifies a plain-removal measurement: the held-out data (a
    split's part compares equal on every access; other data by identity)
    and the spans removed."""
    data: Hashable = heldout if isinstance(heldout, Hashable) else id(heldout)
    return (data, tuple((s.start, s.stop) for s in spans))


def with_fallback(fits: Sequence[Any], checks: Sequence[RemovalCheck | None], plain: Any) -> list:
    """``fits`` with ``plain`` (what stands for plain removal) in place of
    each fit whose check gave the model plain removal."""
    return [
        fit if check is None or check.used == "fitted" else plain
        for fit, check in zip(fits, checks, strict=True)
    ]


def measures_better(metric: str, a: float, b: float) -> bool:
    """Whether ``a`` measures at least as well as ``b`` (perplexity: lower)."""
    return a <= b if metric == "perplexity" else a >= b


def best_measured(metric: str, values: Sequence[float]) -> int:
    """The index of the best of ``values`` in ``metric``; the first on ties."""
    best = 0
    for k, value in enumerate(values):
        if not measures_better(metric, values[best], value):
            best = k
    return best


def best_candidate(checks: Sequence[RemovalCheck]) -> int:
    """The index of the candidate cut whose model (what each check says it
    gets) measured best on the held-out batches; the first on ties."""
    return best_measured(checks[0].metric, [c.result for c in checks]) if checks else 0


def unchecked_because(split: CheckSplit, sequential: bool) -> str:
    """Why fits are not checked on held-out batches ("" when they are);
    warns when the data are too few to hold anything out (one batch of one
    sequence), since every measured choice then falls back to a prediction."""
    if sequential:
        return "none (sequential fits are not checked; every batch fits)"
    if split.every == 0:
        return "none (check_fraction=0: every batch fits, as in the paper)"
    if not split.has_check():
        why = (
            "none (one calibration batch of fewer than 2 sequences: nothing to hold out; "
            "give at least 2 batches or sequences)"
        )
        warnings.warn(
            f"held-out check: {why.removeprefix('none (').removesuffix(')')}; the fits and "
            "choices that measure on held-out batches fall back to unmeasured predictions",
            stacklevel=3,
        )
        return why
    return ""


def check_lines(checks: Sequence[RemovalCheck | None], note: str) -> list[str]:
    """The report's lines on the held-out checks (or why there are none)."""
    done = [c for c in checks if c is not None]
    if not done:
        return [f"Held-out check: {note}."] if note else []
    return ["", "Held-out check against plain removal:", *(f"- {c.to_markdown()}" for c in done)]
