"""TOAST on a checkpoint on disk: the analysis block by block, closed-form
translators from its moments, and the patched model saved in toast's
format without ever loading the model (for models bigger than memory).

:func:`compress_from_disk` is the one driver's disk path
(:func:`toast.methods.driver.compress_from_disk_with_stages`) over TOAST's
configured stages (:mod:`toast.methods.translate.configured`): the moments
are those of the in-memory pass (:func:`toast.methods.translate.analyze_from_disk`),
so the plan and the translators are too;
:func:`toast.io.from_disk.save_translated_from_disk` writes what
:func:`toast.save_pretrained` writes for the patched model. The held-out
check against plain removal and the ``heldout=`` quality are measured
block by block (:class:`toast.hf.evaluate.from_disk.SequentialEvaluator`),
each translator standing in for its span as the blocks load.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from toast.hf.capture.sequential import DiskModel
from toast.hf.data.text import as_batches
from toast.methods.base import make_config
from toast.methods.driver import compress_from_disk_with_stages
from toast.methods.runner import split_heldout, split_text_options
from toast.methods.translate.compress import METHOD
from toast.methods.translate.config import ToastConfig
from toast.methods.translate.configured import ConfiguredToast
from toast.methods.translate.disk import translated_edits
from toast.methods.translate.report import CompressionReport

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
    data = as_batches(data, **text)
    measured: Iterable | None = None  # the held-out batches
    if isinstance(heldout, float):
        data, measured = split_heldout(data, heldout)
    elif heldout is not None:
        measured = as_batches(heldout, **text)
    disk = DiskModel.open(folder, config.calibration.blocks, config.calibration.compute_dtype)
    report = compress_from_disk_with_stages(
        METHOD,
        disk,
        data,
        output,
        config,
        heldout=measured,
        stages=ConfiguredToast(config, buffer_dir),
    )
    assert isinstance(report, CompressionReport)
    return report
