"""TOAST's own rules, beside its search stages: which spans a config asks
for (:func:`choose_spans`), the analysis it runs (:func:`analysis_options`),
the check of each fitted translator against plain removal on held-out
calibration batches (:func:`checked`) and the refit of the kept ones on
every batch (:func:`refit_kept`). ``toast.compress`` applies them through
the configured stages (:mod:`toast.methods.translate.configured`), in
memory and from disk alike."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch import nn

from toast.core import Moments, Translator
from toast.core.chunked import ChunkedMoments, PairMoments, pair_nbytes, resolve_bound
from toast.hf.capture.massive import MassiveRows
from toast.hf.evaluate.check import RemovalCheck, with_fallback
from toast.hf.model.blocks import BlockStack, find_blocks
from toast.hf.model.surgery import replace_spans
from toast.methods.span_plans import inner_windows
from toast.methods.translate.analysis import Analysis
from toast.methods.translate.check import MeasuredPlans
from toast.methods.translate.config import CLOSED_FORM, ToastConfig
from toast.methods.translate.fitting import Fitter, records_massive_rows
from toast.spans import Span, validate_spans

__all__ = [
    "analysis_options",
    "CHOICE_FOLDS",
    "BatchFold",
    "Capture",
    "Measure",
    "candidate_plans",
    "Check",
    "Checked",
    "checked",
    "FoldGroups",
    "fold_groups",
    "cross_validated",
    "choose_spans",
    "fit_sequentially",
    "identity",
    "refit_kept",
    "refits_checked",
    "refit_options",
]


def identity(d: int) -> Translator:
    """What stands for plain removal among translators."""
    return Translator("identity", np.eye(d), np.zeros(d), 1.0, d, "identity")


#: ``check(fits, fallback)``: each fit measured against plain removal of its
#: span on the held-out batches (None where unmeasured), in memory or from disk.
Check = Callable[[list, bool], list[RemovalCheck | None]]


@dataclass
class Checked:
    """The translators a check against plain removal left (:func:`checked`)."""

    fits: list
    checks: list[RemovalCheck | None]
    #: whether a kept fit was fitted again on every batch (:func:`refit_kept`)
    refitted: bool = False
    #: spans whose refit then measured worse than plain removal: removed plainly
    refit_fallbacks: list[Span] = field(default_factory=list)


def checked(
    fitter: Fitter,
    spans: list[Span],
    fits: list,
    analysis: Analysis,
    check: Check,
    capture: Callable[[list[int], MassiveRows | None], Moments | ChunkedMoments],
) -> Checked:
    """``fits`` checked against plain removal on the held-out batches (with
    ``fallback``, one that lost becomes the identity), the kept ones fitted
    again on every batch (:func:`refit_kept`, ``capture`` forming the
    held-out moments) and, with ``fallback``, checked once more
    (:func:`refits_checked`); ``check`` keeps plain removal's figures from
    the first check for the second, in memory and from disk alike."""
    config = fitter.config
    plain = identity(analysis.moments.dim)
    checks = check(fits, config.fallback)
    fits = with_fallback(fits, checks, plain)
    fits, refitted = refit_kept(fitter, spans, fits, checks, analysis, capture)
    fallbacks: list[Span] = []
    if refitted and config.fallback:
        fits, fallbacks = refits_checked(fits, check(fits, True), checks, plain)
    return Checked(fits, checks, refitted, fallbacks)


def refit_kept(
    fitter: Fitter,
    spans: list[Span],
    fits: list,
    checks: list[RemovalCheck | None],
    analysis: Analysis,
    capture: Callable[[list[int], MassiveRows | None], Moments | ChunkedMoments],
) -> tuple[list, bool]:
    """``fits`` with each closed-form translator the check kept fitted again
    on every calibration batch, the held-out ones too (``config.refit``):
    the check measured a fit that had not seen them, and the model keeps one
    that has. ``capture(states, observe)`` forms the moments of the held-out
    batches at ``states``, in memory or from disk; the analysis's moments
    hold the rest. Whether any was refitted comes with them."""
    config = fitter.config
    kept = [k for k, c in enumerate(checks) if c is not None and c.used == "fitted"]
    if not config.refit or config.translator not in CLOSED_FORM or not kept:
        return fits, False
    chosen = [spans[k] for k in kept]
    states = sorted({x for s in chosen for x in (s.start, s.stop)})
    recorder = MassiveRows() if analysis.massive is not None else None
    more = capture(states, recorder)
    again = Fitter(config)
    with warnings.catch_warnings():
        # the first fits of the same spans said it already
        warnings.simplefilter("ignore")
        refits = again.closed_forms_with(chosen, analysis, more, states, recorder)
    out = list(fits)
    for n, k in enumerate(kept):
        out[k] = refits[n]
        fitter.conditions[k], fitter.ranks[k] = again.conditions[n], again.ranks[n]
    return out, True


def refits_checked(
    fits: list, rechecks: list[RemovalCheck | None], checks: list[RemovalCheck | None], plain: Any
) -> tuple[list, list[Span]]:
    """``fits`` with ``plain`` in place of each refit (a fit the check kept,
    fitted again on every batch) that then measured worse than plain
    removal on the held-out batches (``rechecks``: those batches are now
    part of its fit, so this only catches a refit that moved the wrong
    way); the spans that fell back so."""
    out, fell = list(fits), []
    for k, (check, again) in enumerate(zip(checks, rechecks, strict=True)):
        if check is not None and check.used == "fitted" and again is not None:
            if again.used != "fitted":
                out[k] = plain
                fell.append(again.span)
    return out, fell


def refit_options(
    config: ToastConfig,
    states: list[int],
    observe: MassiveRows | None,
    statistics_bytes: int | str | None = None,
) -> dict[str, Any]:
    """The options of the held-out batches' capture at ``states`` that
    :func:`refit_kept` fits again from, in memory or from disk
    (:func:`capture_moments`, :func:`capture_moments_from_disk`);
    ``statistics_bytes`` the bound in memory where not the config's (a
    measured choice's, :func:`room_beside`)."""
    if statistics_bytes is None:
        statistics_bytes = config.statistics_bytes
    return {
        "states": states,
        "tokens": config.tokens,
        "folds": 0,
        "calibration": config.calibration,
        "observe": observe,
        "statistics_bytes": statistics_bytes,
    }


def analysis_options(config: ToastConfig) -> dict[str, Any]:
    """The options of ``config`` that the analysis takes, in memory or from
    disk (:func:`analyze`, :func:`analyze_from_disk`)."""
    return {
        "metric": config.metric,
        "estimator": config.estimator,
        "folds": config.folds,
        "ridge": config.ridge or 0.0,
        "tokens": config.tokens,
        "pairs": config.pairs,
        "calibration": config.calibration,
        "massive_rows": records_massive_rows(config),
        "statistics_bytes": config.statistics_bytes,
    }


def choose_spans(analysis: Analysis, config: ToastConfig) -> list[Span]:
    """The spans ``config`` asks for: given, or planned from the analysis by
    ``num_blocks`` or ``max_error``."""
    count = config.num_blocks
    if count is not None and not 1 <= count < analysis.num_blocks:
        raise ValueError(
            f"num_blocks={count} must be between 1 and {analysis.num_blocks - 1}: the model has "
            f"{analysis.num_blocks} blocks and keeps at least one"
        )
    if config.spans is not None:
        chosen = validate_spans(config.spans, analysis.num_blocks)
        return [Span(a, b, float(analysis.errors[a, b])) for a, b in chosen]
    if config.single_window:
        assert count is not None  # the config checks it
        windows = inner_windows(analysis.errors, count, 0 if config.include_first_block else 1)
        if not windows:
            raise ValueError(
                f"no window of {count} blocks starts at block 1 and ends before the last of "
                f"{analysis.num_blocks} (single_window=True)"
            )
        a, b = windows[0]
        return [Span(a, b, float(analysis.errors[a, b]))]
    spans = analysis.plan(
        max_blocks=count,
        max_error=config.max_error,
        include_first_block=config.include_first_block,
    )
    if not spans:
        raise ValueError(
            "no span satisfies the constraints (max_error too small?); inspect "
            "toast.analyze(...).errors"
        )
    return spans


def candidate_plans(analysis: Analysis, config: ToastConfig) -> list[list[Span]]:
    """The plans a measured choice compares (``config.candidates`` of them
    at most): the config's own (:func:`choose_spans`), then the single
    windows removing as many blocks, lowest predicted error first (the
    earlier on ties), in the range the config plans in (from block 1, or 0
    with ``include_first_block``; with ``single_window``, ending before the
    last block; each within ``max_error``). Given ``spans`` are the only
    candidate."""
    first = choose_spans(analysis, config)
    if config.spans is not None or config.num_blocks is None or config.candidates < 2:
        return [first]
    count = sum(s.num_blocks for s in first)
    table = analysis.errors
    start = 0 if config.include_first_block else 1
    if config.single_window:
        windows = inner_windows(table, count, start)
    else:
        last = table.shape[0] - 1  # states 0..L: a window may end at the last
        windows = [(a, a + count) for a in range(start, last - count + 1)]
        windows = [w for w in windows if np.isfinite(table[w])]
        windows.sort(key=lambda w: (float(table[w]), w[0]))
    if config.max_error is not None:
        windows = [w for w in windows if table[w] <= config.max_error]
    plans = [first]
    seen = {tuple((s.start, s.stop) for s in first)}
    for a, b in windows:
        if len(plans) == config.candidates:
            break
        if ((a, b),) not in seen:
            seen.add(((a, b),))
            plans.append([Span(a, b, float(table[a, b]))])
    return plans


#: Folds of the measured choice's cross-validation over calibration batches:
#: every batch is measured once, by fits of the others (one held-out batch
#: of 4 sequences ranked SmolLM2's windows at 6 blocks against the selection
#: and test splits; four folds of all 8 ranked them as those do:
#: ``benchmarks/results/windows.md``).
CHOICE_FOLDS = 4


@dataclass(frozen=True)
class BatchFold:
    """The batches of ``data`` in fold ``k`` of ``folds`` (every
    ``folds``-th batch from the ``k``-th; ``held``) or in the others (not
    ``held``), the same on every iteration."""

    data: Iterable
    folds: int
    k: int
    held: bool

    def __iter__(self) -> Iterator[Any]:
        for index, batch in enumerate(self.data):
            if (index % self.folds == self.k) == self.held:
                yield batch


#: ``capture(batches, states, observe, bound)``: the moments of ``batches`` at
#: ``states`` (their massive rows into ``observe``), in memory up to ``bound``
#: bytes (else rows on disk)
Capture = Callable[[Iterable, list[int], MassiveRows | None, int], "Moments | ChunkedMoments"]
Measure = Callable[[list[list[Span]], list[list[Translator]], Iterable], MeasuredPlans]


def cross_validated(
    plans: list[list[Span]],
    config: ToastConfig,
    analysis: Analysis,
    data: Iterable,
    capture: Capture,
    measure: Measure,
) -> MeasuredPlans | None:
    """Each plan measured by cross-validation over the batches of ``data``
    (:data:`CHOICE_FOLDS` folds, fewer with fewer batches): for each fold,
    every plan's closed-form fits from the moments of the other folds'
    batches (``capture(batches, states, observe)``, in memory or from disk;
    each fold's batches captured once and the others' summed where every
    fold's moments fit the statistics bound beside the analysis's,
    :func:`fold_groups`)
    measured on the fold's (``measure(plans, fits, batches)``); the figures
    pooled over every measured token (perplexity) or sample (cosine). None
    with fewer than two batches."""
    count = sum(1 for _ in data)
    if count < 2:
        return None
    folds = min(CHOICE_FOLDS, count)
    states = sorted({x for plan in plans for s in plan for x in (s.start, s.stop)})
    observed = analysis.massive is not None
    bound = room_beside(config, analysis, plans, states)
    groups = None
    if _groups_fit(config, analysis, len(states), folds, bound):
        groups = fold_groups(data, folds, states, capture, observed, bound)
    totals = np.zeros(len(plans))
    measured = 0
    metric = ""
    for k in range(folds):
        moments: Moments | ChunkedMoments
        if groups is not None:
            moments, recorder = groups.training(k)
        else:
            recorder = MassiveRows() if observed else None
            moments = capture(BatchFold(data, folds, k, held=False), states, recorder, bound)
        fitter = Fitter(config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the kept plan's fits say it, once, in apply
            fits = [fitter.closed_forms_at(plan, moments, states, recorder) for plan in plans]
        del moments
        fold = measure(plans, fits, BatchFold(data, folds, k, held=True))
        values = np.asarray(fold.values, dtype=np.float64)
        totals += fold.count * (np.log(values) if fold.metric == "perplexity" else values)
        measured += fold.count
        metric = fold.metric
    pooled = totals / measured
    if metric == "perplexity":
        pooled = np.exp(pooled)
    return MeasuredPlans(plans, [float(v) for v in pooled], metric, measured, folds)


@dataclass
class FoldGroups:
    """The moments (and massive rows) of each fold's batches alone, from
    which every fold's training set is summed (:meth:`training`): one
    forward per batch where capturing each training set makes ``folds - 1``."""

    moments: list[Moments]
    rows: list[MassiveRows | None]

    def training(self, k: int) -> tuple[Moments, MassiveRows | None]:
        """The moments and massive rows of every fold's batches but fold ``k``'s."""
        others = [j for j in range(len(self.moments)) if j != k]
        first = self.moments[others[0]]
        mixed = first.precision == "mixed"
        total = Moments(
            first.num_states,
            first.dim,
            pairs=first.pairs,
            precision="mixed" if mixed else "float64",
        )
        for j in others:
            total.merge(self.moments[j])
        rows = self.rows[others[0]]
        for j in others[1:]:
            more = self.rows[j]
            rows = more if rows is None else rows if more is None else rows.joined(more)
        return total, rows


def room_beside(
    config: ToastConfig, analysis: Analysis, plans: list[list[Span]], states: list[int]
) -> int:
    """The bytes each capture of a measured choice among ``plans`` (at
    ``states``, their spans' ends) may hold beside the analysis's moments:
    ``config.statistics_bytes`` (which a memory plan lowers to its room)
    less what those hold. Where the
    analysis's whole moments and one capture at the candidates' states
    would not fit it together, the analysis keeps only the pairs of states
    the candidates' fits read (:meth:`PairMoments.from_moments`: the same
    fits), so that the bound holds for the whole run."""
    moments = analysis.moments
    bound = resolve_bound(config.statistics_bytes, moments.dim, 0)
    if type(moments) is Moments:
        if moments.nbytes + Moments.estimate_nbytes(len(states), moments.dim) > bound:
            spans = {(s.start, s.stop) for plan in plans for s in plan}
            analysis.moments = PairMoments.from_moments(moments, spans)
    # rows on disk hold no memory beside the capture
    held = 0 if isinstance(analysis.moments, ChunkedMoments) else analysis.moments.nbytes
    return max(bound - held, pair_nbytes(moments.dim, 0))


def _groups_fit(
    config: ToastConfig, analysis: Analysis, num_states: int, folds: int, bound: int
) -> bool:
    """Whether every fold's moments and one training sum fit ``bound``, the
    room beside the analysis's moments (:func:`room_beside`; else each
    training set is captured whole, one at a time); never under
    ``torch.distributed``, whose ranks shard each pass's batches, so that a
    fold of few batches may leave a rank none, nor beside rows on disk."""
    if config.calibration.is_distributed or isinstance(analysis.moments, ChunkedMoments):
        return False
    return (folds + 1) * Moments.estimate_nbytes(num_states, analysis.moments.dim) <= bound


def fold_groups(
    data: Iterable, folds: int, states: list[int], capture: Capture, observed: bool, bound: int
) -> FoldGroups | None:
    """Each fold's batches captured alone at ``states`` (``observed``: with
    their massive rows); None if a capture came back as anything but
    in-memory :class:`~toast.core.Moments`."""
    moments: list[Moments] = []
    rows: list[MassiveRows | None] = []
    for k in range(folds):
        recorder = MassiveRows() if observed else None
        with warnings.catch_warnings():
            # a fold alone has a quarter of the rows: its sums warn of few rows
            # for the width, the training sets they add up to do not
            warnings.simplefilter("ignore")
            found = capture(BatchFold(data, folds, k, held=True), states, recorder, bound)
        if type(found) is not Moments:
            return None
        moments.append(found)
        rows.append(recorder)
    return FoldGroups(moments, rows)


def fit_sequentially(
    model: nn.Module, data: Iterable, spans: list[Span], fitter: Fitter, stack: BlockStack
) -> None:
    """Each span replaced in turn by a translator fitted on the states of
    the model patched so far (``fit="sequential"``), in place."""
    # Each replacement shortens the block list: rediscover it after each patch.
    removed = 0
    for span in spans:
        where = (span.start - removed, span.stop - removed)
        module = fitter.fit_one_on(model, data, where, stack)
        replace_spans(model, [where], [module], blocks=stack)
        stack = find_blocks(model, stack)  # looked up by its path, not searched for
        removed += span.num_blocks - 1
