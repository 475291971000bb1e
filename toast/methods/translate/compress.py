"""``toast.compress(..., method="toast")``: analyse, plan, fit and patch."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from torch import nn

from toast.core import Moments, Translator
from toast.core.chunked import ChunkedMoments
from toast.hf.capture.massive import MassiveRows
from toast.hf.capture.states import capture_moments
from toast.hf.evaluate.check import CheckSplit, RemovalCheck, unchecked_because
from toast.hf.model.blocks import BlockStack, find_blocks
from toast.hf.model.params import count_params
from toast.hf.model.surgery import replace_spans
from toast.methods.base import BeforeSurgery, Method, register
from toast.methods.pipeline import deferred
from toast.methods.span_plans import inner_windows
from toast.methods.translate.analysis import Analysis, analyze
from toast.methods.translate.check import check_translators
from toast.methods.translate.config import CLOSED_FORM, ToastConfig
from toast.methods.translate.fitting import Fitter, records_massive_rows
from toast.methods.translate.memory import within_memory
from toast.methods.translate.report import CompressionReport
from toast.methods.translate.stages import STAGES
from toast.spans import Span, validate_spans

__all__ = ["METHOD", "choose_spans", "compress_toast", "refit_kept", "refit_options"]


def compress_toast(
    model: nn.Module,
    data: Iterable,
    config: ToastConfig,
    before_surgery: BeforeSurgery | None = None,
) -> tuple[nn.Module, CompressionReport]:
    """Replaces redundant spans of ``model``'s blocks by translators, in place.

    One pass over ``data`` gives the moments and the error matrix; the
    spans come from ``config.spans`` or :meth:`Analysis.plan`; each gets a
    translator (see :class:`ToastConfig`) and the model is patched.
    """
    stack = find_blocks(model, config.calibration.blocks)
    sequential = config.fit == "sequential"
    split = CheckSplit(data, 0.0 if sequential else config.check_fraction)  # nothing to check
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        analysis = _analyze(model, split.fit, config, stack)
    issued = {str(w.message): w.message for w in caught}
    for message in issued.values():  # each once, as the analysis issued it
        warnings.warn(message, stacklevel=2)
    spans = choose_spans(analysis, config)
    if before_surgery is not None:
        before_surgery(spans, stack)
    blocks_before, params_before = stack.num_blocks, count_params(model)
    fitter = Fitter(config)
    note = unchecked_because(split, sequential)
    checks: list[RemovalCheck | None] = []
    refitted = False
    if config.fit == "independent":
        modules = fitter.fit_all(model, split.fit, spans, analysis, stack)
        if not note:
            modules, checks = _checked(model, stack, spans, modules, split, config, analysis)

            def capture(states: list[int], observe: MassiveRows | None) -> Any:
                options = refit_options(config, states, observe)
                return capture_moments(
                    model, split.check, backend=config.backend, stack=stack, **options
                )[0]

            modules, refitted = refit_kept(fitter, spans, modules, checks, analysis, capture)
        replace_spans(model, [(s.start, s.stop) for s in spans], modules, blocks=stack)
    else:
        _fit_sequentially(model, data, spans, fitter, stack)
    fitter.warn_ill_conditioned(already=set(issued))
    report = CompressionReport(
        method="toast",
        translator=config.translator,
        spans=spans,
        conditions=fitter.conditions,
        ranks=fitter.ranks,
        width=analysis.moments.dim,
        blocks_before=blocks_before,
        blocks_after=blocks_before - sum(s.num_blocks for s in spans) + len(spans),
        params_before=params_before,
        params_after=count_params(model),
        rows=analysis.rows,
        analysis=analysis,
        fit=config.fit,
        checks=checks,
        check_note=note,
        refitted=refitted,
    )
    return model, report


def _checked(
    model: nn.Module,
    stack: BlockStack,
    spans: list[Span],
    modules: list,
    split: CheckSplit,
    config: ToastConfig,
    analysis: Analysis,
) -> tuple[list, list[RemovalCheck | None]]:
    """The translators measured against plain removal on the held-out
    batches; with ``fallback`` one that lost becomes the identity."""
    checks = check_translators(model, stack, spans, modules, split.check, config.fallback)
    d = analysis.moments.dim
    identity = Translator("identity", np.eye(d), np.zeros(d), 1.0, d, "identity")
    kept = [
        m if c is None or c.used == "fitted" else identity
        for m, c in zip(modules, checks, strict=True)
    ]
    return kept, checks


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


def refit_options(
    config: ToastConfig, states: list[int], observe: MassiveRows | None
) -> dict[str, Any]:
    """The options of the held-out batches' capture at ``states`` that
    :func:`refit_kept` fits again from, in memory or from disk
    (:func:`capture_moments`, :func:`capture_moments_from_disk`)."""
    return {
        "states": states,
        "tokens": config.tokens,
        "folds": 0,
        "calibration": config.calibration,
        "observe": observe,
        "statistics_bytes": config.statistics_bytes,
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


def _analyze(model: nn.Module, data: Iterable, config: ToastConfig, stack: BlockStack) -> Analysis:
    return analyze(model, data, backend=config.backend, stack=stack, **analysis_options(config))


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


def _fit_sequentially(
    model: nn.Module, data: Iterable, spans: list[Span], fitter: Fitter, stack: BlockStack
) -> None:
    # Each replacement shortens the block list: rediscover it after each patch.
    removed = 0
    for span in spans:
        where = (span.start - removed, span.stop - removed)
        module = fitter.fit_one_on(model, data, where, stack)
        replace_spans(model, [where], [module], blocks=stack)
        stack = find_blocks(model, stack)  # looked up by its path, not searched for
        removed += span.num_blocks - 1


def _run(
    model: nn.Module,
    data: Iterable | None,
    config: ToastConfig,
    before_surgery: BeforeSurgery | None = None,
):
    assert data is not None  # the runner refuses None for a method that needs data
    return compress_toast(model, data, config, before_surgery)


METHOD = register(
    Method(
        name="toast",
        config=ToastConfig,
        run=_run,
        summary="replace redundant spans of blocks by closed-form or trained translators",
        stages=STAGES,
        # from_disk builds on this module: imported when a folder goes block by block
        run_from_disk=deferred("toast.methods.translate.from_disk", "compress_from_disk"),
        within_memory=within_memory,
    )
)
