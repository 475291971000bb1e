"""What :func:`toast.methods.replaceme.replaceme` did: the cuts in both index notations, the
transforms, and the compression by parameters (the ReplaceMe paper's
Eq. 10) and by blocks.

Shopkhoev et al., "ReplaceMe" (arXiv 2505.02819): a cut ``blocks[s:e]``
of toast is the paper's ``i* → i* + n`` with ``i* = s − 1`` and the
reference code's block tuple ``(s, e)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from toast.hf.evaluate.check import check_lines
from toast.methods.base import Report
from toast.methods.replaceme.auto import PlacementTrial
from toast.methods.replaceme.check import RemovalCheck
from toast.methods.replaceme.params import compression_ratio
from toast.methods.replaceme.profile import DistanceProfile
from toast.spans import Span

__all__ = ["ReplaceMeReport"]

_OBJECTIVES = {
    "ls": "least-squares",
    "cosine": "cosine",
    "identity": "identity (UIDL: plain removal)",
}
_PLACEMENTS = {
    "fold": "folded into the down-projection (a diagonal T into a norm after it)",
    "mlp": "kept as a separate d×d module after the down-projection",
    "block": "as a separate d×d block on the residual stream (A.9)",
}

#: The column naming each cut's score, by selection (else the distance).
_SCORES = {
    "block_influence": "block influence (ShortGPT)",
    "sleb": "perplexity after SLEB",
    "predicted": "predicted LS error",
}


def _number(value: float, spec: str) -> str:
    return "—" if value != value else format(value, spec)  # NaN: nothing was measured


@dataclass
class ReplaceMeReport(Report):
    """What :func:`toast.methods.replaceme.replaceme` did.

    ``spans`` are the cuts (``Span.error`` holds the selection distance, NaN
    when the spans were given); ``transforms`` the fitted T (float64, the
    row-vector convention ``M T``; None for ``objective="identity"``);
    ``conditions`` the LS Gram conditioning (NaN otherwise); ``objectives``
    the cosine objective before and after training per cut (None for LS).
    ``buffer_bytes`` and ``rows_kept`` describe the cosine row buffers.
    ``checks`` holds each cut's held-out comparison with plain removal (None
    where nothing was fitted), ``check_note`` why there is none;
    ``candidates`` every window the held-out batches chose the cut from
    (empty when the distance alone chose). ``placement_note`` says why
    ``placement="auto"`` chose the placement it did ("" where the
    transform folds as asked), ``placements`` what each exact placement
    measured on the held-out batches (empty when none was measured).
    ``selection`` is the rule that chose the cuts (``"spans"`` when they
    were given; the score each
    ``Span.error`` holds: see :class:`~toast.methods.replaceme.ReplaceMeConfig`).
    """

    objective: str
    structure: str
    placement: str
    metric: str
    spans: list[Span]
    transforms: list[np.ndarray | None] = field(repr=False)
    conditions: list[float]
    objectives: list[tuple[float, float] | None]
    blocks_before: int
    blocks_after: int
    params_before: int
    params_after: int
    rows: int
    profile: DistanceProfile | None = field(default=None, repr=False)
    buffer_bytes: int = 0
    rows_kept: int = 0
    method: str = "replaceme"
    fit: str = "independent"
    checks: list[RemovalCheck | None] = field(default_factory=list)
    check_note: str = ""
    candidates: list[RemovalCheck] = field(default_factory=list)
    placement_note: str = ""
    placements: list[PlacementTrial] = field(default_factory=list)
    selection: str = "measured"

    @property
    def blocks_removed(self) -> int:
        # a linear block of the "block" placement stands in for its cut, as
        # TOAST's translator blocks do: every block of every cut is removed
        return sum(s.num_blocks for s in self.spans)

    @property
    def eq10_ratio(self) -> float:
        """The paper's Eq. 10 compression ratio, in percent."""
        return compression_ratio(self.params_before, self.params_after)

    def _linear_blocks(self) -> str:
        kept = self.blocks_after - (self.blocks_before - self.blocks_removed)
        return f", and {kept} linear block(s) of d² parameters" if kept > 0 else ""

    def _cut_line(self, k: int) -> str:
        span, obj = self.spans[k], self.objectives[k]
        trained = "—" if obj is None else f"{obj[0]:.5g} → {obj[1]:.5g}"
        return (
            f"| blocks[{span.start}:{span.stop}] | {span.paper} | "
            f"({span.start}, {span.stop}) | {_number(span.error, '.4g')} | "
            f"{_number(self.conditions[k], '.3g')} | {trained} |"
        )

    def to_markdown(self) -> str:
        if self.objective == "identity":
            data = "no fit" if self.profile is None else f"cut chosen on {self.profile.rows:,} rows"
            what_fit = f"({data})"
        else:
            what_fit = f"({self.fit} fit, {self.rows:,} calibration rows)"
        lines = [
            f"**ReplaceMe** ({_OBJECTIVES[self.objective]}, {self.structure} T, "
            f"{_PLACEMENTS[self.placement]}): {self.blocks_removed} of "
            f"{self.blocks_before} blocks removed in {len(self.spans)} cut(s) {what_fit}.",
            "",
            "| cut (toast) | paper i*→i*+n | reference (start, end) | "
            f"{self._score_name()} | LS condition | cosine objective |",
            "|---|---|---|---:|---:|---|",
            *(self._cut_line(k) for k in range(len(self.spans))),
            "",
            f"Parameters: {self.params_before:,} → {self.params_after:,}; compression "
            f"{self.eq10_ratio:.2f}% by parameters (Eq. 10), "
            f"{100 * self.compression_by_blocks:.2f}% by blocks "
            f"({self.blocks_before} → {self.blocks_before - self.blocks_removed}"
            f"{self._linear_blocks()}).",
        ]
        if self.buffer_bytes:
            lines.append(
                f"Cosine rows: {self.rows_kept:,} kept of {self.rows:,} in a "
                f"{self.buffer_bytes / 2**20:,.1f} MiB disk buffer."
            )
        lines += self._check_lines() + self._placement_lines()
        return "\n".join(lines) + self.quality_markdown()

    def _candidate_line(self, check: RemovalCheck) -> str:
        if check.span != self.spans[0]:
            return check.measured()
        has = "the fit" if check.used == "fitted" else "plain removal"
        return f"**{check.measured()}: the cut, with {has}**"

    def _score_name(self) -> str:
        """What ``Span.error`` holds, by the selection that chose the cuts."""
        return _SCORES.get(self.selection, f"{self.metric} distance")

    def _placement_lines(self) -> list[str]:
        if not self.placement_note:
            return []
        return [
            "",
            f"Placement (auto): {self.placement_note}.",
            *(f"- {t.describe()}" for t in self.placements),
        ]

    def _check_lines(self) -> list[str]:
        if self.candidates:
            return [
                "",
                f"Cut chosen on held-out batches among the {len(self.candidates)} windows of "
                "smallest distance or predicted error, each fitted and measured against its "
                "plain removal:",
                *(f"- {self._candidate_line(c)}" for c in self.candidates),
            ]
        return check_lines(self.checks, self.check_note)
