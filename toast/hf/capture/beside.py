"""A batch's statistics summed beside the next batch's forward.

A capture pass alternates two kinds of work: a forward (torch's threads)
and the float64 sums of the states it recorded (the C core's BLAS threads,
with the GIL released). When torch's threads and the BLAS's fit the cores
this process may use together (one torch thread on a two-core machine, or
a process pinned to fewer threads than cores), the sums of batch ``k`` run
on a worker thread while batch ``k + 1`` is forwarded, on a core the
forward leaves idle. With torch on every core the two would contend for
the same cores: on two cores with two torch threads, TOAST's compress of
SmolLM2 took 28-30 s overlapped against 24 s in line, so the updates stay
in line there (:func:`spare_cores`).

The worker takes the updates one at a time, in the order of the batches,
and the BLAS keeps its thread count, so the sums are bit for bit those of
the pass in line. One batch's states are held for one more forward; an
error of an update is raised at the next batch or at the end of the pass.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from toast.core.blas import get_blas_threads

__all__ = ["Beside", "spare_cores"]


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS says)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def spare_cores() -> bool:
    """Whether torch's threads leave the BLAS's threads cores of their own:
    then a pass sums one batch's states while it forwards the next."""
    blas = get_blas_threads() or 1
    return torch.get_num_threads() + blas <= usable_cores()


class Beside:
    """Runs calls on one worker thread, one at a time and in order, when
    ``enabled``; else at once, in the caller's thread.

    :meth:`run` waits for the call before it (so at most one is in flight
    and its error is raised there); :meth:`wait` for the last one;
    :meth:`close` waits and ends the worker (its error raised),
    :meth:`abandon` waits and ends it when the caller is already unwinding
    (its error dropped: the caller's own is the one to see).
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    def run(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)``, beside the caller when enabled."""
        self.wait()
        if not self.enabled:
            fn(*args)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="toast-statistics")
        self._pending = self._pool.submit(fn, *args)

    def wait(self) -> None:
        """Returns once no call is in flight; raises the last call's error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """:meth:`wait`, then ends the worker thread."""
        try:
            self.wait()
        finally:
            self._shutdown()

    def abandon(self) -> None:
        """Waits for the call in flight and ends the worker, ignoring that
        call's error."""
        try:
            self.wait()
        except Exception:  # noqa: BLE001 -- the caller is raising its own
            pass
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
