"""The Pareto front of measured candidates: smaller and better at once.

A candidate is on the front when no other measured candidate is at most
as large (parameters, MACs or measured seconds per forward) and at least
as good (held-out quality), and strictly one of the two.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["dominates", "pareto_front", "spearman"]


def dominates(a: tuple[float, float], b: tuple[float, float], higher_is_better: bool) -> bool:
    """Whether ``a = (size, quality)`` dominates ``b``."""
    qa, qb = (a[1], b[1]) if higher_is_better else (-a[1], -b[1])
    return a[0] <= b[0] and qa >= qb and (a[0] < b[0] or qa > qb)


def pareto_front(points: Sequence[tuple[float, float]], higher_is_better: bool) -> list[int]:
    """Indices of the non-dominated ``(size, quality)`` points, by
    increasing size; a point with a NaN is never on the front. Equal
    points are all kept."""
    finite = [k for k, p in enumerate(points) if all(math.isfinite(v) for v in p)]
    front = [
        k
        for k in finite
        if not any(dominates(points[o], points[k], higher_is_better) for o in finite if o != k)
    ]
    return sorted(front, key=lambda k: (points[k][0], k))


def _ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda k: values[k])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        stop = start
        while stop + 1 < len(order) and values[order[stop + 1]] == values[order[start]]:
            stop += 1
        for k in order[start : stop + 1]:  # ties share their mean rank
            ranks[k] = (start + stop) / 2.0
        start = stop + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation of ``x`` and ``y`` (ties get mean
    ranks; NaN pairs dropped); NaN with fewer than 3 pairs or a constant
    side."""
    pairs = [(a, b) for a, b in zip(x, y, strict=True) if math.isfinite(a) and math.isfinite(b)]
    if len(pairs) < 3:
        return math.nan
    rx = _ranks([a for a, _ in pairs])
    ry = _ranks([b for _, b in pairs])
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return math.nan
    return sxy / math.sqrt(sxx * syy)
