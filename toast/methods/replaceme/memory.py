"""ReplaceMe's statistics within a memory budget (the block-by-block path's
plan, :meth:`toast.methods.stages.Stages.within_memory`)."""

from __future__ import annotations

import dataclasses

from toast.methods.replaceme.config import ReplaceMeConfig

__all__ = ["within_memory"]

#: ``d x d`` float64 panels each cut holds through the estimation pass: its
#: two-state moments of ``M`` and ``L − Y`` (``MᵀM``, ``Mᵀ(L − Y)`` and
#: ``(L − Y)ᵀ(L − Y)``, the upper blocks of the joint Gram).
PANELS_PER_CUT = 3
#: ``d x d`` float64 matrices the solve of one cut holds beside every cut's
#: moments: the core's system, right-hand side and scratch, the factor, the
#: eigensolver's workspace (two, touched when Cholesky fails and the
#: eigendecomposition takes over) and the transform returned. Measured with
#: the moments held (as every structure but a full T solves): 7.4 at
#: d = 1,024 and 7.03 at d = 2,048 when the eigendecomposition takes over
#: (4 were counted, and
#: a cut's moments as 2: the 0.92 B benchmark's first estimation pass, three
#: cuts and a solve, then peaked at 1,340 MiB within a plan of 1,007.6).
SOLVE_MATRICES = 8
#: The same for a full ``T`` (the default), whose solve reads ``MᵀM`` and
#: ``Mᵀ(L − Y)`` out of the moments and frees them first: above the
#: moments it replaces, 4.9 at d = 1,024 and 5.35 at d = 2,048 measured.
SOLVE_MATRICES_FULL = 6


def _cuts_fitted(config: ReplaceMeConfig) -> int:
    """The cuts the first estimation pass fits: every candidate window when
    the cut is chosen by measurement, else the cuts themselves."""
    if config.objective == "identity":
        return 0
    if config.spans is not None:
        return len(config.spans)
    if config.selection == "measured" and config.num_cuts == 1 and config.candidates > 1:
        return config.candidates
    return config.num_cuts


def within_memory(
    config: ReplaceMeConfig, states: int, width: int, room: int
) -> tuple[ReplaceMeConfig, list[tuple[str, int]]]:
    """``config`` with ``cuts_at_once`` lowered so that the cuts fitted in
    one pass fit ``room`` bytes (one at least) beside the transforms fitted
    so far, and what they take: the statistics of a pass (formed after
    stage 0, freed before the held-out passes) and, last, the transforms
    kept to the end (``d x d`` float64 each)."""
    cuts = _cuts_fitted(config)
    if cuts == 0:
        return config, []
    per_cut = PANELS_PER_CUT * width * width * 8
    matrices = SOLVE_MATRICES_FULL if config.structure == "full" else SOLVE_MATRICES
    solve = matrices * width * width * 8
    kept = cuts * width * width * 8
    at_once = min(cuts, config.cuts_at_once or cuts)
    fits = max(1, (room - solve - kept) // per_cut)
    if fits < at_once:
        at_once = int(fits)
        config = dataclasses.replace(config, cuts_at_once=at_once)
    label = f"statistics ({at_once} of {cuts} cut(s) a pass)"
    return config, [(label, at_once * per_cut + solve), (f"{cuts} transform(s) kept", kept)]
