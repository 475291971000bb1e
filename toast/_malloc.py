"""glibc's heap, handed back to the system: the block-by-block path frees
one block's weights after another, and glibc would otherwise keep the freed
memory for reuse, so the resident memory drifts above the memory plan.
Both calls do nothing off glibc (musl, macOS). No torch here: the budget
module, which the CLI imports before anything loads, calls them."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from typing import Any

__all__ = ["MMAP_THRESHOLD", "return_freed_memory", "trim_heap"]

#: Allocations from this size up get their own mapping, returned to the
#: system when freed (glibc's ``M_MMAP_THRESHOLD``).
MMAP_THRESHOLD = 1 << 20

_M_MMAP_THRESHOLD = -3  # <malloc.h>


@functools.cache
def _glibc() -> Any | None:
    """The C library when it is glibc's (it has ``mallopt`` and
    ``malloc_trim``), else None. Found once: ``find_library`` runs
    ``ldconfig`` in a child process, a fork of this one, whose resident
    memory a watcher from outside counts again (the heap is trimmed after
    every block). glibc's own name first, which needs no search."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        except OSError:
            return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def trim_heap() -> None:
    """Hands the heap's free pages back (``malloc_trim``): with one block's
    weights freed after another, the heap would grow towards the model's
    size in fragments."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def return_freed_memory() -> bool:
    """Makes glibc give every freed allocation of :data:`MMAP_THRESHOLD`
    bytes or more back to the system (``mallopt``); returns whether it
    could. By default glibc raises that threshold each time a large buffer
    is freed, up to 32 MiB, so the freed weights and activations of a
    block-by-block pass stay in its heap and its resident memory drifts
    above its plan (measured on a 768-wide Llama under a 96 MiB plan: 128
    MiB above the interpreter by default, 70 with this). Process-wide: the
    block-by-block path sets it once it is chosen."""
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
