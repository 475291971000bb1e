"""TOAST's statistics within a memory budget (the block-by-block path's
plan, :meth:`toast.methods.stages.Stages.within_memory`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from toast.core import Moments
from toast.core.chunked import JOIN_BYTES, pair_nbytes, resolve_bound, workspace_nbytes
from toast.hf.evaluate.check import CheckSplit
from toast.methods.translate.analysis import enough_for_gcv
from toast.methods.translate.config import ToastConfig

__all__ = ["within_memory"]


def _with_folds(config: ToastConfig, width: int, tokens: Sequence[int] | None) -> bool:
    """Whether the analysis forms fold statistics: with ``"cv"``, and with
    ``"auto"`` (a linear metric) when the rows it sees are few for GCV
    (:func:`toast.methods.translate.analysis.enough_for_gcv`: it then passes
    again with folds). It sees every token (``tokens="all"``) of the
    batches the held-out check leaves (:class:`CheckSplit` over each
    batch's ``tokens``); with another ``tokens``, unknown batches, or one
    batch split by sequence, the folds are counted."""
    if config.estimator == "cv":
        return True
    if config.estimator != "auto" or config.metric not in ("linear", "affine"):
        return False
    fraction = 0.0 if config.fit == "sequential" else config.check_fraction
    if tokens is None or config.tokens != "all" or (len(tokens) == 1 and fraction > 0):
        return True
    seen = sum(CheckSplit(list(tokens), fraction).fit)
    return not enough_for_gcv(seen, width, config.folds)


def within_memory(
    config: ToastConfig, states: int, width: int, room: int, tokens: Sequence[int] | None = None
) -> tuple[ToastConfig, list[tuple[str, int]]]:
    """``config`` with ``statistics_bytes`` no larger than ``room`` leaves
    for the moments (the bound of every capture of the run, those beside
    the analysis's included; the whole moments counted with the workspace
    of the errors' solves; never below one pair's: the least any error matrix
    needs, without folds, which the analysis then falls back to), and what
    they take: the whole moments when they fit, else the chunked moments'
    bound with the rows replayed from disk at once. Counted with their
    folds where the analysis forms them (:func:`_with_folds`)."""
    folds = config.folds if _with_folds(config, width, tokens) else 0
    wanted = resolve_bound(config.statistics_bytes, width, folds)
    whole = Moments.estimate_nbytes(states, width, folds, config.pairs)
    # the errors' solves run beside the whole moments (the chunked bound counts them)
    solve = workspace_nbytes(width)
    if whole <= wanted and whole + solve <= room:
        if room < wanted:
            # what the measured choice captures beside the analysis is bounded by it too
            config = dataclasses.replace(config, statistics_bytes=room - solve)
        return config, [("moments", whole + solve)]
    least = pair_nbytes(width, 0)
    bound = max(min(wanted, room - JOIN_BYTES), least)
    if bound != config.statistics_bytes:
        config = dataclasses.replace(config, statistics_bytes=bound)
    return config, [("moments, chunked from disk", bound + JOIN_BYTES)]
