"""The thread count of the OpenBLAS that the C core calls.

OpenBLAS starts as many threads as there are cores. For the small products of
narrow models, and on a machine where other processes (a data loader, torch's
own threads, other jobs) want the same cores, its threads spin against them:
updates can run many times slower than on one thread. :func:`blas_threads`
sets the count for a block of code::

    with toast.core.blas_threads(1):
        analysis = toast.analyze(model, loader)

Results agree to rounding whatever the count. They are bit-identical from
run to run with a fixed count, but not across counts: OpenBLAS threads even
products of a few hundred rows, and how it splits them changes the last
bits (``tests/core/test_determinism.py`` records the measurements). Pin one
thread for bit-identical results everywhere. The setting is process-wide.
"""

from __future__ import annotations

import ctypes
import glob
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

from toast._validation import Interval, check

__all__ = ["blas_threads", "get_blas_threads", "set_blas_threads"]


@lru_cache(maxsize=1)
def _functions() -> tuple[Any, Any] | None:
    """OpenBLAS's get/set thread-count functions, or None when not found.

    The core links the scipy-openblas32 wheel (symbols prefixed ``scipy_``)
    or, as a fallback, the system OpenBLAS (no prefix); the wheel is tried
    first, as the build does.
    """
    candidates: list[tuple[str, str]] = []
    try:
        import scipy_openblas32

        for path in glob.glob(
            os.path.join(scipy_openblas32.get_lib_dir(), "libscipy_openblas*.so*")
        ):
            candidates.append((path, "scipy_"))
    except ImportError:
        pass
    candidates += [("libopenblas.so.0", ""), ("libopenblas.so", "")]
    for path, prefix in candidates:
        try:
            lib = ctypes.CDLL(path)
            get = getattr(lib, f"{prefix}openblas_get_num_threads")
            set_ = getattr(lib, f"{prefix}openblas_set_num_threads")
        except (OSError, AttributeError):
            continue
        get.restype, get.argtypes = ctypes.c_int, []
        set_.restype, set_.argtypes = None, [ctypes.c_int]
        return get, set_
    return None


def get_blas_threads() -> int | None:
    """OpenBLAS's current thread count (None when OpenBLAS is not found)."""
    functions = _functions()
    return None if functions is None else int(functions[0]())


def set_blas_threads(threads: int) -> None:
    """Sets OpenBLAS's thread count for the whole process."""
    check("threads", threads, Interval(int, 1, None))
    functions = _functions()
    if functions is None:
        raise RuntimeError("cannot find the OpenBLAS library the core links against")
    functions[1](threads)


@contextmanager
def blas_threads(threads: int) -> Iterator[None]:
    """Runs the block with OpenBLAS on ``threads`` threads, then restores the
    previous count (also on exceptions)."""
    previous = get_blas_threads()
    set_blas_threads(threads)
    try:
        yield
    finally:
        if previous is not None:
            set_blas_threads(previous)
