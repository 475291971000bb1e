"""A model with spans replaced by translators, saved in toast's format from
a checkpoint on disk, never loading the model.

:func:`save_translated_from_disk` patches the checkpoint's model built on
the meta device (no memory: :meth:`toast.hf.model.checkpoint.Checkpoint.skeleton`)
with the translator blocks, describes it with the same plan
:func:`toast.io.save_pretrained` writes, and writes ``model.safetensors``
tensor by tensor: the translators' tensors from memory, every other tensor
copied byte for byte from the checkpoint under its patched name (kept
blocks renumbered). :func:`toast.io.load_pretrained` loads the result as
it loads a save of the patched model made in memory. Like every toast
save, it is written into a hidden directory renamed when complete.

:func:`save_edited_from_disk` writes the same way a model whose blocks
stay where they are but whose modules ``edit`` changed on the skeleton
(removed sub-layers, parameter-free modules a registered model patch
describes): the kept tensors copied under their own names.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from toast._scratch import hidden_sibling
from toast.core import Translator
from toast.hf.capture.sequential import DiskModel
from toast.hf.model.checkpoint import TensorInfo
from toast.hf.model.surgery import replace_spans
from toast.io.format import FORMAT, WEIGHTS_NAME
from toast.io.pruned import write_safetensors
from toast.io.save import finish_folder, fsync_path, save_plan
from toast.spans import validate_spans
from toast.translators.block import translator_module

__all__ = ["save_edited_from_disk", "save_translated_from_disk"]


def _positions(spans: Sequence[tuple[int, int]], total: int) -> list[int | None]:
    """For each block of the patched model, the original block it is (None
    for a translator block)."""
    out: list[int | None] = []
    position = 0
    for start, stop in validate_spans(spans, total):
        out.extend(range(position, start))
        out.append(None)
        position = stop
    out.extend(range(position, total))
    return out


def _source(disk: DiskModel, name: str, block_path: str, positions: list[int | None]) -> TensorInfo:
    """Where the patched model's tensor ``name`` lives in the checkpoint."""
    original = name
    prefix = block_path + "."
    if name.startswith(prefix):
        index, _, rest = name[len(prefix) :].partition(".")
        block = positions[int(index)]
        if block is None:
            raise AssertionError(f"{name} belongs to a translator, which is not on disk")
        original = f"{prefix}{block}.{rest}"
    key = disk.key_of(original)
    if key is None:
        raise KeyError(
            f"{disk.checkpoint.folder} has no tensor for {original!r}; the model built "
            "from its config has parts the checkpoint lacks"
        )
    return disk.checkpoint.tensors[key]


def save_translated_from_disk(
    disk: DiskModel,
    output: str | os.PathLike,
    spans: Sequence[tuple[int, int]],
    translators: Sequence[Translator | nn.Module],
    report: str | None = None,
) -> Path:
    """Saves the checkpoint of ``disk`` with ``blocks[start:stop]`` of each
    span replaced by its translator, in toast's format, to the new folder
    ``output`` (see the module docstring), with ``report`` (markdown) in its
    model card. Raises ``FileExistsError`` when ``output`` exists. Returns
    the path."""
    target = _new_folder(output)
    model = disk.checkpoint.skeleton()
    modules = [
        translator_module(t, dtype=disk.checkpoint.dtype) if isinstance(t, Translator) else t
        for t in translators
    ]
    replace_spans(model, spans, modules, blocks=disk.stack.path)
    return _write(disk, model, _positions(spans, disk.num_blocks), target, report)


def save_edited_from_disk(
    disk: DiskModel,
    output: str | os.PathLike,
    edit: Callable[[nn.Module], None],
    report: str | None = None,
) -> Path:
    """Saves the checkpoint of ``disk`` with ``edit(model)`` applied to its
    model built on the meta device (a change that keeps every block in its
    place and adds no tensor: modules replaced by parameter-free ones),
    in toast's format, to the new folder ``output``, with ``report`` in its
    model card; what :func:`toast.save_pretrained` writes for the model so
    edited in memory. Raises ``FileExistsError`` when ``output`` exists."""
    target = _new_folder(output)
    model = disk.checkpoint.skeleton()
    edit(model)
    return _write(disk, model, list(range(disk.num_blocks)), target, report)


def _new_folder(output: str | os.PathLike) -> Path:
    target = Path(output)
    if target.exists() or target.is_symlink():
        raise FileExistsError(errno.EEXIST, f"{target} exists; choose a new folder", str(target))
    return target


def _write(
    disk: DiskModel,
    model: nn.Module,
    positions: list[int | None],
    target: Path,
    report: str | None,
) -> Path:
    """The patched skeleton ``model`` written to ``target``: its plan, the
    tensors it holds from memory, every other one copied from the
    checkpoint (block ``i`` of the model is the checkpoint's
    ``positions[i]``), in a hidden sibling renamed when complete."""
    path = disk.stack.path
    plan, stored = save_plan(model, path)
    items: list[tuple[str, TensorInfo | torch.Tensor]] = [
        (name, _source(disk, name, path, positions) if tensor.is_meta else tensor)
        for name, tensor in stored.items()
    ]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = hidden_sibling(target, "tmp")
    try:
        write_safetensors(items, {"format": "pt", "toast_format": FORMAT}, tmp / WEIGHTS_NAME)
        # the same folder as toast.save_pretrained: checksum, config, the
        # checkpoint's tokenizer and generation files, card, plan last
        companions = {"source": disk.checkpoint.folder, "report": report, "name": target.name}
        finish_folder(model, plan, tmp, companions)
        fsync_path(tmp)
        os.rename(tmp, target)
        fsync_path(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
