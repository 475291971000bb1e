"""A pruned checkpoint written from a checkpoint on disk, never loading the model.

:func:`write_pruned_checkpoint` copies a safetensors checkpoint folder
shard by shard and tensor by tensor: tensors of removed blocks are left
out, kept blocks' tensors are renamed to their new block index, a few
tensors are rewritten (ReplaceMe's transform folded into a
down-projection), the config follows the kept blocks
(:func:`toast.hf.model.surgery.prune_config`) and every other file of the folder
(tokenizer, generation config, chat template) is copied. Unchanged tensors
are copied byte for byte in bounded chunks, so memory stays at the largest
rewritten tensor whatever the model's size. The result is a standard
checkpoint: ``AutoModelForCausalLM.from_pretrained`` loads it.

Like :func:`toast.io.save_pretrained`, everything is written into a hidden
directory next to the target, renamed once complete: an interrupted write
(Ctrl-C included) leaves no partial output folder.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import shutil
import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from toast._scratch import hidden_sibling
from toast.hf.data.progress import progress_iter
from toast.hf.model.checkpoint import Checkpoint, TensorInfo
from toast.hf.model.surgery import prune_config
from toast.io.save import fsync_path

__all__ = ["Edit", "copy_side_files", "write_pruned_checkpoint", "write_safetensors"]

#: A rewrite of one tensor: the tensor read from the checkpoint in, the new one out.
Edit = Callable[[torch.Tensor], torch.Tensor]

_CHUNK = 16 * 2**20
_INDEX = "model.safetensors.index.json"
_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_ITEMSIZE = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2}


def _copy_range(src: Path, begin: int, end: int, out: Any) -> None:
    with open(src, "rb", buffering=0) as f:
        position = begin
        while position < end:
            chunk = os.pread(f.fileno(), min(_CHUNK, end - position), position)
            if not chunk:
                raise ValueError(f"{src} is truncated")
            out.write(chunk)
            position += len(chunk)


def write_safetensors(
    items: Sequence[tuple[str, TensorInfo | torch.Tensor]], metadata: dict[str, str], file: Path
) -> int:
    """Writes a safetensors ``file`` whose tensors are given by name as a
    tensor in memory or a :class:`TensorInfo` whose bytes are copied from
    its file in bounded chunks; fsyncs it and returns the bytes of tensor
    data."""

    def itemsize(source: TensorInfo | torch.Tensor) -> int:
        if isinstance(source, torch.Tensor):
            return source.element_size()
        return _ITEMSIZE.get(source.dtype, 1)

    # Widest dtypes first, as safetensors itself orders them: offsets stay aligned.
    order = sorted(items, key=lambda e: (-itemsize(e[1]), e[0]))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, source in order:
        if isinstance(source, torch.Tensor):
            dtype, shape = _DTYPE_NAMES[source.dtype], list(source.shape)
            size = source.numel() * source.element_size()
        else:
            dtype, shape, size = source.dtype, list(source.shape), source.nbytes
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(file, "wb") as out:
        out.write(struct.pack("<Q", len(raw)))
        out.write(raw)
        for _, source in order:
            if isinstance(source, torch.Tensor):
                data = source.detach().cpu().contiguous().view(-1).view(torch.uint8)
                out.write(data.numpy().tobytes())
            else:
                _copy_range(source.file, source.begin, source.end, out)
        out.flush()
        os.fsync(out.fileno())
    return offset


def _write_shard(
    checkpoint: Checkpoint,
    entries: list[tuple[str, str]],
    edits: Mapping[str, Edit],
    metadata: dict[str, str],
    file: Path,
) -> int:
    """Writes the tensors ``entries`` (new key, source key) to ``file``,
    rewriting those ``edits`` names; returns the bytes of tensor data."""
    items: list[tuple[str, TensorInfo | torch.Tensor]] = [
        (new, edits[src](checkpoint.read(src)) if src in edits else checkpoint.tensors[src])
        for new, src in entries
    ]
    return write_safetensors(items, metadata, file)


def _write_config(checkpoint: Checkpoint, kept: Sequence[int], total: int, folder: Path) -> None:
    config = copy.deepcopy(checkpoint.config)  # the checkpoint's own stays as it is on disk
    text = getattr(config, "text_config", None)
    target = (
        text if text is not None and getattr(text, "num_hidden_layers", None) == total else config
    )
    prune_config(target, kept, total)
    config.save_pretrained(folder)


def copy_side_files(source: Path, folder: Path, only: str | None = None) -> None:
    """Tokenizer, generation config, chat template...: everything that is
    not a weight file, the weight index or the config (``only``: that one
    name, if it is such a file)."""
    for path in sorted(source.iterdir()):
        name = path.name
        if only is not None and name != only:
            continue
        if name.startswith(".") or name in ("config.json", _INDEX):
            continue
        if name.endswith((".safetensors", ".bin", ".pt", ".pth")):
            continue
        if path.is_dir():
            shutil.copytree(path, folder / name)
        else:
            shutil.copy2(path, folder / name)


def write_pruned_checkpoint(
    checkpoint: Checkpoint | str | os.PathLike,
    output: str | os.PathLike,
    renames: Mapping[str, str | None],
    *,
    kept: Sequence[int],
    total: int,
    edits: Mapping[str, Edit] | None = None,
    progress: bool = True,
) -> Path:
    """Writes a pruned copy of ``checkpoint`` to the new folder ``output``.

    ``renames`` maps source keys to their new key, or None to leave the
    tensor out; keys it does not name are copied unchanged. ``edits``
    rewrites some source tensors (read whole, the only tensors ever held in
    memory). ``kept`` lists the source blocks kept out of ``total`` (for the
    config). Shards keep their names; the weight index is rewritten.
    Raises ``FileExistsError`` when ``output`` exists. Returns the path.
    """
    source = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
    edits = dict(edits or {})
    target = Path(output)
    if target.exists() or target.is_symlink():
        raise FileExistsError(errno.EEXIST, f"{target} exists; choose a new folder", str(target))
    unknown = sorted(set(edits) - set(source.tensors))
    if unknown:
        raise KeyError(f"edits name tensors the checkpoint lacks: {unknown[:3]}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = hidden_sibling(target, "tmp")
    try:
        _write_weights(source, tmp, renames, edits, progress)
        _write_config(source, kept, total, tmp)
        copy_side_files(source.folder, tmp)
        fsync_path(tmp)
        os.rename(tmp, target)
        fsync_path(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _write_weights(
    source: Checkpoint,
    folder: Path,
    renames: Mapping[str, str | None],
    edits: Mapping[str, Edit],
    progress: bool,
) -> None:
    weight_map: dict[str, str] = {}
    total_size = 0
    shards = progress_iter(
        source.shards, "writing shards", len(source.shards), "shard", not progress
    )
    for shard in shards:
        keys = [k for k, info in source.tensors.items() if info.file == shard]
        entries = [(renames.get(k, k), k) for k in keys]
        kept = [(new, src) for new, src in entries if new is not None]
        if not kept:
            continue
        total_size += _write_shard(source, kept, edits, source.metadata[shard], folder / shard.name)
        weight_map.update({new: shard.name for new, _ in kept})
    if (source.folder / _INDEX).is_file():
        index = {
            "metadata": {"total_size": total_size},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (folder / _INDEX).write_text(json.dumps(index, indent=2) + "\n")
