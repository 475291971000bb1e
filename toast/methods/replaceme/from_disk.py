"""ReplaceMe on a checkpoint on disk without loading the model:
:func:`replaceme_from_disk`, a convenience over the one driver's disk path
(:func:`toast.methods.driver.compress_from_disk_with_stages`) and
ReplaceMe's configured stages (:mod:`toast.methods.replaceme.configured`),
whose passes stream the blocks (:mod:`toast.methods.replaceme.disk`)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from toast.hf.capture.sequential import DiskModel
from toast.hf.data.text import as_batches
from toast.methods.base import get_method
from toast.methods.driver import compress_from_disk_with_stages
from toast.methods.replaceme.config import ReplaceMeConfig
from toast.methods.replaceme.configured import ConfiguredReplaceMe
from toast.methods.replaceme.disk import check_supported
from toast.methods.replaceme.report import ReplaceMeReport
from toast.methods.runner import split_heldout, split_text_options

__all__ = ["replaceme_from_disk"]


def replaceme_from_disk(
    folder: str | os.PathLike | DiskModel,
    data: Iterable,
    output: str | os.PathLike | None = None,
    config: ReplaceMeConfig | None = None,
    *,
    heldout: Iterable | float | None = None,
    **params: Any,
) -> ReplaceMeReport:
    """ReplaceMe on the checkpoint in ``folder`` without loading the model.

    ``folder`` may also be a :class:`~toast.hf.capture.disk_model.DiskModel` opened
    before. ``data`` is a loader of tokenized batches, or raw text with
    ``tokenizer=`` (and ``max_length``, ``batch_size``...: see
    :func:`toast.compress`); ``config`` and/or its fields as keywords choose
    the cut and the transform, as in memory: with ``check_fraction`` the
    ``candidates`` windows of smallest distance are fitted and measured on
    held-out calibration batches against plain removal, block by block.
    ``heldout`` data (or a fraction of raw text ``data``) adds the measured
    quality of the original, plain removal and the pruned model to the
    report (``report.quality``), measured block by block.
    With ``output``, the pruned checkpoint is written there (a new folder;
    ``placement="fold"`` or ``"auto"``, which here keeps the diagonal T
    folded into the norm after the MLP where one follows it: from disk the
    other exact placements are not measured). Only one block's weights and the calibration
    states are ever in memory; the states wait between blocks in a
    temporary directory under ``buffer_dir``, removed on every exit. An
    interrupted run (Ctrl-C included) leaves neither temporary files nor a
    partial ``output``. Returns the report (as :func:`toast.methods.replaceme.replaceme`'s).

    A convenience over the one driver
    (:func:`toast.methods.driver.compress_from_disk_with_stages`, what
    ``toast.compress`` runs on a folder block by block): the raw text read,
    the folder opened.
    """
    text, params = split_text_options(params)
    config = ReplaceMeConfig.from_options(config, params)
    check_supported(config, output is not None)
    data = as_batches(data, **text)
    measured: Iterable | None = None  # the held-out batches
    if isinstance(heldout, float):
        data, measured = split_heldout(data, heldout)
    elif heldout is not None:
        measured = as_batches(heldout, **text)
    if output is not None and Path(output).exists():
        raise FileExistsError(f"{output} exists; the pruned checkpoint goes to a new folder")
    disk = DiskModel.open(folder, config.calibration.blocks, config.calibration.compute_dtype)
    method = get_method("replaceme")  # registered by the package's method module
    # without output nothing is written: any placement can be measured
    stages = ConfiguredReplaceMe(config, writes=output is not None)
    report = compress_from_disk_with_stages(
        method, disk, data, output, config, heldout=measured, stages=stages
    )
    assert isinstance(report, ReplaceMeReport)
    return report
