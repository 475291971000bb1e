"""Which candidates a search measures, and in what order.

A size target (parameters, MACs, latency, blocks) fixes which candidates
qualify before any is measured: :class:`Ranked` measures the best-predicted
ones, taking each family in turn (predicted errors compare within a family
only; :func:`toast.methods.choice.by_family`, whose first pick is what
``toast.compress`` applies). A quality floor does not: :class:`Bisection` searches each family
for its smallest model within the floor, halving the range of sizes with
every measurement (the best-predicted candidate stands for each size), so
``k`` measurements resolve ``2^k`` sizes per family.
"""

from __future__ import annotations

from collections.abc import Sequence

from toast.methods.base import Plan
from toast.methods.choice import by_family

__all__ = ["Bisection", "Ranked", "by_family"]


class Ranked:
    """The ``limit`` best-predicted candidates, one family at a time."""

    def __init__(self, candidates: Sequence[Plan], limit: int) -> None:
        queues = list(by_family(candidates).values())
        self.queue: list[Plan] = []
        while len(self.queue) < limit and any(queues):
            for q in queues:
                if q and len(self.queue) < limit:
                    self.queue.append(q.pop(0))

    def next(self) -> Plan | None:
        return self.queue.pop(0) if self.queue else None

    def tell(self, candidate: Plan, meets: bool) -> None:
        """A ranked selection does not depend on what was measured."""


class Bisection:
    """Per family, the smallest size whose best-predicted candidate meets
    the target, found by bisection over the family's sizes (assuming a
    larger model never measures worse); families take turns, ``limit``
    measurements in all."""

    def __init__(self, candidates: Sequence[Plan], limit: int) -> None:
        self.levels: dict[str, list[Plan]] = {}
        for family, ranked in by_family(candidates).items():
            best: dict[int, Plan] = {}
            for c in ranked:  # best predicted first: the first of each size stays
                best.setdefault(c.params_after, c)
            self.levels[family] = [best[p] for p in sorted(best, reverse=True)]
        # levels[f][lo] is known to meet the target, levels[f][hi] to miss it
        self.bounds = {f: [-1, len(levels)] for f, levels in self.levels.items()}
        self.limit, self.turn = limit, 0
        self.pending: tuple[str, int] | None = None

    def next(self) -> Plan | None:
        open_ = [f for f, (lo, hi) in self.bounds.items() if hi - lo > 1]
        if self.limit <= 0 or not open_:
            return None
        family = open_[self.turn % len(open_)]
        self.turn += 1
        self.limit -= 1
        lo, hi = self.bounds[family]
        middle = (lo + hi) // 2
        self.pending = (family, middle)
        return self.levels[family][middle]

    def tell(self, candidate: Plan, meets: bool) -> None:
        assert self.pending is not None  # next() came first
        family, middle = self.pending
        self.bounds[family][0 if meets else 1] = middle
        self.pending = None
