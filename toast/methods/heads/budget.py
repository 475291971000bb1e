"""TCS schedules found against a MAC budget.

ToaSt's hand-made schedules (paper Table 19, "fc2_heavy") prune FC2's
hidden channels in the deepest blocks first and only then FC1's input
channels; :func:`fc2_heavy` builds the least aggressive schedule of that
shape whose MACs (:func:`toast.methods.heads.macs.toast_macs`) meet a
budget. It sits apart from :mod:`~toast.methods.heads.schedules`
because it needs the MAC counter, which itself reads schedules.

This module does not import torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from toast.methods.heads.macs import toast_macs
from toast.methods.heads.schedules import Schedule

__all__ = ["fc2_heavy"]


def fc2_heavy(
    config: Any,
    target_gmacs: float,
    *,
    head_sparsity: float = 0.9,
    skip: Sequence[int] = (0,),
    fc2_max: float = 0.9,
    fc1_max: float = 0.5,
    step: float = 0.1,
    sample_ratio: float | None = None,
    image_size: int | None = None,
) -> Schedule:
    """The least aggressive fc2-heavy schedule whose ToaSt MACs (see
    :func:`toast.methods.heads.macs.toast_macs`) are at most
    ``target_gmacs``.

    The pattern of the paper's hand-made schedules ("fc2_heavy", Table 19):
    FC2 ratios fill from the deepest block towards the input, each block up
    to ``fc2_max``; only when every prunable block has FC2 at ``fc2_max``
    do FC1 ratios fill the same way, up to ``fc1_max``. Ratios move in
    steps of ``step`` and the block where the budget is met gets the
    smallest step count that meets it, so the result is within one step of
    one block of the budget. Blocks in ``skip`` get no TCS. Raises
    ``ValueError`` when even the most aggressive pattern misses the budget.
    """
    num_blocks = toast_macs(config, image_size=image_size).num_blocks
    if sample_ratio is None:
        sample_ratio = 0.2 if getattr(config, "model_type", "") == "swin" else 0.02
    base = Schedule(
        (0.0,) * num_blocks, (0.0,) * num_blocks, head_sparsity, sample_ratio, "fc2_heavy"
    )

    def cost(s: Schedule) -> float:
        return toast_macs(config, schedule=s, skip=skip, image_size=image_size).gmacs

    if cost(base) <= target_gmacs:
        return replace(base, reported_gmacs=None)
    order = [b for b in reversed(range(num_blocks)) if b not in set(skip)]
    levels = [round(step * k, 10) for k in range(1, int(round(1 / step)))]
    r1, r2 = [0.0] * num_blocks, [0.0] * num_blocks
    for ratios, top in ((r2, fc2_max), (r1, fc1_max)):
        for b in order:
            for level in (x for x in levels if x <= top + 1e-12):
                ratios[b] = level
                trial = replace(base, fc1=tuple(r1), fc2=tuple(r2))
                if cost(trial) <= target_gmacs:
                    return replace(trial, name=f"fc2_heavy@{target_gmacs:g}")
    raise ValueError(
        f"no fc2-heavy schedule reaches {target_gmacs} GMACs (the most aggressive one "
        f"costs {cost(replace(base, fc1=tuple(r1), fc2=tuple(r2))):.3f}); lower "
        "fc2_max/fc1_max limits or raise the budget"
    )
