"""A Hugging Face checkpoint folder through any method: the path chosen once.

:func:`compress_folder` reads the checkpoint's headers, compares what loading
the model needs with ``max_memory`` (:func:`toast.hf.capture.budget.plan_checkpoint`),
says which path it takes and why, and writes the result to a new folder
either way:

- **in memory**: the model is loaded (:func:`toast.io.local.load_model`),
  compressed by :func:`toast.methods.runner.run_method` (held-out quality
  included) and saved: a toast save where plain ``transformers`` could not
  rebuild it (:func:`toast.io.save.save_pretrained`), else a standard
  checkpoint with the folder's tokenizer and generation files;
- **block by block from disk**, for a method whose stages run from disk
  (:func:`toast.methods.driver.disk_runner_of`): the one driver gets the
  checkpoint's structure, found once, and the batches, and writes
  ``output`` without ever loading the model.

Methods never choose the path and never open the folder themselves; both
paths give the same result (the tests compare them tensor for tensor). A
method with neither always runs in memory.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toast._scratch import hidden_sibling
from toast.hf.capture.budget import (
    OUTSIDE_LABELS,
    ShapeOnce,
    available_memory,
    fit_plan,
    in_memory_parts,
    parse_size,
    plan_checkpoint,
)
from toast.methods.driver import disk_runner_of
from toast.methods.runner import prepare_data, run_method

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch
    from torch import nn

    from toast.methods.base import Method, Report

__all__ = ["compress_folder", "plan_folder"]

_log = logging.getLogger(__name__)
_COMMAND = "toast compress"
#: room enough for any method's statistics whole (the in-memory path's)
_UNBOUNDED = 1 << 62


def compress_folder(
    method: Method,
    folder: str | os.PathLike,
    data: Any,
    output: str | os.PathLike,
    config: Any,
    *,
    max_memory: int | str | None = None,
    sequential: bool | None = None,
    heldout: Any = None,
    text: Mapping[str, Any] | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
) -> Report:
    """``method`` with ``config`` on the checkpoint in ``folder`` (or a
    ``.gguf`` file), written to the new folder ``output``; returns the
    report. ``max_memory`` and ``sequential`` choose the path (see the
    module docstring); ``data``, ``heldout`` and ``text`` are as for
    :func:`toast.methods.runner.run_method`; ``device`` and ``dtype`` are
    where and in what the in-memory path runs the model (the block-by-block
    path computes on the CPU in the config's ``calibration.compute_dtype``)."""
    source, target = Path(folder), Path(output)
    if target.exists():
        raise FileExistsError(f"{target} exists; the compressed model goes to a new folder")
    # the path memory chooses never changes the result
    config = method.stages.on_either_path(config)
    cal = getattr(config, "calibration", None)
    progress = getattr(cal, "progress", True)
    batches, held = prepare_data(method, data, heldout, text)

    def readable(b: Any) -> Iterable:  # a one-shot iterator is left for the run (not read)
        return () if b is None or isinstance(b, Iterator) else b

    shape = ShapeOnce(lambda: readable(batches), lambda: readable(held))
    disk = _disk_path(method, source, config, max_memory, sequential, progress, shape=shape)
    if disk is not None:
        config = _within_memory(
            method, config, disk, max_memory, shape(disk.model.config),
            tokens=shape.tokens(disk.model.config),
        )  # fmt: skip
        if dtype is not None or device is not None:
            _say(
                "the block-by-block path computes on the CPU (dtype: calibration.compute_dtype)",
                True,
            )
        # heldout only when given: a method's disk run may not measure it
        keywords = {} if held is None else {"heldout": held}
        run_from_disk = disk_runner_of(method)
        assert run_from_disk is not None  # _disk_path checked it
        return run_from_disk(disk, batches, target, config, **keywords)
    from toast.hf.capture.compute import widen_loaded
    from toast.io.local import load_model

    model = load_model(source)
    written = None
    if dtype is not None:
        model.to(device=device, dtype=_dtype(dtype))
    else:  # a 16-bit checkpoint computes as the block-by-block path would compute it
        option = getattr(cal, "compute_dtype", "auto")
        written = widen_loaded(model, option, "cpu" if device is None else device)
        if device is not None:
            model.to(device=device)
    model, report = run_method(method, model, data, config, heldout=heldout, text=text)
    if written is not None:  # the checkpoint's dtype, as the block-by-block path writes
        model.to(written)
    _save(model, source, target, report)
    return report


def plan_folder(
    method: Method,
    folder: str | os.PathLike,
    config: Any,
    batches: Iterable,
    max_memory: int | str | None,
    sequential: bool | None,
    command: str,
) -> tuple[Any, Any]:
    """The path ``method`` takes on the checkpoint in ``folder``, as
    :func:`compress_folder` chooses it: ``(None, config)`` in memory, else
    the checkpoint's structure and ``config`` with its statistics fitted to
    ``max_memory`` beside one forward on the largest of ``batches`` (the
    plan printed after ``command``; refused before any pass when even the
    least does not fit)."""
    progress = getattr(getattr(config, "calibration", None), "progress", True)
    shape = ShapeOnce(lambda: batches)
    disk = _disk_path(
        method, Path(folder), config, max_memory, sequential, progress, command, shape=shape
    )
    if disk is None:
        return None, config
    model_config = disk.model.config
    return disk, _within_memory(
        method, config, disk, max_memory, shape(model_config), command, shape.tokens(model_config)
    )


def _disk_path(
    method: Method,
    source: Path,
    config: Any,
    max_memory: int | str | None,
    sequential: bool | None,
    progress: bool,
    command: str = _COMMAND,
    *,
    shape: ShapeOnce | None = None,
) -> Any:
    """The checkpoint's structure when ``method`` runs block by block from
    disk; None for the in-memory path (the choice said either way). The
    loaded model must leave room for what its run holds beside it (the
    method's statistics whole, one forward and the held-out logits of the
    largest batch, ``shape``), else the path is block by
    block, whose plan bounds them."""
    if disk_runner_of(method) is None:
        if sequential:
            raise ValueError(
                f"method={method.name!r} has no block-by-block path (it needs the model in "
                "memory): pass sequential=None or False"
            )
        _say(f"in-memory path (method={method.name!r} runs in memory only)", progress, command)
        return None
    if source.is_file():  # a GGUF file is dequantized as it loads: no tensors to stream
        if sequential:
            raise ValueError(f"sequential=True needs a checkpoint folder; {source} is a file")
        _say(
            f"in-memory path ({source.name} is a file, not a checkpoint folder)", progress, command
        )
        return None
    cal = getattr(config, "calibration", None)
    _, disk = plan_checkpoint(
        source,
        max_memory,
        sequential,
        blocks=getattr(cal, "blocks", None),
        compute=getattr(cal, "compute_dtype", "auto"),
        progress=progress,
        command=command,
        beside=None if shape is None else functools.partial(_run_beside, method, config, shape),
    )
    return disk


def _run_beside(
    method: Method, config: Any, shape: ShapeOnce, model_config: Any
) -> list[tuple[str, int]]:
    """What ``method`` with ``config`` holds beside the loaded model
    (:func:`toast.hf.capture.budget.in_memory_parts`)."""
    width = int(getattr(model_config, "hidden_size", 0) or 0)
    blocks = int(getattr(model_config, "num_hidden_layers", 0) or 0)
    statistics: list[tuple[str, int]] = []
    if width and blocks:  # whole: no budget bounds them in memory
        tokens = shape.tokens(model_config)
        statistics = method.stages.within_memory(config, blocks + 1, width, _UNBOUNDED, tokens)[1]
    return in_memory_parts(model_config, shape(model_config), statistics)


def _within_memory(
    method: Method,
    config: Any,
    disk: Any,
    max_memory: int | str | None,
    shape: tuple[int, int] | None,
    command: str = _COMMAND,
    tokens: Sequence[int] | None = None,
) -> Any:
    """``config`` with the method's statistics fitted to what ``max_memory``
    leaves beside the block-by-block path's own parts (the statistics of
    calibration batches of ``tokens`` tokens, when known; with one forward on the
    largest batch, ``shape``, as few rows at a time as the plan needs:
    :func:`toast.hf.capture.budget.fit_plan`; the embedding or head too,
    unless the method's statistics are never beside them:
    :attr:`Stages.statistics_apart`); the plan printed, and the run refused
    before any pass when even the least does not fit."""
    budget = available_memory() if max_memory is None else parse_size(max_memory)
    fitted = [config]

    def statistics(parts: list[tuple[str, int]]) -> tuple[list, list]:
        width = int(getattr(disk.model.config, "hidden_size", 0) or 0)
        if not width:
            return parts, []
        stages = method.stages
        held = [p for p in parts if stages.statistics_apart and p[0] in OUTSIDE_LABELS]
        room = max(budget - sum(n for p, n in parts if (p, n) not in held), 0)
        fitted[0], taken = stages.within_memory(config, disk.num_blocks + 1, width, room, tokens)
        if held and taken:
            # what is kept to the end sits beside the head; the rest never does
            return parts + taken[-1:], taken[:-1]
        return parts + taken, []

    fit_plan(disk, shape, budget, statistics, command=command)
    return fitted[0]


def _say(reason: str, progress: bool, command: str = _COMMAND) -> None:
    _log.info("%s: %s", command, reason)
    if progress:
        print(f"{command}: {reason}", file=sys.stderr)


def _dtype(dtype: str | torch.dtype | None) -> Any:
    if not isinstance(dtype, str):
        return dtype
    import torch

    resolved = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype (e.g. 'bfloat16', 'float32')")
    return resolved


def _save(model: nn.Module, source: Path, target: Path, report: Report) -> None:
    """A toast save where plain ``transformers`` could not rebuild ``model``,
    else a standard checkpoint, with ``source``'s tokenizer and side files
    either way; written whole into ``target`` or not at all."""
    from toast.io.local import load_tokenizer
    from toast.io.save import needs_toast_layout, save_pretrained

    # a GGUF file carries its tokenizer inside; a folder's files are copied
    tokenizer = load_tokenizer(source) if source.is_file() else None
    if needs_toast_layout(model):
        folder = None if source.is_file() else source
        markdown = report.to_markdown()
        # the block list the method found, looked up by its path rather than searched again
        # (TOAST's analysis or ReplaceMe's distance profile holds it)
        found = getattr(report, "analysis", None) or getattr(report, "profile", None)
        blocks = getattr(found, "block_path", None)
        save_pretrained(
            model, target, blocks=blocks, source=folder, tokenizer=tokenizer, report=markdown
        )
        return
    from toast.io.pruned import copy_side_files

    tmp = hidden_sibling(target)
    try:
        cls: Any = type(model)  # a transformers class: its own save is right
        cls.save_pretrained(model, tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        else:
            for path in source.iterdir():  # what save_pretrained did not write
                if not (tmp / path.name).exists():
                    copy_side_files(source, tmp, only=path.name)
        _fsync_tree(tmp)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync_tree(folder: Path) -> None:
    """Every file of ``folder``, and the folder, on disk before it is renamed."""
    for path in [*folder.rglob("*"), folder]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
