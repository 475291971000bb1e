"""Scratch space that a stopped run leaves nothing of.

Two kinds, one helper each, used by every layer (no torch, nothing of toast):

- :func:`scratch_file`: a buffer with no name (``O_TMPFILE`` where the file
  system has it, else created and unlinked at once, which
  :func:`tempfile.TemporaryFile` does). The kernel frees its blocks when the
  last descriptor closes, which the process's death does whatever ended it
  (Ctrl-C, SIGTERM, ``kill -9``, a crash). The calibration buffers
  (activations between blocks, pending states, row samples) are such files,
  read and written through their descriptor.
- :func:`hidden_sibling`: a named folder (or :func:`owned_name`, a file)
  beside an output, written into and renamed into place once complete. Its
  name carries its owner, ``.NAME.TAG-PID-START-RANDOM`` (``START``: the
  process's start time, so that a reused pid is not taken for the owner), and
  every call first removes the siblings of the same parent whose owner is
  gone (:func:`sweep`): what a ``kill -9`` left goes when the next run writes
  there.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "hidden_sibling",
    "owned_name",
    "owner_alive",
    "scratch_file",
    "scratch_place",
    "sweep",
]

#: ``.NAME.TAG-PID-START-RANDOM``: what :func:`owned_name` writes.
_OWNED = re.compile(r"^\..+\.[a-z]+-(\d+)-(\d+)-[0-9a-f]{8}$")


def scratch_file(directory: str | os.PathLike | None = None) -> BinaryIO:
    """A new empty file with no name in ``directory`` (default: the system's
    temporary directory, ``$TMPDIR``), open for reading and writing; the disk
    space returns when it is closed or the process dies."""
    return tempfile.TemporaryFile(dir=None if directory is None else os.fspath(directory))


def scratch_place(directory: str | os.PathLike | None = None) -> str:
    """Where :func:`scratch_file` puts its files, for messages."""
    where = os.fspath(directory) if directory is not None else tempfile.gettempdir()
    return f"{where} (files with no name, freed when the process ends)"


def _start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks after boot, Linux's
    ``/proc/PID/stat``); None when it does not exist or is a zombie, 0
    where ``/proc`` is not available."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return None if os.path.isdir("/proc/self") else 0
    except OSError:
        return 0
    # the command name may hold spaces and parentheses: fields follow the last ")"
    fields = stat[stat.rfind(b")") + 2 :].split()
    if fields[0] == b"Z":  # exited, not yet waited for: it holds nothing open
        return None
    return int(fields[19])


def _tag() -> str:
    pid = os.getpid()
    return f"{pid}-{_start_time(pid) or 0}"


def owner_alive(pid: int, start: int) -> bool:
    """Whether the process that wrote ``pid`` and ``start`` runs still."""
    found = _start_time(pid)
    if found is None:
        return False
    if found and start:
        return found == start
    if os.name != "posix":  # os.kill(pid, 0) would not probe there: never sweep
        return True
    try:  # no /proc: the pid alone says it
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(folder: str | os.PathLike) -> list[Path]:
    """Removes the owned siblings (:func:`owned_name`) in ``folder`` whose
    owner has exited; returns them."""
    removed: list[Path] = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        match = _OWNED.match(name)
        if match is None or owner_alive(int(match.group(1)), int(match.group(2))):
            continue
        path = Path(folder) / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        removed.append(path)
    return removed


def owned_name(target: str | os.PathLike, tag: str) -> Path:
    """A new hidden name beside ``target`` that records this process as its
    owner, after removing what exited owners left there (:func:`sweep`)."""
    target = Path(target)
    sweep(target.parent)
    return target.parent / f".{target.name}.{tag}-{_tag()}-{secrets.token_hex(4)}"


def hidden_sibling(target: str | os.PathLike, tag: str = "tmp") -> Path:
    """A new empty hidden folder beside ``target`` (:func:`owned_name`), to
    write into before it is renamed to ``target``. Created with the usual
    permissions (``os.mkdir``, not ``mkdtemp``'s 0700), as the output will
    have them."""
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    while True:
        candidate = owned_name(target, tag)
        try:
            os.mkdir(candidate)
            return candidate
        except FileExistsError:  # pragma: no cover - 32 random bits collided
            continue
