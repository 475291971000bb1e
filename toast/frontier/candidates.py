"""Every compression a search may pick, with its size and predicted error
known before any is built: each searched method's proposed
:class:`~toast.methods.base.Plan` s (plain removal, TOAST translators,
ReplaceMe cuts, ToaSt head pruning and Token Channel Selection, token
merging), and every extendable plan extended by the methods that extend
others, in chains (block removal, then ToaSt's head pruning, then token
merging). Sizes are exact parameter counts from the model's own modules;
predictions are each method's own, so they compare within a family only,
and a search measures the best-predicted plans of each family in turn.
"""

from __future__ import annotations

import math

from toast.methods.base import Method, Plan, Sizes
from toast.methods.calibrate import Calibrated

__all__ = ["enumerate_candidates"]


def enumerate_candidates(
    methods: list[Method],
    calibrated: Calibrated,
    sizes: Sizes,
    max_blocks: int,
    macs_matter: bool = False,
) -> list[Plan]:
    """Every plan removing at most ``max_blocks`` blocks (plans that save
    only MACs, such as Token Channel Selection, only with
    ``macs_matter``), deduplicated, finite predictions only, in no
    particular order."""
    found: dict[str, Plan] = {}
    # a method the disk path left out has no stats
    methods = [m for m in methods if m.name in calibrated.stats]
    for method in methods:
        stats = calibrated.stats[method.name]
        for plan in method.stages.propose(stats, sizes, max_blocks, macs_matter):
            found.setdefault(plan.key, plan)
    # Extensions chain (block removal + heads + merging), each method at most
    # once and in one order, so that one combination has one key: by name,
    # with the methods that act on the tokens at run time last (a reducer
    # extends a plan; nothing extends a reducer's).
    methods = sorted(methods, key=lambda m: (bool(getattr(m.stages, "chain_last", False)), m.name))
    order = {m.name: k for k, m in enumerate(methods)}
    bases = [plan for plan in found.values() if plan.extendable]
    while bases:
        extended = []
        for base in bases:
            last = max(order.get(name, -1) for name in base.methods)
            for method in methods[last + 1 :]:
                stats = calibrated.stats[method.name]
                for plan in method.stages.extend(base, stats, sizes):
                    if plan.key not in found:
                        found[plan.key] = plan
                        extended.append(plan)
        bases = extended
    return [plan for plan in found.values() if math.isfinite(plan.predicted_error)]
