"""The token reducers' report: what ``compress(..., method="tome" | "rapid" |
"token-transforming" | "atm" | "pitome")`` did (the tokens every block
removes and the MACs per image before and after), apart from the stages
that build it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from toast.methods.base import Report
from toast.methods.merge.macs import MergeMacs

__all__ = ["TITLES", "TomeReport"]

#: What a report calls each reducer.
TITLES = {
    "tome": "token merging",
    "rapid": "RAPID token pruning and merging",
    "token-transforming": "Token Transforming",
    "atm": "adaptive token merging (ATM)",
    "pitome": "PiToMe energy-protected token merging",
}


@dataclass
class TomeReport(Report):
    """What a token reducer's ``compress`` did: no block and no parameter
    removed; ``r`` per block (the tokens each block removes; for ATM the
    count on the data it ran on), and the MACs per image before and after
    (:mod:`toast.methods.merge.macs`, ToaSt's convention) with the tokens
    every block sees (averages over the images when they depend on them).
    ``macs_after`` is None when the counts depend on the images and no
    data was given."""

    method: str
    blocks_before: int
    blocks_after: int
    params_before: int
    params_after: int
    r: tuple[float, ...]
    macs_before: MergeMacs
    macs_after: MergeMacs | None
    setting: dict[str, Any] | None = None

    @property
    def mac_reduction(self) -> float:
        """``1 − MACs_after / MACs_before`` (every matmul; 0 when not counted)."""
        if self.macs_after is None:
            return 0.0
        return 1.0 - self.macs_after.total / self.macs_before.total

    def to_markdown(self) -> str:
        title = TITLES.get(self.method, self.method)
        after = self.macs_after
        if after is None:
            return (
                f"**{self.method}**: {title} on {self.blocks_after} block(s); its token counts "
                f"depend on the images: pass data to count them. {self.params_line()}."
            ) + self.quality_markdown()
        before = self.macs_before
        merged = sum(n - kept for n, kept in after.tokens)
        lines = [
            f"**{self.method}**: {title} on {self.blocks_after} block(s), "
            f"{merged:g} of {after.tokens[0][0]:g} tokens removed per image.",
            "",
            "| block | r | tokens in | tokens after |",
            "|---:|---:|---:|---:|",
        ]
        for b, (n, kept) in enumerate(after.tokens):
            lines.append(f"| {b} | {n - kept:g} | {n:g} | {kept:g} |")
        lines += [
            "",
            f"GMACs: {before.total / 1e9:.4g} → {after.total / 1e9:.4g} "
            f"(−{100 * self.mac_reduction:.1f}%, ×{before.total / after.total:.2f}); "
            f"{self.params_line()}.",
        ]
        return "\n".join(lines) + self.quality_markdown()
