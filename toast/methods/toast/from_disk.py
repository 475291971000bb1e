"""TOAST on a checkpoint on disk: the analysis block by block, closed-form
translators from its moments, and the patched model saved in toast's
format without ever loading the model (for models bigger than memory).

The moments are those of the in-memory pass
(:func:`toast.methods.toast.analyze_from_disk`), so the plan and the
translators are too; :func:`toast.io.from_disk.save_translated_from_disk`
writes what :func:`toast.save_pretrained` writes for the patched model.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any

from toast.core import Translator
from toast.hf.sequential import DiskModel
from toast.io.from_disk import save_translated_from_disk
from toast.methods.base import make_config
from toast.methods.runner import split_text_options
from toast.methods.toast.analysis import Analysis, analyze_from_disk
from toast.methods.toast.compress import METHOD, choose_spans
from toast.methods.toast.config import CLOSED_FORM, ToastConfig
from toast.methods.toast.fitting import Fitter
from toast.methods.toast.report import CompressionReport
from toast.spans import Span

__all__ = ["compress_from_disk"]


def compress_from_disk(
    folder: str | os.PathLike | DiskModel,
    data: Iterable | Any,
    output: str | os.PathLike,
    config: ToastConfig | None = None,
    *,
    buffer_dir: str | os.PathLike | None = None,
    **params: Any,
) -> CompressionReport:
    """``toast.compress(model, data, method="toast", ...)`` followed by
    :func:`toast.save_pretrained` to ``output``, for the checkpoint in
    ``folder``, without loading the model. Closed-form translators
    (``"linear"``, ``"affine"``, ``"diagonal"``...) with ``fit="independent"``
    only: trained translators need the rows, sequential fits the patched
    model. ``buffer_dir`` holds the calibration states while the blocks
    run (a temporary directory, removed on every exit)."""
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
    disk = DiskModel.open(folder, config.calibration.blocks)
    analysis = analyze_from_disk(
        disk,
        data,
        metric=config.metric,
        estimator=config.estimator,
        folds=config.folds,
        ridge=config.ridge or 0.0,
        tokens=config.tokens,
        pairs=config.pairs,
        calibration=config.calibration,
        buffer_dir=buffer_dir,
        **text,
    )
    spans = choose_spans(analysis, config)
    fitter = Fitter(config)
    translators = [fitter.closed_form(analysis.moments, s.start, s.stop) for s in spans]
    report = _report(disk, config, spans, fitter, analysis, translators)
    pairs = [(s.start, s.stop) for s in spans]
    save_translated_from_disk(disk, output, pairs, translators, report.to_markdown())
    return report


def _report(
    disk: DiskModel,
    config: ToastConfig,
    spans: list[Span],
    fitter: Fitter,
    analysis: Analysis,
    translators: list[Translator],
) -> CompressionReport:
    tensors = disk.checkpoint.tensors
    before = sum(math.prod(t.shape) for t in tensors.values())
    removed = sum(
        math.prod(tensors[key].shape)
        for s in spans
        for b in range(s.start, s.stop)
        for key in disk.block_keys(b).values()
    )
    added = sum(int(t.weight.size) + int(t.bias.size) for t in translators)
    return CompressionReport(
        method="toast",
        translator=config.translator,
        spans=spans,
        conditions=fitter.conditions,
        blocks_before=disk.num_blocks,
        blocks_after=disk.num_blocks - sum(s.num_blocks for s in spans) + len(spans),
        params_before=before,
        params_after=before - removed + added,
        rows=analysis.rows,
        analysis=analysis,
        fit=config.fit,
        check_note="none (from disk: every batch is analysed; the check runs in memory)"
        if config.holdout
        else "",
    )
