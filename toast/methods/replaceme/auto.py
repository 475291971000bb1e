"""``placement="auto"``: where ReplaceMe's transform goes when the caller
does not say, chosen so that no supported family is refused and the
default is never worse on the held-out batches than the block placement
of its cut.

Where T folds (the MLP output enters the residual stream through the
down-projection, or T is diagonal), the fold and the ``"block"`` placement
(the paper's A.9: T on the whole residual state, a linear block in place
of the cut) are both fitted and measured, the better kept (the fold on
ties and without held-out batches; only the fold from disk).

Shopkhoev et al., "ReplaceMe" (arXiv 2505.02819), §3, fold T into the
down-projection of the block before the cut. That is exact only where the
MLP output enters the residual stream through the down-projection alone.
Gemma 2/3 and OLMo-2 normalise it after the down-projection
(``post_feedforward_layernorm``), so a full T cannot be folded there; three
placements are still exact: a diagonal T folded into the norm's weight (a
standard checkpoint), the full T kept as a module after the norm
(``"mlp"``, ``d²`` parameters), or a transform block on the residual
stream (``"block"``, the paper's A.9). Which of them costs least is a
property of the model, so each is fitted and measured on the held-out
calibration batches (the same check that measures every fit against plain
removal, :func:`toast.methods.replaceme.estimate.fit_checked`) and the best
is kept; without held-out batches the first, the diagonal fold, is kept
(exact, no extra parameters, a standard checkpoint).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from toast.hf.evaluate.check import CheckSplit, RemovalCheck, best_candidate
from toast.methods.replaceme.config import ReplaceMeConfig
from toast.methods.replaceme.estimate import Fits, Fitted, fit_checked, refit_won
from toast.methods.replaceme.fold import residual_writer
from toast.spans import Span

__all__ = [
    "AutoResult",
    "PlacementTrial",
    "first_because",
    "fit_placements",
    "placement_options",
    "post_norm",
    "resolved",
]

#: An exact (placement, structure) where a norm follows the MLP, in the
#: order "auto" prefers them without a measurement.
Option = tuple[str, str]


@dataclass(frozen=True)
class PlacementTrial:
    """One placement ``"auto"`` fitted: what the model measured on the
    held-out batches with it (``check``: the last cut's check, whose model
    has every cut as decided; None when nothing was measured)."""

    placement: str
    structure: str
    check: RemovalCheck | None

    def describe(self) -> str:
        """The trial in words."""
        what = f"{self.structure} T, placement={self.placement!r}"
        if self.check is None:
            return f"{what}: not measured"
        c = self.check
        return f"{what}: {c.metric} {c.result:.4g} on {c.count:,} held-out tokens/samples"


def post_norm(blocks: Iterable[nn.Module], spans: Sequence[Span]) -> str | None:
    """The name of the norm after the MLP of a block receiving a cut's
    transform (None when every such block writes through its
    down-projection)."""
    listed = list(blocks)
    for span in spans:
        if span.start >= 1:
            writer = residual_writer(listed[span.start - 1])
            if writer.norm is not None:
                return writer.norm_path
    return None


def placement_options(
    blocks: Iterable[nn.Module],
    spans: Sequence[Span],
    config: ReplaceMeConfig,
    with_block: bool = True,
) -> tuple[list[Option], str]:
    """The (placement, structure) pairs to fit for ``spans`` (the cuts, or
    every candidate window), and why: the asked ones when the placement
    is explicit; for plain removal ``"fold"``; where T folds as asked (no
    norm after the MLP, or a diagonal T) ``"fold"`` and, with
    ``with_block``, the ``"block"`` placement of the same structure (a
    least-squares map of the whole residual state, which a fold of the MLP
    output alone cannot follow: on a real post-MLP-norm model of 18 blocks
    the last four blocks folded measured 6,954 where their block placement
    measured 108); else the exact ones, diagonal fold first."""
    if config.placement != "auto":
        return [(config.placement, config.structure)], ""
    norm = post_norm(blocks, spans)
    structure = config.structure
    if config.objective == "identity":
        return [("fold", structure)], ""
    if structure == "diagonal" or norm is None:
        if not with_block:
            return [("fold", structure)], ""
        into = "the down-projection" if norm is None else f"{norm}'s weight"
        why = (
            f"a {structure} T folds into {into}; the block placement of the same structure "
            "(a separate linear block after the cut) is measured against the fold"
        )
        return [("fold", structure), ("block", structure)], why
    options = [("fold", "diagonal"), ("mlp", structure), ("block", structure)]
    why = (
        f"{norm} normalises the MLP output after the down-projection, so a {structure} T "
        "does not fold there"
    )
    return options, why


def resolved(config: ReplaceMeConfig, option: Option) -> ReplaceMeConfig:
    """``config`` with one concrete placement and structure."""
    placement, structure = option
    if (config.placement, config.structure) == option:
        return config
    fields: dict[str, Any] = {"placement": placement, "structure": structure}
    return dataclasses.replace(config, **fields)


@dataclass
class AutoResult:
    """What :func:`fit_placements` kept: the estimation with the chosen
    options, its cuts, fits, rows used, checks and candidates, why this
    placement (``note``, "" for an explicit one) and every trial."""

    estimation: Fits
    spans: list[Span]
    fitted: list[Fitted]
    rows: int
    checks: list[RemovalCheck | None]
    candidates: list[RemovalCheck]
    note: str = ""
    trials: list[PlacementTrial] = dataclasses.field(default_factory=list)


def fit_placements(
    estimation: Fits,
    options: Sequence[Option],
    why: str,
    spans: list[Span],
    pool: list[Span],
    split: CheckSplit,
    note: str,
) -> AutoResult:
    """:func:`~toast.methods.replaceme.estimate.fit_checked` for each option
    (``estimation`` carries the first), the one whose model measured best
    on the held-out batches kept (the first on ties) and refitted on every
    batch; only the first without held-out batches (``note`` says why)."""
    if len(options) == 1 or note:
        chosen = estimation.configured(resolved(estimation.config, options[0]))
        result = fit_checked(chosen, spans, pool, split, note)
        placement, structure = options[0]
        said = "" if len(options) == 1 else first_because(why, placement, structure, note)
        return AutoResult(chosen, *result, note=said)
    trials_at = [estimation.configured(resolved(estimation.config, o)) for o in options]
    shared = _fitted_together(trials_at, pool or spans)
    runs = [
        (trial, fit_checked(trial, spans, pool, split, note, refit=False, fitted_already=fits))
        for trial, fits in zip(trials_at, shared, strict=True)
    ]
    trials = [
        PlacementTrial(p, s, _final_check(checks))
        for (p, s), (_, (_, _, _, checks, _)) in zip(options, runs, strict=True)
    ]
    measured = [t.check for t in trials if t.check is not None]
    k = 0
    if len(measured) == len(trials):
        k = best_candidate(measured)
    chosen, (cuts, fitted, rows, checks, candidates) = runs[k]
    fitted, rows = refit_won(chosen, cuts, fitted, split, rows)
    p, s = options[k]
    tied = sum(c.result == measured[k].result for c in measured) > 1 if measured else False
    said = f"{why}; the exact placements measured on held-out batches, {s} T {p!r} best" + (
        " (the first of equals)" if tied else ""
    )
    return AutoResult(chosen, cuts, fitted, rows, checks, candidates, said, trials)


def _fitted_together(trials: Sequence[Fits], cuts: Sequence[Span]) -> list[Any]:
    """Every option's fits of ``cuts`` from one estimation pass where they
    can share it (least squares, every cut at once: a few d x d moments
    each), else None for each (fitted in passes of their own: the cosine
    objective's row buffers are sized for one option)."""
    configs = [t.config for t in trials]
    if any(c.objective == "cosine" or c.cuts_at_once is not None for c in configs):
        return [None] * len(trials)
    return list(trials[0].fit_each(configs, cuts))


def first_because(why: str, placement: str, structure: str, note: str) -> str:
    """Why ``"auto"`` kept its first exact option unmeasured."""
    return (
        f"{why}; {structure} T {placement!r} kept, the first exact one (no held-out "
        f"measurement to choose among them: {note.removeprefix('none ').strip('()')})"
    )


def _final_check(checks: Sequence[RemovalCheck | None]) -> RemovalCheck | None:
    """The check that measured the model as it ends up: the last cut's,
    made with every earlier cut as decided (None when none was checked)."""
    done = [c for c in checks if c is not None]
    return done[-1] if done else None
