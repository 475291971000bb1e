"""The plans of span methods, shared by the methods that remove spans of
blocks (plain removal, TOAST, ReplaceMe, LinearPatch, Ghosted Layers): for
a table of every span's predicted error, the exact plan of each size and
the best single windows beside it, as :class:`~toast.methods.stages.Plan` s.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np

from toast.methods.stages import Plan, Sizes
from toast.spans import plan_spans

__all__ = [
    "ALTERNATIVES",
    "best_windows",
    "inner_windows",
    "span_error",
    "span_family_plans",
    "span_plans",
]

#: Alternatives per family and size beside the exact plan: single spans,
#: best predicted first.
ALTERNATIVES = 2


def best_windows(table: np.ndarray, n: int) -> list[tuple[int, int]]:
    """The :data:`ALTERNATIVES` single spans of ``n`` blocks with the lowest
    error in ``table``, none starting at block 0 (the papers keep it, and a
    ReplaceMe cut folds into the block before it)."""
    windows = [(a, a + n) for a in range(1, table.shape[0] - n) if np.isfinite(table[a, a + n])]
    windows.sort(key=lambda s: table[s])
    return windows[:ALTERNATIVES]


def inner_windows(table: np.ndarray, n: int, first: int = 1) -> list[tuple[int, int]]:
    """Every single span of ``n`` blocks with a finite error in ``table``
    that starts at block ``first`` or later and ends before the last block
    (LLM-Streamline's and LinearPatch's range: the state after the last block
    is never a window's output), lowest error first, the earlier on ties."""
    last = table.shape[0] - 1  # states 0..L
    windows = [(a, a + n) for a in range(first, last - n) if np.isfinite(table[a, a + n])]
    windows.sort(key=lambda s: (float(table[s]), s[0]))
    return windows


def span_plans(table: np.ndarray, n: int) -> Iterator[tuple[tuple[int, int], ...]]:
    """The exact plan removing ``n`` blocks under ``table``'s errors, then
    the best single spans of ``n`` blocks (the first is the one a method
    offers for extension)."""
    plan = plan_spans(table, max_blocks=n)
    if sum(s.num_blocks for s in plan) == n:
        yield tuple((s.start, s.stop) for s in plan)
    for span in best_windows(table, n):
        yield (span,)


def span_error(table: np.ndarray, spans: Sequence[tuple[int, int]]) -> float:
    """The summed error of ``spans`` under ``table``."""
    return float(sum(table[a, b] for a, b in spans))


def span_family_plans(
    method: str,
    family: str,
    table: np.ndarray,
    translator: str,
    sizes: Sizes,
    max_blocks: int,
    added_per_span: int = 0,
    extendable: bool = False,
) -> list[Plan]:
    """A span method's plans: for every size up to ``max_blocks``, the
    exact plan and the best single spans under ``table`` (the first of
    each size ``extendable`` when asked), finite predictions only."""
    plans: list[Plan] = []
    for n in range(1, max_blocks + 1):
        for k, spans in enumerate(dict.fromkeys(span_plans(table, n))):
            predicted = span_error(table, spans)
            if not math.isfinite(predicted):
                continue
            plans.append(
                Plan(
                    (method,),
                    family,
                    spans,
                    translator,
                    sizes.after_spans(spans, added_per_span),
                    predicted,
                    extendable=extendable and k == 0,
                )
            )
    return plans
