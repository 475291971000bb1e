"""TOAST's statistics within a memory budget (the block-by-block path's
plan, :meth:`toast.methods.stages.Stages.within_memory`)."""

from __future__ import annotations

import dataclasses

from toast.core import Moments
from toast.core.chunked import JOIN_BYTES, pair_nbytes, resolve_bound
from toast.methods.translate.config import ToastConfig

__all__ = ["within_memory"]


def within_memory(
    config: ToastConfig, states: int, width: int, room: int
) -> tuple[ToastConfig, list[tuple[str, int]]]:
    """``config`` with ``statistics_bytes`` no larger than ``room`` leaves
    for the moments (never below one pair's: the least any error matrix
    needs, without folds, which the analysis then falls back to), and what
    they take: the whole moments when they fit, else the chunked moments'
    bound with the rows replayed from disk at once."""
    folds = config.folds if config.estimator == "cv" else 0
    wanted = resolve_bound(config.statistics_bytes, width, folds)
    whole = Moments.estimate_nbytes(states, width, folds, config.pairs)
    if whole <= min(wanted, room):
        return config, [("moments", whole)]
    least = pair_nbytes(width, 0)
    bound = max(min(wanted, room - JOIN_BYTES), least)
    if bound != config.statistics_bytes:
        config = dataclasses.replace(config, statistics_bytes=bound)
    return config, [("moments, chunked from disk", bound + JOIN_BYTES)]
