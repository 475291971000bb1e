"""Which blocks ReplaceMe removes: explicit spans, checked against the
model, or the windows of smallest distance from a profile pass.

Shopkhoev et al., "ReplaceMe" (arXiv 2505.02819), §3.1: the transform of a
cut goes into the block before it, so a folded cut never starts at block
0 and two folded cuts never touch (the second one's target block would be
removed by the first).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from toast.hf.model.blocks import BlockStack
from toast.methods.replaceme.config import ReplaceMeConfig
from toast.methods.replaceme.hooks import no_kv_cache
from toast.methods.replaceme.profile import (
    DistanceProfile,
    ProfileRows,
    check_selection,
    profile_distances,
    select_windows,
)
from toast.methods.selection import (
    block_influence,
    lowest_blocks,
    predicted_errors,
    runs,
    sleb,
    span_scores,
)
from toast.spans import Span, validate_spans

__all__ = [
    "candidate_cuts",
    "check_spans",
    "choose_cuts",
    "predicted_windows",
    "rule_cuts",
    "unmeasured_cut",
]


def check_spans(
    spans: Sequence[tuple[int, int]], total: int, placement: str
) -> list[tuple[int, int]]:
    """``spans`` sorted and checked for a model of ``total`` blocks: inside
    it, not overlapping, not removing every block, and (unless the
    transform is a separate block) leaving a block before each cut to fold
    into."""
    checked = validate_spans(spans, total)
    if sum(b - a for a, b in checked) >= total:
        raise ValueError(f"spans {checked} would remove every one of the {total} blocks")
    if placement == "block":
        return checked
    for a, b in checked:
        if a < 1:
            raise ValueError(
                f"span ({a}, {b}) starts at block 0: the transform is folded into the block "
                "before the cut, so a cut must start at block 1 or later"
            )
    for (a1, b1), (a2, b2) in zip(checked, checked[1:], strict=False):
        if b1 == a2:
            raise ValueError(
                f"spans ({a1}, {b1}) and ({a2}, {b2}) are adjacent: the second one's "
                f"transform would go into block {a2 - 1}, which the first removes; merge "
                f"them into ({a1}, {b2}) or keep a block between them"
            )
    return checked


def choose_cuts(
    model: nn.Module, data: Iterable, config: ReplaceMeConfig, stack: BlockStack
) -> tuple[list[Span], DistanceProfile | None]:
    """The cuts of ``config`` on ``model``, and the distance profile they were
    chosen from (None for explicit spans, whose ``Span.error`` is NaN)."""
    total = stack.num_blocks
    if config.spans is not None:
        return explicit_cuts(config, total), None
    num_blocks = config.num_blocks
    assert num_blocks is not None  # ReplaceMeConfig requires it without spans
    # Checked before the profile pass, so that a bad request fails at once.
    check_selection(num_blocks, config.num_cuts, config.min_start, total)
    if config.selection not in ("distance", "measured"):
        return rule_cuts(model, data, config, stack), None
    tokens, padding = config.distance_tokens, config.include_padding
    if _measures_candidates(config) and config.predicted_candidates:
        # the distances from the moments pass's own states: one pass, not two
        rows = ProfileRows(tokens, padding)
        with no_kv_cache(model):
            predicted = predicted_windows(model, data, config, stack, observe=rows)
        profile = rows.profile(stack.path)
        profile.predicted = predicted
    else:
        profile = profile_distances(
            model,
            data,
            tokens=tokens,
            include_padding=padding,
            calibration=config.calibration,
            stack=stack,
        )
    return select_cuts(profile, config, total), profile


def predicted_windows(
    model: nn.Module,
    data: Iterable,
    config: ReplaceMeConfig,
    stack: BlockStack,
    observe: Callable[[list[torch.Tensor], torch.Tensor | None], Any] | None = None,
) -> list[Span]:
    """The ``config.predicted_candidates`` windows of ``num_blocks`` blocks
    of smallest predicted least-squares error (one moments pass, whose
    states ``observe`` sees too), none starting before ``min_start``."""
    n = config.num_blocks
    assert n is not None  # ReplaceMeConfig requires it without spans
    table = predicted_errors(
        model, data, stack, config.calibration, config.backend, n, observe=observe
    )
    starts = range(config.min_start, stack.num_blocks - n + 1)
    found = [Span(a, a + n, float(table[a, a + n])) for a in starts if np.isfinite(table[a, a + n])]
    found.sort(key=lambda s: (s.error, s.start))
    return found[: config.predicted_candidates]


def unmeasured_cut(
    spans: list[Span], profile: DistanceProfile | None, config: ReplaceMeConfig, note: str
) -> tuple[list[Span], str]:
    """The cut when ``note`` says no held-out batch can measure the
    candidates: the window of smallest predicted least-squares error where
    it was computed (it estimates the held-out error of the fit itself; on
    SmolLM2 at 2 of 30 blocks its window measured 27.0 against the
    distance's 30.3, ``benchmarks/bench_peers.py``), else the distance's;
    and the note saying so."""
    if not note or profile is None or not profile.predicted:
        return spans, note
    best = profile.predicted[0]
    distance = float(profile.matrix(config.distance)[best.start, best.stop])
    why = "; the cut is the window of smallest predicted least-squares error"
    return [Span(best.start, best.stop, distance)], note + why


def _measures_candidates(config: ReplaceMeConfig) -> bool:
    """Whether the cut is chosen among candidates measured on held-out batches."""
    return (
        config.selection == "measured"
        and config.check_fraction > 0
        and config.fit == "independent"
        and config.candidates >= 2
        and config.num_cuts == 1
        and config.objective != "identity"
    )


def explicit_cuts(config: ReplaceMeConfig, total: int) -> list[Span]:
    """``config.spans`` checked as cuts of a model of ``total`` blocks
    (``Span.error`` is NaN: no profile measured them)."""
    assert config.spans is not None
    checked = check_spans(config.spans, total, config.placement)
    removed = sum(b - a for a, b in checked)
    if config.num_blocks is not None and config.num_blocks != removed:
        raise ValueError(f"num_blocks={config.num_blocks} but the spans remove {removed}")
    return [Span(a, b, float("nan")) for a, b in checked]


def select_cuts(profile: DistanceProfile, config: ReplaceMeConfig, total: int) -> list[Span]:
    """The cuts ``config`` asks for, chosen from ``profile`` and checked."""
    assert config.num_blocks is not None  # ReplaceMeConfig requires it without spans
    chosen = profile.select(
        config.num_blocks,
        config.num_cuts,
        metric=config.distance,
        min_start=config.min_start,
        adjacent=config.adjacent,
    )
    check_spans([(s.start, s.stop) for s in chosen], total, config.placement)
    return chosen


def rule_cuts(
    model: nn.Module, data: Iterable, config: ReplaceMeConfig, stack: BlockStack
) -> list[Span]:
    """The cuts of ``config.selection`` beyond the distance (see
    :mod:`toast.methods.selection`), checked; each ``Span.error`` is the
    rule's score of the cut."""
    n, cal, start = config.num_blocks, config.calibration, config.min_start
    assert n is not None  # ReplaceMeConfig requires it without spans
    if config.selection == "predicted":
        table = predicted_errors(model, data, stack, cal, config.backend, n // config.num_cuts)
        chosen = select_windows(
            table, n, config.num_cuts, min_start=start, adjacent=config.adjacent
        )
    elif config.selection == "block_influence":
        scores = block_influence(model, data, cal, stack, config.include_padding)
        where = runs(lowest_blocks(scores, n, start))
        chosen = [
            Span(a, b, e) for (a, b), e in zip(where, span_scores(scores, where), strict=True)
        ]
    else:  # "sleb"
        found = sleb(model, data, stack, n, start, progress=cal.progress)
        chosen = [Span(a, b, found.scores[-1]) for a, b in runs(found.blocks)]
    check_spans([(s.start, s.stop) for s in chosen], stack.num_blocks, config.placement)
    return chosen


def candidate_cuts(profile: DistanceProfile | None, config: ReplaceMeConfig) -> list[Span]:
    """The windows the held-out batches choose the cut from: the
    ``config.candidates`` of smallest distance, then the profile's windows
    of smallest predicted error not among them, for one chosen cut of a
    fitted objective with ``selection="measured"``; empty when the rule
    alone chooses (another selection, explicit spans, several cuts, plain
    removal, ``candidates=1``)."""
    if profile is None or not _measures_candidates(config):
        return []
    assert config.num_blocks is not None  # ReplaceMeConfig requires it without spans
    closest = profile.ranked(
        config.num_blocks, config.candidates, metric=config.distance, min_start=config.min_start
    )
    seen = {(s.start, s.stop) for s in closest}
    return closest + [s for s in profile.predicted if (s.start, s.stop) not in seen]
