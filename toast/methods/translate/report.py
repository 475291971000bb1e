"""What ``toast.compress(..., method="toast")`` reports."""

from __future__ import annotations

from dataclasses import dataclass, field

from toast.hf.evaluate.check import RemovalCheck, check_lines
from toast.methods.base import Report
from toast.methods.translate.analysis import Analysis
from toast.methods.translate.check import MeasuredPlans
from toast.spans import Span

__all__ = ["CompressionReport"]


@dataclass
class CompressionReport(Report):
    """What :func:`toast.compress` did with ``method="toast"``: the spans
    replaced, their predicted errors and fit conditions, blocks and
    parameters before and after, and the analysis it planned from;
    ``checks`` each span's held-out comparison with plain removal,
    ``check_note`` why there is none, ``refitted`` whether the fits it kept
    were fitted again on every batch, ``measured`` the candidate plans its
    choice measured (None: the plan was the best predicted, or given;
    ``measure_note`` says why)."""

    method: str
    translator: str
    spans: list[Span]
    conditions: list[float]
    blocks_before: int
    blocks_after: int
    params_before: int
    params_after: int
    rows: int
    analysis: Analysis = field(repr=False)
    fit: str = "independent"
    ranks: list[int | None] = field(default_factory=list)
    width: int | None = None
    checks: list[RemovalCheck | None] = field(default_factory=list)
    check_note: str = ""
    #: whether the translators the check kept were fitted again on every batch
    refitted: bool = False
    #: spans whose refit measured worse than plain removal held out: removed plainly
    refit_fallbacks: list[Span] = field(default_factory=list)
    measured: MeasuredPlans | None = None
    #: why the candidate plans were not measured ("": they were, or there was one)
    measure_note: str = ""

    @property
    def blocks_removed(self) -> int:
        # the translator blocks stand in for their spans: count every replaced block
        return sum(s.num_blocks for s in self.spans)

    def _condition(self, condition: float, rank: int | None) -> str:
        """A fit's condition; a singular one by its rank (post-LN states lose one
        direction by construction, which "inf" alone would hide)."""
        if condition != condition:  # NaN: a trained translator
            return "—"
        if condition == float("inf") and rank is not None and self.width is not None:
            return f"singular, rank {rank} of {self.width}"
        return f"{condition:.3g}"

    def to_markdown(self) -> str:
        lines = [
            f"**{self.method}**: {self.blocks_removed} of {self.blocks_before} blocks replaced "
            f"by {len(self.spans)} {self.translator} translator(s) "
            f"({self.fit} fit), analysed on {self.rows} rows.",
            "",
            "| blocks | paper (s→e) | predicted error | condition |",
            "|---|---|---:|---:|",
        ]
        for k, (span, cond) in enumerate(zip(self.spans, self.conditions, strict=True)):
            shown = self._condition(cond, self.ranks[k] if k < len(self.ranks) else None)
            lines.append(
                f"| [{span.start}:{span.stop}] | {span.paper} | {span.error:.4g} | {shown} |"
            )
        lines += [
            "",
            f"{self.params_line()}; transformer blocks: "
            f"{self.blocks_before} → {self.blocks_before - self.blocks_removed} "
            f"(−{100 * self.compression_by_blocks:.1f}%), plus {len(self.spans)} translator(s).",
            *(self.measured.lines() if self.measured is not None else []),
            *([f"Measured choice: {self.measure_note}."] if self.measure_note else []),
            *check_lines(self.checks, self.check_note),
        ]
        if self.refitted:
            lines.append(
                "The fits the check kept were then fitted again on every calibration batch, "
                "the held-out ones too (refit=True)."
            )
        for span in self.refit_fallbacks:
            lines.append(
                f"The refit of blocks[{span.start}:{span.stop}] measured worse than plain "
                "removal on the held-out batches: plain removal kept."
            )
        return "\n".join(lines) + self.quality_markdown()
