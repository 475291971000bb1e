"""A cache folder with a size limit: the least recently used entries go first.

An entry is a folder under the cache's root (the search keeps one per model,
data and options); its size is what its files hold, its last use the
folder's modification time, which :func:`touch` sets on every read and every
file renamed into it sets on every write. After each write, :func:`evict`
removes whole entries, least recently used first, until the cache is within
its limit: ``$TOAST_CACHE_LIMIT`` (a size such as ``20GiB``), default
:data:`DEFAULT_LIMIT`. ``toast cache list`` and ``toast cache clear`` show and
empty it. Torch-free: the command line lists the cache without loading it.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from toast._validation import parse_size

__all__ = [
    "DEFAULT_LIMIT",
    "LIMIT_VARIABLE",
    "Entry",
    "cache_limit",
    "cache_root",
    "clear",
    "entries",
    "evict",
    "gguf_cache_dir",
    "search_cache_dir",
    "touch",
]

DEFAULT_LIMIT = "10GiB"
LIMIT_VARIABLE = "TOAST_CACHE_LIMIT"


def cache_root() -> Path:
    """``$TOAST_CACHE``, else ``~/.cache/toast``."""
    root = os.environ.get("TOAST_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "toast"


def search_cache_dir() -> Path:
    """Where ``toast.search`` keeps its calibrations and measurements."""
    return cache_root() / "search"


def gguf_cache_dir() -> Path:
    """Where the float32 copies of GGUF files are kept (:mod:`toast.io.gguf`)."""
    return cache_root() / "gguf"


def cache_limit() -> int:
    """The limit in bytes: ``$TOAST_CACHE_LIMIT``, else :data:`DEFAULT_LIMIT`."""
    text = os.environ.get(LIMIT_VARIABLE) or DEFAULT_LIMIT
    try:
        return parse_size(text)
    except ValueError as exc:
        raise ValueError(f"${LIMIT_VARIABLE}: {exc}") from None


@dataclass(frozen=True)
class Entry:
    """One cache entry: its folder, the bytes its files hold, its last use
    (seconds since the epoch)."""

    path: Path
    size: int
    used: float


def _size(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink():
                total += path.stat().st_size
        except OSError:  # removed meanwhile (another process evicting)
            continue
    return total


def entries(root: str | os.PathLike) -> list[Entry]:
    """The entries under ``root``, least recently used first (none when
    ``root`` does not exist)."""
    found = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    for name in names:
        path = Path(root) / name
        try:
            if name.startswith(".") or not path.is_dir() or path.is_symlink():
                continue
            used = path.stat().st_mtime
        except OSError:
            continue
        found.append(Entry(path, _size(path), used))
    return sorted(found, key=lambda e: (e.used, e.path.name))


def touch(entry: str | os.PathLike) -> None:
    """Marks ``entry`` as used now (its folder's modification time)."""
    try:
        os.utime(entry)
    except OSError:  # evicted meanwhile, or a read-only cache: nothing to keep fresh
        pass


def evict(root: str | os.PathLike, limit: int, keep: frozenset[str] = frozenset()) -> list[Entry]:
    """Removes the least recently used entries of ``root`` until the rest
    holds at most ``limit`` bytes; the entries named in ``keep`` (the one
    just written) stay even when they alone exceed it. Returns the removed."""
    found = entries(root)
    total = sum(e.size for e in found)
    removed = []
    for entry in found:
        if total <= limit:
            break
        if entry.path.name in keep:
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        total -= entry.size
        removed.append(entry)
    return removed


def clear(root: str | os.PathLike) -> list[Entry]:
    """Removes every entry of ``root``; returns them."""
    return evict(root, -1)
