"""Spans of blocks: ``(start, stop)`` slices of a model's block list, their
validation, and the exact planner that picks which spans to replace.

Kept free of torch so that config-only accounting can use the same rules
as patching. Index conventions: states ``0..L`` (state 0 is the embedding
output, state ``i`` the output of block ``i - 1``); a span ``(i, j)`` covers
blocks ``range(i, j)`` and is replaced by a map from state ``i`` to state
``j``. The papers write it ``s → e`` with ``s = i - 1``, ``e = j - 1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from toast._validation import Interval, check

__all__ = ["Span", "plan_spans", "validate_spans"]


@dataclass(frozen=True, order=True)
class Span:
    """Blocks ``range(start, stop)`` replaced by a map from state ``start``
    to state ``stop``, with the predicted error of that map."""

    start: int
    stop: int
    error: float = field(compare=False)

    @property
    def blocks(self) -> range:
        return range(self.start, self.stop)

    @property
    def num_blocks(self) -> int:
        return self.stop - self.start

    @property
    def paper(self) -> str:
        """The papers' notation ``s→e`` (output of block s predicts block e)."""
        return f"{self.start - 1}→{self.stop - 1}"

    def __str__(self) -> str:
        return f"blocks[{self.start}:{self.stop}] ({self.paper}, error {self.error:.4g})"


def validate_spans(spans: Sequence[tuple[int, int]], num_blocks: int) -> list[tuple[int, int]]:
    """Sorted spans ``(start, stop)`` of blocks, checked to lie in
    ``[0, num_blocks]`` and not to overlap."""
    checked = []
    for span in spans:
        start, stop = (int(v) for v in span)
        if not 0 <= start < stop <= num_blocks:
            raise ValueError(
                f"span {tuple(span)} must satisfy 0 <= start < stop <= {num_blocks} "
                f"(blocks[start:stop] of a model with {num_blocks} blocks)"
            )
        checked.append((start, stop))
    checked.sort()
    for a, b in zip(checked, checked[1:], strict=False):
        if a[1] > b[0]:
            raise ValueError(f"spans {a} and {b} overlap")
    return checked


def plan_spans(
    errors: np.ndarray,
    max_blocks: int | None = None,
    max_error: float | None = None,
    allow_adjacent: bool = False,
    include_first_block: bool = False,
) -> list[Span]:
    """Non-overlapping spans to replace, chosen exactly by dynamic programming.

    ``errors`` is an ``(L + 1) × (L + 1)`` error matrix where lower means
    redundant (NaN or Inf marks a span that cannot be replaced). Among sets
    of spans with a kept block between consecutive spans (the papers'
    ``e_i < s_j``; ``allow_adjacent=True`` drops that gap) and, with
    ``max_error``, each span's error at most ``max_error``: the most blocks
    removed, up to ``max_blocks``, and among those the smallest total
    predicted error. Block 0 stays unless ``include_first_block``.
    """
    if max_blocks is None and max_error is None:
        raise ValueError("give max_blocks=..., max_error=..., or both")
    check("max_blocks", max_blocks, Interval(int, 1, None), None)
    check("max_error", max_error, Interval(float, None, None), None)
    n = errors.shape[0]  # states 0..L
    limit = n - 1 if max_blocks is None else min(max_blocks, n - 1)
    gap = 0 if allow_adjacent else 1
    first = 0 if include_first_block else 1
    allowed = np.isfinite(errors)
    if max_error is not None:
        allowed &= errors <= max_error
    best, choice = _plan_table(errors, allowed, limit, gap, first)
    removed = max((b for b in range(limit + 1) if best[first][b] < np.inf), default=0)
    spans, p, b = [], first, removed
    while b > 0 and p < n:
        j = choice[p][b]
        if j is None:
            p += 1
            continue
        spans.append(Span(p, j, float(errors[p, j])))
        b -= j - p
        p = j + gap
    return spans


def _plan_table(
    errors: np.ndarray, allowed: np.ndarray, limit: int, gap: int, first: int
) -> tuple[list[list[float]], list[list[int | None]]]:
    # best[p][b]: least total error of spans starting at states >= p that
    # remove exactly b blocks; choice[p][b]: the span's stop taken at p, if any.
    n = errors.shape[0]
    inf = float("inf")
    best = [[inf] * (limit + 1) for _ in range(n + 2)]
    choice: list[list[int | None]] = [[None] * (limit + 1) for _ in range(n + 2)]
    for p in range(n + 2):
        best[p][0] = 0.0
    for p in range(n - 1, first - 1, -1):
        for b in range(1, limit + 1):
            value, taken = best[p + 1][b], None
            for j in range(p + 1, min(n, p + b + 1)):
                width = j - p
                if not allowed[p, j] or width > b:
                    continue
                rest = best[min(j + gap, n + 1)][b - width]
                if errors[p, j] + rest < value:
                    value, taken = errors[p, j] + rest, j
            best[p][b], choice[p][b] = value, taken
    return best, choice
