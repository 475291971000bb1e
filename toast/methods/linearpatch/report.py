"""LinearPatch's report: each window, its similarity and its scales."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from toast.methods.base import Report
from toast.spans import Span

__all__ = ["LinearPatchReport"]


@dataclass
class LinearPatchReport(Report):
    """What LinearPatch did: each window, its mean cosine similarity, and
    the spread of its scales ``d``."""

    method: str
    spans: list[Span]
    scales: list[np.ndarray]
    blocks_before: int
    blocks_after: int
    params_before: int
    params_after: int
    rows: int = 0

    def to_markdown(self) -> str:
        lines = [
            f"**{self.method}**: {self.blocks_removed} of {self.blocks_before} blocks replaced "
            f"by a Hadamard-basis scale (calibrated on {self.rows:,} tokens).",
            "",
            "| blocks | cosine similarity | scale d: min / median / max |",
            "|---|---:|---|",
            *(
                f"| [{s.start}:{s.stop}] | {1 - s.error:.4f} | "
                f"{d.min():.3g} / {np.median(d):.3g} / {d.max():.3g} |"
                for s, d in zip(self.spans, self.scales, strict=True)
            ),
            "",
            self.params_line(),
        ]
        return "\n".join(lines) + self.quality_markdown()
