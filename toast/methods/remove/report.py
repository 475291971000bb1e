"""Plain removal's report: the spans deleted and the score that chose them."""

from __future__ import annotations

from dataclasses import dataclass

from toast.methods.base import Report
from toast.spans import Span

__all__ = ["RemoveReport"]

#: The column naming each span's score, by selection.
_SCORES = {"block_influence": "block influence (ShortGPT)", "sleb": "perplexity after SLEB"}


@dataclass
class RemoveReport(Report):
    """What plain removal did: the spans deleted, with the score that chose
    them (``selection``: identity-span error by default, summed block
    influence, SLEB's perplexity; NaN when given)."""

    method: str
    spans: list[Span]
    blocks_before: int
    blocks_after: int
    params_before: int
    params_after: int
    selection: str = "error"

    def to_markdown(self) -> str:
        score = _SCORES.get(self.selection, "identity error")
        lines = [
            f"**{self.method}**: {self.blocks_removed} of {self.blocks_before} blocks removed.",
            "",
            f"| blocks | paper (s→e) | {score} |",
            "|---|---|---:|",
            *(f"| [{s.start}:{s.stop}] | {s.paper} | {s.error:.4g} |" for s in self.spans),
            "",
            self.params_line(),
        ]
        return "\n".join(lines) + self.quality_markdown()
