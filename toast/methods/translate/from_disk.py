"""TOAST on a checkpoint on disk: the analysis block by block, closed-form
translators from its moments, and the patched model saved in toast's
format without ever loading the model (for models bigger than memory).

The moments are those of the in-memory pass
(:func:`toast.methods.translate.analyze_from_disk`), so the plan and the
translators are too; :func:`toast.io.from_disk.save_translated_from_disk`
writes what :func:`toast.save_pretrained` writes for the patched model.
The held-out check against plain removal and the ``heldout=`` quality are
measured block by block (:class:`toast.hf.evaluate.from_disk.SequentialEvaluator`),
each translator standing in for its span as the blocks load.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from toast.core import Translator
from toast.hf.capture.disk_moments import capture_moments_from_disk
from toast.hf.capture.massive import MassiveRows
from toast.hf.capture.sequential import BlockEdits, DiskModel
from toast.hf.data.text import as_batches
from toast.hf.evaluate.check import (
    CheckSplit,
    RemovalCheck,
    check_against_plain,
    unchecked_because,
    with_fallback,
)
from toast.hf.evaluate.from_disk import SequentialEvaluator, measure_from_disk, removal, replaced
from toast.io.from_disk import save_translated_from_disk
from toast.methods.base import make_config
from toast.methods.runner import split_heldout, split_text_options
from toast.methods.translate.analysis import Analysis, analyze_from_disk
from toast.methods.translate.compress import (
    METHOD,
    analysis_options,
    choose_spans,
    refit_kept,
    refit_options,
)
from toast.methods.translate.config import CLOSED_FORM, ToastConfig
from toast.methods.translate.fitting import Fitter
from toast.methods.translate.report import CompressionReport
from toast.spans import Span
from toast.translators.block import translator_module

__all__ = ["compress_from_disk", "translated_edits"]


def compress_from_disk(
    folder: str | os.PathLike | DiskModel,
    data: Iterable | Any,
    output: str | os.PathLike,
    config: ToastConfig | None = None,
    *,
    buffer_dir: str | os.PathLike | None = None,
    heldout: Iterable | float | None = None,
    **params: Any,
) -> CompressionReport:
    """``toast.compress(model, data, method="toast", ...)`` followed by
    :func:`toast.save_pretrained` to ``output``, for the checkpoint in
    ``folder``, without loading the model. Closed-form translators
    (``"linear"``, ``"affine"``, ``"diagonal"``...) with ``fit="independent"``
    only: trained translators need the rows, sequential fits the patched
    model. With ``check_fraction``, each translator is measured against plain
    removal on held-out calibration batches, as in memory; ``heldout``
    data (or a fraction of raw text ``data``) adds the measured quality of
    the original, plain removal and the patched model to the report.
    ``buffer_dir`` holds the states while the blocks run (a temporary
    directory, removed on every exit)."""
    text, params = split_text_options(params)
    if config is None:
        config = make_config(METHOD, params)
    elif params:
        raise TypeError("give the options as config=... or as keywords, not both")
    if config.translator not in CLOSED_FORM or config.fit != "independent":
        raise ValueError(
            "compress_from_disk fits closed-form translators (translator in "
            f"{sorted(CLOSED_FORM)}) with fit='independent'; got translator="
            f"{config.translator!r}, fit={config.fit!r}"
        )
    data = as_batches(data, **text)
    measured: Iterable | None = None  # the held-out batches
    if isinstance(heldout, float):
        data, measured = split_heldout(data, heldout)
    elif heldout is not None:
        measured = as_batches(heldout, **text)
    disk = DiskModel.open(folder, config.calibration.blocks, config.calibration.compute_dtype)
    split = CheckSplit(data, config.check_fraction)
    analysis = _analyze(disk, split.fit, config, buffer_dir)
    spans = choose_spans(analysis, config)
    fitter = Fitter(config)
    translators: list[Translator] = fitter.closed_forms(spans, analysis)
    note = unchecked_because(split, sequential=False)
    checks: list[RemovalCheck | None] = []
    refitted = False
    if not note:
        checks = _check(disk, spans, translators, split.check, config, buffer_dir)
        translators = with_fallback(translators, checks, _identity(analysis.moments.dim))

        def capture(states: list[int], observe: MassiveRows | None) -> Any:
            options = refit_options(config, states, observe)
            return capture_moments_from_disk(disk, split.check, buffer_dir=buffer_dir, **options)[0]

        translators, refitted = refit_kept(fitter, spans, translators, checks, analysis, capture)
    fitter.warn_ill_conditioned()
    report = _report(disk, config, spans, fitter, analysis, translators, checks, note)
    report.refitted = refitted
    if measured is not None:
        report.quality = measure_from_disk(
            disk,
            measured,
            removal(spans),
            translated_edits(disk, spans, translators),
            progress=config.calibration.progress,
            buffer_dir=buffer_dir,
        )
    pairs = [(s.start, s.stop) for s in spans]
    save_translated_from_disk(disk, output, pairs, translators, report.to_markdown())
    return report


def _analyze(
    disk: DiskModel, data: Iterable, config: ToastConfig, buffer_dir: str | os.PathLike | None
) -> Analysis:
    return analyze_from_disk(disk, data, buffer_dir=buffer_dir, **analysis_options(config))


def translated_edits(
    disk: DiskModel, spans: Sequence[Span], fits: Sequence[Translator | None]
) -> BlockEdits:
    """Each span replaced by its translator (None: plain removal) as the
    checkpoint's blocks load, in the weights' dtype as the patched model
    has it."""
    modules = [None if t is None else translator_module(t, dtype=disk.dtype) for t in fits]
    return replaced(spans, modules)


def _check(
    disk: DiskModel,
    spans: list[Span],
    translators: list[Translator],
    heldout: Iterable,
    config: ToastConfig,
    buffer_dir: str | os.PathLike | None,
) -> list[RemovalCheck | None]:
    """Each translator against plain removal on the held-out batches
    (:func:`toast.hf.evaluate.check.check_against_plain`), block by block."""
    # each sweep reads every block from disk (minutes on a large model): counted
    progress = config.calibration.progress
    evaluator = SequentialEvaluator(disk, heldout, progress=progress, buffer_dir=buffer_dir)

    def apply(where: Sequence[Span], fits: Sequence[Any]) -> AbstractContextManager:
        return evaluator.editing(translated_edits(disk, where, fits))

    return check_against_plain(
        disk.model, spans, translators, apply, heldout, config.fallback, evaluator=evaluator
    )


def _identity(d: int) -> Translator:
    """What stands for plain removal among translators."""
    return Translator("identity", np.eye(d), np.zeros(d), 1.0, d, "identity")


def _report(
    disk: DiskModel,
    config: ToastConfig,
    spans: list[Span],
    fitter: Fitter,
    analysis: Analysis,
    translators: list[Translator],
    checks: list[RemovalCheck | None],
    note: str,
) -> CompressionReport:
    tensors = disk.checkpoint.tensors
    before = sum(math.prod(t.shape) for t in tensors.values())
    removed = sum(
        math.prod(tensors[key].shape)
        for s in spans
        for b in range(s.start, s.stop)
        for key in disk.block_keys(b).values()
    )
    # as the patched model counts them: an identity has none, a zero bias is left out
    added = sum(p.numel() for t in translators for p in translator_module(t).parameters())
    return CompressionReport(
        method="toast",
        translator=config.translator,
        spans=spans,
        conditions=fitter.conditions,
        ranks=fitter.ranks,
        width=analysis.moments.dim,
        blocks_before=disk.num_blocks,
        blocks_after=disk.num_blocks - sum(s.num_blocks for s in spans) + len(spans),
        params_before=before,
        params_after=before - removed + added,
        rows=analysis.rows,
        analysis=analysis,
        fit=config.fit,
        checks=checks,
        check_note=note,
    )
