"""ReplaceMe: remove a contiguous span of blocks and replace it by a linear
transform folded into the down-projection of the last kept block.

Shopkhoev et al., "ReplaceMe: Network Simplification via Depth Pruning and
Transformer Block Linearization" (arXiv 2505.02819). For a pre-norm block
``Y = X + Attn(X)``, ``M = MLP(Y)``, ``L = Y + M``. To remove ``n`` blocks
after block ``k``, ReplaceMe fits a ``d × d`` matrix T with
``M_k T + Y_k ≈ L_{k+n}`` (§3.2) and folds it into block ``k``'s MLP
output projection, so the compressed model is a standard, smaller
checkpoint of the same architecture with no extra parameters.

Steps, each its own module: the distance profile and the cut
(:mod:`~toast.methods.replaceme.profile`, :mod:`~toast.methods.replaceme.cuts`;
§3.1, Eq. 4), one pass estimating every transform
(:mod:`~toast.methods.replaceme.estimate`, least squares Eq. 6, or the
cosine objective of :mod:`~toast.methods.replaceme.cosine`, Eqs. 7-8),
then folding and removal (:mod:`~toast.methods.replaceme.fold`). Held-out
calibration batches (:mod:`~toast.methods.replaceme.check`) choose the
cut among the closest windows and check every fit against plain removal.
:func:`replaceme` runs them all, finding the model's blocks once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn

from toast.hf.model.blocks import find_blocks
from toast.hf.model.params import count_params
from toast.methods.base import BeforeSurgery, Method, register
from toast.methods.replaceme.auto import (
    AutoResult,
    first_because,
    fit_placements,
    placement_options,
    resolved,
)
from toast.methods.replaceme.check import CheckSplit
from toast.methods.replaceme.config import ReplaceMeConfig, distance_candidates_only
from toast.methods.replaceme.cuts import candidate_cuts, choose_cuts, unmeasured_cut
from toast.methods.replaceme.disk import replaceme_from_disk
from toast.methods.replaceme.estimate import Estimation, Fitted, check_note, fits_sequentially
from toast.methods.replaceme.fold import apply_cuts, check_cuts
from toast.methods.replaceme.memory import within_memory
from toast.methods.replaceme.profile import DistanceProfile
from toast.methods.replaceme.report import ReplaceMeReport
from toast.methods.replaceme.stages import STAGES
from toast.methods.runner import run_method, split_text_options
from toast.spans import Span

__all__ = ["replaceme"]


def replaceme(
    model: nn.Module,
    data: Any,
    config: ReplaceMeConfig | None = None,
    *,
    heldout: Any = None,
    **params: Any,
) -> tuple[nn.Module, ReplaceMeReport]:
    """Removes blocks of ``model`` by ReplaceMe, in place.

    ``config`` (a :class:`~toast.methods.replaceme.ReplaceMeConfig`, which
    documents every option) and/or its fields as keywords
    (``num_blocks=2, objective="cosine"``), with the calibration options
    (``max_samples``, ``seed``, ``progress``...; see
    :class:`toast.Calibration`) routed into its ``calibration``. ``data``
    is a loader of batches or raw text with ``tokenizer=`` (and
    ``max_length``, ``batch_size``, ``num_samples``, ``pack``, ``field``: see
    :func:`toast.compress`); ``heldout`` data adds measured perplexity of
    the original, plain removal and the pruned model to the report. A
    profile pass over ``data`` chooses the cut(s) unless ``spans`` are
    given, one more pass per fit estimates the transforms, and the blocks
    are folded and removed. Raises
    :class:`~toast.methods.replaceme.NotFoldableError` when a fold target's
    output does not move with its MLP output. Returns the model and a
    :class:`~toast.methods.replaceme.ReplaceMeReport`.
    """
    text, params = split_text_options(params)
    config = ReplaceMeConfig.from_options(config, params)
    if data is None:
        raise ValueError("ReplaceMe needs calibration data (a loader of batches, or raw text)")
    _, report = run_method(METHOD, model, data, config, heldout=heldout, text=text)
    assert isinstance(report, ReplaceMeReport)
    return model, report


def _replaceme(
    model: nn.Module,
    data: Iterable | None,
    config: ReplaceMeConfig,
    before_surgery: BeforeSurgery | None = None,
) -> tuple[nn.Module, ReplaceMeReport]:
    """The registered run: cut, estimate, fold (see :func:`replaceme`)."""
    assert data is not None  # the runner refuses None for a method that needs data
    stack = find_blocks(model, config.calibration.blocks)
    blocks_before, params_before = stack.num_blocks, count_params(model)
    split = CheckSplit(data, 0.0 if fits_sequentially(config) else config.check_fraction)
    spans, profile = choose_cuts(model, split.fit, config, stack)
    note = check_note(config, split, len(spans))
    spans, note = unmeasured_cut(spans, profile, config, note)
    pool = [] if note else candidate_cuts(profile, config)
    # the block placement is a candidate only where it can be measured
    options, why = placement_options(stack.blocks, pool or spans, config, with_block=not note)
    for placement, structure in options:
        check_cuts(stack, pool or spans, structure, placement, config.objective)
    expected_rows = profile.token_rows if profile is not None else None
    first = resolved(config, options[0])
    estimation = Estimation(model, split.fit, first, stack, expected_rows)
    fitting = config.objective != "identity"
    sequential = fitting and config.fit == "sequential" and len(spans) > 1
    if not fitting or sequential:
        said = first_because(why, *options[0], note) if len(options) > 1 else ""
        chosen = AutoResult(estimation, spans, [Fitted(None) for _ in spans], 0, [], [], said)
    else:
        chosen = fit_placements(estimation, options, why, spans, pool, split, note)
    assert isinstance(chosen.estimation, Estimation)
    estimation = chosen.estimation
    if before_surgery is not None:
        before_surgery(chosen.spans, stack)
    if sequential:
        chosen.fitted, chosen.rows = _fit_sequentially(estimation, chosen.spans)
    else:
        _apply(estimation, chosen.spans, chosen.fitted)
    counts = (blocks_before, find_blocks(model, stack).num_blocks)
    report = _report(estimation.config, chosen, profile, counts, params_before, model, note)
    return model, report


def _report(
    config: ReplaceMeConfig,
    chosen: AutoResult,
    profile: DistanceProfile | None,
    blocks: tuple[int, int],
    params_before: int,
    model: nn.Module,
    note: str,
) -> ReplaceMeReport:
    """The report of an in-memory run (``config`` with the placement used;
    ``note``: why nothing was checked on held-out batches)."""
    fitted = chosen.fitted
    return ReplaceMeReport(
        objective=config.objective,
        structure=config.structure,
        placement=config.placement,
        metric=config.distance,
        spans=chosen.spans,
        transforms=[f.transform for f in fitted],
        conditions=[f.condition for f in fitted],
        objectives=[f.objective for f in fitted],
        blocks_before=blocks[0],
        blocks_after=blocks[1],
        params_before=params_before,
        params_after=count_params(model),
        rows=chosen.rows,
        profile=profile,
        buffer_bytes=sum(f.buffer_bytes for f in fitted),
        rows_kept=sum(f.rows_kept for f in fitted),
        fit=config.fit,
        checks=chosen.checks,
        check_note=note,
        candidates=chosen.candidates,
        placement_note=chosen.note,
        placements=chosen.trials,
        selection=config.selection if config.spans is None else "spans",
    )


def _apply(estimation: Estimation, spans: Sequence[Span], fitted: Sequence[Fitted]) -> None:
    config = estimation.config
    transforms = [f.transform for f in fitted]
    apply_cuts(
        estimation.model, estimation.stack, spans, transforms, config.placement, config.structure
    )


def _fit_sequentially(estimation: Estimation, spans: Sequence[Span]) -> tuple[list[Fitted], int]:
    """Each cut estimated on the model with the previous cuts applied (the
    reference code's cosine multi-LT): one pass per cut. Cuts are given in
    the original model's indices and shifted by the blocks removed before
    them (a translator block keeps one place per cut)."""
    fitted: list[Fitted] = []
    rows, removed = 0, 0
    for span in spans:
        shift = removed if estimation.config.placement != "block" else removed - len(fitted)
        where = Span(span.start - shift, span.stop - shift, span.error)
        (one,), used = estimation.fit([where])
        rows = max(rows, used)
        fitted.append(one)
        _apply(estimation, [where], [one])
        estimation = estimation.after_surgery()  # the same path, the new block list
        removed += span.num_blocks
    return fitted, rows


METHOD = register(
    Method(
        name="replaceme",
        config=ReplaceMeConfig,
        run=_replaceme,
        summary="remove blocks, fold a least-squares or cosine transform into the last kept one",
        stages=STAGES,
        run_from_disk=replaceme_from_disk,
        within_memory=within_memory,
        statistics_apart=True,  # cuts open after stage 0; held-out passes keep transforms only
        on_either_path=distance_candidates_only,
    )
)
