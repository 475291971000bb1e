"""A Hugging Face checkpoint folder read tensor by tensor, never whole.

:class:`Checkpoint` opens a local folder holding ``config.json`` and one
or more ``*.safetensors`` shards (with ``model.safetensors.index.json``
when sharded), reads every shard's header once, and reads single tensors
with plain positioned reads into freshly allocated tensors. Nothing is
memory-mapped: a mapping keeps every page it has touched resident in the
process, so a pass over all blocks would grow to the size of the model;
positioned reads leave the bytes in the page cache, which the kernel
reclaims. :meth:`Checkpoint.skeleton` builds the model on the meta device
(no memory) so that its structure (block list, base model, per-layer
attributes) is discovered exactly as for a loaded model.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["DTYPES", "Checkpoint", "TensorInfo", "read_header"]

#: safetensors dtype names and their torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its shard file, dtype name, shape and the
    absolute byte range of its data in the file."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The tensors of one safetensors file (by key) and its metadata."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(length))
    base = 8 + length
    metadata = header.pop("__metadata__", None) or {}
    tensors = {
        key: TensorInfo(
            path,
            v["dtype"],
            tuple(v["shape"]),
            base + v["data_offsets"][0],
            base + v["data_offsets"][1],
        )
        for key, v in header.items()
    }
    return tensors, metadata


class Checkpoint:
    """A local safetensors checkpoint: its config, its tensors by key, and
    positioned reads of single tensors.

    Raises ``FileNotFoundError`` for a folder without ``config.json`` and
    ``ValueError`` for one without safetensors weights (``.bin`` pickles
    cannot be read tensor by tensor: re-save with ``safe_serialization``).
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        if not (self.folder / "config.json").is_file():
            raise FileNotFoundError(
                f"{self.folder} has no config.json: pass the folder of a Hugging Face "
                "checkpoint (the output of save_pretrained, or a downloaded snapshot)"
            )
        shards = self._shard_files()
        self.tensors: dict[str, TensorInfo] = {}
        self.metadata: dict[Path, dict[str, str]] = {}
        for shard in shards:
            tensors, metadata = read_header(shard)
            self.tensors.update(tensors)
            self.metadata[shard] = metadata
        self.shards = shards
        self._config: Any = None

    def _shard_files(self) -> list[Path]:
        index = self.folder / _INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return [self.folder / name for name in dict.fromkeys(weight_map.values())]
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise ValueError(
                f"{self.folder} holds no *.safetensors weights; sequential calibration reads "
                "tensors one at a time, which pickled .bin files do not allow: load the model "
                "once and save it with save_pretrained(folder) (safetensors is the default)"
            )
        return files

    @property
    def config(self) -> Any:
        """The ``transformers`` config of the checkpoint (read once)."""
        if self._config is None:
            from transformers import AutoConfig

            self._config = AutoConfig.from_pretrained(self.folder)
        return self._config

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data in all shards."""
        return sum(t.nbytes for t in self.tensors.values())

    def read(self, key: str) -> torch.Tensor:
        """The tensor ``key``, read from its shard into new memory."""
        info = self.tensors.get(key)
        if info is None:
            raise KeyError(f"{self.folder} has no tensor {key!r}")
        if info.dtype not in DTYPES:
            raise ValueError(f"tensor {key!r} has dtype {info.dtype}, which toast cannot read")
        out = torch.empty(info.shape, dtype=DTYPES[info.dtype])
        view = out.view(-1).view(torch.uint8).numpy().data if out.numel() else None
        with open(info.file, "rb", buffering=0) as f:
            f.seek(info.begin)
            if view is not None and f.readinto(view) != info.nbytes:
                raise ValueError(f"{info.file} is truncated: cannot read {key!r}")
        return out

    def read_many(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        return {key: self.read(key) for key in keys}

    def skeleton(self, dtype: torch.dtype | None = None) -> nn.Module:
        """The checkpoint's model class built from its config on the meta
        device: the structure, no memory; in ``dtype`` (default: the
        weights')."""
        import transformers

        config = self.config
        names = getattr(config, "architectures", None) or []
        cls = getattr(transformers, names[0], None) if names else None
        # built in the weights' dtype, as from_pretrained(dtype="auto") builds
        # it: buffers made at construction (embedding scales) take that dtype
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype if dtype is None else dtype)
        try:
            with torch.device("meta"):
                if cls is not None:
                    return cls(config)
                try:
                    return transformers.AutoModelForCausalLM.from_config(config)
                except ValueError:
                    return transformers.AutoModel.from_config(config)
        finally:
            torch.set_default_dtype(previous)

    @property
    def dtype(self) -> torch.dtype:
        """The floating dtype holding most of the checkpoint's bytes."""
        sizes: dict[str, int] = {}
        for info in self.tensors.values():
            if info.dtype in ("F64", "F32", "F16", "BF16"):
                sizes[info.dtype] = sizes.get(info.dtype, 0) + info.nbytes
        return DTYPES[max(sizes, key=lambda k: sizes[k])] if sizes else torch.float32

    def names(self, model: nn.Module) -> dict[str, str]:
        """The checkpoint key of every state-dict entry of ``model`` (a
        skeleton of this checkpoint), by the model's name. transformers
        renames some families' keys when loading (ViT's ``encoder.layer``
        becomes ``layers``) and back when saving; the same renamings, and
        the base-model prefix, are applied here. Entries the checkpoint
        lacks (tied weights, a pooler the saved model was built without) are
        left out."""
        wanted = model.state_dict()
        renamed = _renamer(model, wanted)
        found: dict[str, str] = {}
        for key in self.tensors:
            found.setdefault(renamed(key), key)
        return {n: found[n] for n in wanted if n in found}


def _renamer(model: nn.Module, wanted: dict[str, Any]) -> Any:
    """checkpoint key -> model name, by transformers' own loading renamings
    (identity where this transformers version has none)."""
    prefix = getattr(model, "base_model_prefix", None) or None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # an older transformers: keys are saved as named

        def plain(key: str) -> str:
            if key in wanted or prefix is None:
                return key
            return f"{prefix}.{key}" if f"{prefix}.{key}" in wanted else key

        return plain
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"expected a transformers model, got {type(model).__name__}")
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    if len(renamings) != len(transforms):
        raise ValueError(
            f"{type(model).__name__} checkpoints merge or split tensors when loaded "
            "(transformers weight converters); sequential calibration reads tensors one "
            "by one and does not support this family yet"
        )

    def rename(key: str) -> str:
        return rename_source_key(key, renamings, [], prefix, wanted)[0]

    return rename
