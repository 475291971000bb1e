"""What a search keeps between calls: the calibration (moments, massive
rows, ReplaceMe transforms) under a key of the model's weights, the
calibration data and the options that shaped the pass, and every
measurement under that key plus the held-out data's.

A second search of the same model and data with a new target reads the
calibration back (no calibration pass) and measures only candidates it
has not measured before. Files are written whole or not at all (a
temporary file renamed into place; an interrupted write leaves nothing, a
killed one a file that the next write there removes, :mod:`toast._scratch`).
The folder has a size limit (``$TOAST_CACHE_LIMIT``, default 10 GiB): after
every write the least recently used entries go (:mod:`toast._cachedir`);
``toast cache list`` and ``toast cache clear`` show and empty it. The cache
is the user's own folder: it is read with pickle, as a model checkpoint
would be.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from toast._cachedir import cache_limit, entries, evict, search_cache_dir, touch
from toast._scratch import owned_name
from toast._validation import format_size, parse_size
from toast.methods.calibrate import Calibrated

__all__ = [
    "SearchCache",
    "default_cache_dir",
    "fingerprint",
    "fingerprint_batches",
    "fingerprint_files",
]

#: Bumped when what a key stands for changes (old entries are then ignored).
VERSION = 9  # 9: calibrations pickle as toast.methods.calibrate.Calibrated; 8: merge norms
#: Files of a checkpoint folder up to this size are digested whole (config,
#: index, tokenizer); larger ones (the weights) by name, size and mtime.
SMALL_FILE = 1 << 20


def default_cache_dir() -> Path:
    """``$TOAST_CACHE/search``, else ``~/.cache/toast/search``."""
    return search_cache_dir()


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def _update(h: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        h.update(f"T{tuple(value.shape)}{value.dtype}".encode())
        h.update(_tensor_bytes(value))
    elif isinstance(value, Mapping):
        for key in sorted(value, key=str):
            h.update(f"K{key}".encode())
            _update(h, value[key])
    elif isinstance(value, (list, tuple)):
        h.update(f"L{len(value)}".encode())
        for item in value:
            _update(h, item)
    else:
        h.update(f"V{value!r}".encode())


def fingerprint(model: nn.Module) -> str:
    """A digest of ``model``'s class, config and every weight and buffer."""
    h = hashlib.blake2b(digest_size=16)
    h.update(type(model).__qualname__.encode())
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        h.update(config.to_json_string(use_diff=False).encode())
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        _update(h, tensor)
    return h.hexdigest()


def fingerprint_files(folder: str | os.PathLike) -> str:
    """A digest of a checkpoint folder's files, for a model that is never
    loaded: the small files' contents, and each weight file's name, size
    and modification time (a rewritten shard changes its key without the
    gigabytes being read)."""
    h = hashlib.blake2b(digest_size=16)
    for path in sorted(p for p in Path(folder).iterdir() if p.is_file()):
        stat = path.stat()
        h.update(f"F{path.name}|{stat.st_size}".encode())
        if stat.st_size <= SMALL_FILE:
            h.update(path.read_bytes())
        else:
            h.update(f"|{stat.st_mtime_ns}".encode())
    return h.hexdigest()


def fingerprint_batches(batches: Iterable) -> str:
    """A digest of every batch's tensors and values, in order."""
    h = hashlib.blake2b(digest_size=16)
    count = 0
    for batch in batches:
        _update(h, batch)
        count += 1
    h.update(f"N{count}".encode())
    return h.hexdigest()


def combine(*parts: Any) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"v{VERSION}".encode())
    for part in parts:
        h.update(repr(part).encode())
    return h.hexdigest()


def _write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """``write(file)`` into a temporary file renamed to ``path`` once whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = owned_name(path, "tmp")  # what a killed write left there goes first
    handle = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(handle, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class SearchCache:
    """The cache folder (``None``: nothing is kept), holding at most ``limit``
    bytes (a size such as ``"20GiB"``; default ``$TOAST_CACHE_LIMIT``, else
    10 GiB): after every write the least recently used entries go."""

    def __init__(self, root: str | os.PathLike | None, limit: str | int | None = None) -> None:
        self.root = None if root is None else Path(root)
        self.limit = 0
        if self.root is not None:  # a bad $TOAST_CACHE_LIMIT fails before any work
            self.limit = cache_limit() if limit is None else parse_size(limit)

    def _file(self, key: str, name: str) -> Path | None:
        return None if self.root is None else self.root / key / name

    def _used(self, file: Path) -> None:
        touch(file.parent)

    def _written(self, key: str) -> None:
        if self.root is not None:
            evict(self.root, self.limit, keep=frozenset({key}))

    def load_calibrated(self, key: str) -> Calibrated | None:
        file = self._file(key, "calibration.pkl")
        if file is None or not file.is_file():
            return None
        try:
            with file.open("rb") as f:
                found = pickle.load(f)
        except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError):
            return None  # an unreadable entry is recomputed, never trusted
        self._used(file)
        return found if isinstance(found, Calibrated) else None

    def save_calibrated(self, key: str, calibrated: Calibrated) -> str:
        """Writes ``calibrated`` under ``key``; returns what was written,
        as a line for the user ("" when nothing is kept)."""
        file = self._file(key, "calibration.pkl")
        if file is None or self.root is None:
            return ""
        # streamed: whole moments can be large, no second copy in memory
        _write_atomic(file, lambda f: pickle.dump(calibrated, f, pickle.HIGHEST_PROTOCOL))
        self._written(key)
        held = sum(e.size for e in entries(self.root))
        return (
            f"calibration cached: {format_size(file.stat().st_size)} in {file.parent} (the "
            f"cache holds {format_size(held)} of its {format_size(self.limit)} limit, least "
            "recently used entries evicted first; toast cache list | clear)"
        )

    def load_measurements(self, key: str) -> dict[str, dict[str, Any]]:
        file = self._file(key, "measurements.json")
        if file is None or not file.is_file():
            return {}
        try:
            found = json.loads(file.read_text())
        except (OSError, ValueError):
            return {}
        self._used(file)
        return found if isinstance(found, dict) else {}

    def save_measurements(self, key: str, measurements: Mapping[str, Any]) -> None:
        file = self._file(key, "measurements.json")
        if file is not None:
            text = json.dumps(measurements, indent=1, sort_keys=True).encode()
            _write_atomic(file, lambda f: f.write(text))
            self._written(key)
