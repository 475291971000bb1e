"""TOAST on a model folder: in memory when the model fits the memory
budget, block by block from disk when it does not.

:func:`compress_checkpoint` reads the checkpoint's headers, compares what
loading the model needs with ``max_memory`` (:func:`toast.hf.budget.memory_plan`),
says which path it takes and why, and writes the compressed model in
toast's format to a new folder either way: through ``from_pretrained``,
:func:`toast.compress` and :func:`toast.save_pretrained`, or through
:func:`toast.methods.toast.from_disk.compress_from_disk`. Both paths give
the same plan, translators and tensors.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from toast.hf.budget import choose_path, open_checkpoint
from toast.io.local import load_model
from toast.io.save import save_pretrained
from toast.methods.base import make_config
from toast.methods.runner import run_method, split_text_options
from toast.methods.toast.compress import METHOD
from toast.methods.toast.config import ToastConfig
from toast.methods.toast.from_disk import compress_from_disk
from toast.methods.toast.report import CompressionReport

__all__ = ["compress_checkpoint"]


def compress_checkpoint(
    folder: str | os.PathLike,
    data: Iterable | Any,
    output: str | os.PathLike,
    config: ToastConfig | None = None,
    *,
    max_memory: int | str | None = None,
    sequential: bool | None = None,
    buffer_dir: str | os.PathLike | None = None,
    **params: Any,
) -> CompressionReport:
    """Replaces redundant spans of the checkpoint in ``folder`` by TOAST's
    translators and saves the result in toast's format to the new folder
    ``output`` (it loads with :func:`toast.load_pretrained`).

    The model is loaded and compressed in memory when it fits ``max_memory``
    bytes (``"64GiB"``; default: the memory available now), and calibrated
    block by block from disk otherwise (``sequential=True``/``False`` forces
    a path); the log says which and why. The block-by-block path fits
    closed-form translators with ``fit="independent"``; ``max_span`` bounds
    the states it keeps on disk (under ``buffer_dir``, default the system's
    temporary directory). ``data``, ``config`` and ``params`` are as for
    :func:`toast.compress`. An interrupted run leaves no partial ``output``.
    Returns the report.
    """
    text, rest = split_text_options(params)
    if config is None:
        config = make_config(METHOD, rest)
    elif rest:
        raise TypeError("give the options as config=... or as keywords, not both")
    target = Path(output)
    if target.exists():
        raise FileExistsError(f"{target} exists; the compressed model goes to a new folder")
    progress = config.calibration.progress
    disk = open_checkpoint(folder, config.calibration.blocks, sequential, "toast compress")
    if disk is not None:
        plan = choose_path(disk, max_memory, sequential, progress, "toast compress")
        if plan.sequential:
            return compress_from_disk(disk, data, target, config, buffer_dir=buffer_dir, **text)
    source = Path(folder)
    model = load_model(source)
    model, report = run_method(METHOD, model, data, config, text=text)
    assert isinstance(report, CompressionReport)  # what METHOD reports
    save_pretrained(model, target, source=source, report=report.to_markdown())
    return report
