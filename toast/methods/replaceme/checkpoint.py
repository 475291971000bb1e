"""ReplaceMe on a model folder: in memory when the model fits the memory
budget, block by block from disk when it does not.

:func:`replaceme_checkpoint` reads the checkpoint's headers, compares what
loading the model needs with ``max_memory`` (:func:`toast.hf.budget.memory_plan`),
says which path it takes and why, and writes the pruned checkpoint (with
the tokenizer and generation files) to a new folder either way: through
``from_pretrained``, :func:`toast.replaceme` and ``save_pretrained``, or
through :func:`toast.methods.replaceme.disk.replaceme_from_disk`. Both
paths give the same cut, transform and tensors.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from toast.hf.budget import choose_path, open_checkpoint
from toast.io.pruned import copy_side_files
from toast.io.save import fsync_path, hidden_sibling
from toast.methods.replaceme.config import ReplaceMeConfig
from toast.methods.replaceme.disk import replaceme_from_disk
from toast.methods.replaceme.method import replaceme
from toast.methods.replaceme.report import ReplaceMeReport
from toast.methods.runner import split_text_options

__all__ = ["replaceme_checkpoint"]


def replaceme_checkpoint(
    folder: str | os.PathLike,
    data: Iterable | Any,
    output: str | os.PathLike,
    config: ReplaceMeConfig | None = None,
    *,
    max_memory: int | str | None = None,
    sequential: bool | None = None,
    **params: Any,
) -> ReplaceMeReport:
    """Removes blocks of the checkpoint in ``folder`` by ReplaceMe and writes
    the pruned checkpoint to the new folder ``output``.

    The model is loaded and pruned in memory when it fits ``max_memory``
    bytes (``"64GiB"``; default: the memory available now), and calibrated
    block by block from disk otherwise (``sequential=True``/``False`` forces
    a path). ``data``, ``config`` and ``params`` are as for
    :func:`toast.replaceme` (raw text needs ``tokenizer=``). An interrupted
    run leaves no partial ``output``. Returns the report.
    """
    text, rest = split_text_options(params)
    config = ReplaceMeConfig.from_options(config, rest)
    target = Path(output)
    if target.exists():
        raise FileExistsError(f"{target} exists; the pruned checkpoint goes to a new folder")
    progress = config.calibration.progress
    disk = open_checkpoint(folder, config.calibration.blocks, sequential, "toast replaceme")
    if disk is not None:
        plan = choose_path(disk, max_memory, sequential, progress, "toast replaceme")
        if plan.sequential:
            return replaceme_from_disk(disk, data, target, config, **text)
    return _in_memory(Path(folder), data, target, config, text)


def _in_memory(
    source: Path, data: Any, target: Path, config: ReplaceMeConfig, text: dict[str, Any]
) -> ReplaceMeReport:
    """from_pretrained, ReplaceMe in place, save_pretrained (atomically, with
    the folder's tokenizer and generation files)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype="auto").eval()
    _, report = replaceme(model, data, config, **text)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = hidden_sibling(target, "tmp")
    try:
        model.save_pretrained(tmp)
        for path in source.iterdir():  # what save_pretrained did not write
            if not (tmp / path.name).exists():
                copy_side_files(source, tmp, only=path.name)
        fsync_path(tmp)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report
