"""Progress of a pass over data: samples against a total, tokens, memory, ETA.

On a terminal, a tqdm bar counting samples. Anywhere else (a log file, CI,
a pipe), tqdm's carriage-return redraws would become one unreadable line,
so :class:`LineProgress` writes plain lines instead: the first step, then at
most one line every ``interval`` seconds, and the last.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any, TextIO, TypeVar

T = TypeVar("T")

__all__ = ["LineProgress", "expected_samples", "progress_bar", "progress_counter", "progress_iter"]


class LineProgress:
    """A tqdm-like counter (``update``, ``set_postfix``, ``n``, ``total``,
    ``close``) that logs plain lines to ``file``."""

    def __init__(
        self,
        desc: str,
        total: int | None,
        unit: str,
        file: TextIO | None = None,
        interval: float = 10.0,
    ) -> None:
        self.desc, self.total, self.unit = desc, total, unit
        self.file = file if file is not None else sys.stderr
        self.interval = interval
        self.n = 0
        self._postfix = ""
        self._start = time.monotonic()
        self._last: float | None = None
        self._written = -1  # the count the last line showed
        self._closed = False

    def set_postfix(self, refresh: bool = True, **values: Any) -> None:
        self._postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def update(self, count: int = 1) -> None:
        self.n += count
        now = time.monotonic()
        if self._last is None or now - self._last >= self.interval:
            self._write(now)

    def _write(self, now: float) -> None:
        self._last, self._written = now, self.n
        elapsed = now - self._start
        done = f"{self.n:,}" if self.total is None else f"{self.n:,}/{self.total:,}"
        line = f"{self.desc}: {done} {_plural(self.unit)}"
        if self._postfix:
            line += f", {self._postfix}"
        line += f", {elapsed:.0f}s"
        if self.total and 0 < self.n < self.total:
            line += f", ETA {elapsed / self.n * (self.total - self.n):.0f}s"
        print(line, file=self.file, flush=True)

    def close(self) -> None:
        if not self._closed and self.n and self._written != self.n:
            self._write(time.monotonic())  # the final count, whatever the interval
        self._closed = True


def _plural(unit: str) -> str:
    return unit + ("es" if unit.endswith(("s", "x", "ch", "sh")) else "s")


def progress_bar(desc: str, total: int | None, unit: str, disable: bool) -> Any:
    """A tqdm bar on a terminal, :class:`LineProgress` lines elsewhere
    (``disable``: a silent tqdm)."""
    from tqdm.auto import tqdm

    if disable or sys.stderr.isatty():
        return tqdm(desc=desc, total=total, unit=unit, disable=disable, leave=False)
    return LineProgress(desc, total, unit)


def progress_iter(
    items: Iterable[T], desc: str, total: int | None, unit: str, disable: bool
) -> Iterator[T]:
    """``items``, counted by :func:`progress_bar` as they are consumed (a
    tqdm bar on a terminal, plain lines elsewhere); the bar is closed even
    when the loop stops early."""
    bar = progress_bar(desc, total, unit, disable)
    try:
        for item in items:
            yield item
            bar.update(1)
    finally:
        bar.close()


def progress_counter(desc: str, unit: str, disable: bool) -> Callable[[int, int], None]:
    """A ``(done, total)`` callback that counts on a :func:`progress_bar`
    opened at the first call (when the total is known) and closed at the
    last (``done == total``)."""
    bars: list[Any] = []

    def count(done: int, total: int) -> None:
        if not bars:
            bars.append(progress_bar(desc, total, unit, disable))
        bars[0].update(1)
        if done >= total:
            bars.pop().close()

    return count


def expected_samples(
    loader: Any, max_samples: int | None, max_batches: int | None, batch: int
) -> int | None:
    """Samples a pass will read, once the first batch (of ``batch`` samples)
    is known: the loader's dataset length, else its number of batches times
    the first batch's size (an upper bound), within ``max_samples`` and
    ``max_batches``; None when the loader has no length and no bound is set."""
    dataset = getattr(loader, "dataset", None)
    total: int | None = None
    if isinstance(dataset, Sized):
        total = len(dataset)
        if max_batches is not None:
            total = min(total, max_batches * batch)
    elif isinstance(loader, Sized):
        batches = len(loader) if max_batches is None else min(len(loader), max_batches)
        total = batches * batch
    elif max_batches is not None:
        total = max_batches * batch
    if max_samples is not None:
        total = max_samples if total is None else min(total, max_samples)
    return total
