"""Paired standard errors of task accuracies: two models scored on the same
documents differ by less noise than either average carries alone, since a
document hard for one is mostly hard for the other."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

__all__ = ["paired_stderr"]


def paired_stderr(
    mine: Mapping[str, Sequence[float]],
    theirs: Mapping[str, Sequence[float]],
    tasks: Iterable[str] | None = None,
) -> float | None:
    """The standard error of the difference of two unweighted averages of
    task accuracies, ``mine`` and ``theirs`` each a task's per-document
    scores in the same document order: per task, the sample variance of the
    per-document differences over their count; the average's is their sum
    over the squared number of tasks. ``tasks``: those of the average (default
    ``mine``'s). None when a task's documents are missing from either, differ
    in number or are fewer than two."""
    names = list(mine if tasks is None else tasks)
    if not names:
        return None
    total = 0.0
    for task in names:
        a, b = mine.get(task), theirs.get(task)
        if not a or not b or len(a) != len(b) or len(a) < 2:
            return None
        diffs = [x - y for x, y in zip(a, b, strict=True)]
        mean = sum(diffs) / len(diffs)
        variance = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
        total += variance / len(diffs)
    return math.sqrt(total) / len(names)
