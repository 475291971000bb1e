"""Sub-layer pruning's report: which attention and MLP sub-layers went."""

from __future__ import annotations

import math
from dataclasses import dataclass

from toast.methods.base import Report

__all__ = ["RemovedSublayer", "SublayerReport"]


@dataclass(frozen=True)
class RemovedSublayer:
    """One removed sub-layer: its block, kind, parameters, score (NaN when
    not scored) and, under ``selection="measured"``, the calibration
    quality once it and those before it were removed (else NaN)."""

    block: int
    kind: str
    params: int
    score: float
    measured: float = math.nan


@dataclass
class SublayerReport(Report):
    """What sub-layer pruning did (blocks stay: ``blocks_after`` equals
    ``blocks_before``; the parameters say what went)."""

    method: str
    selection: str
    removed: list[RemovedSublayer]
    sublayers_before: int
    blocks_before: int
    blocks_after: int
    params_before: int
    params_after: int

    def to_markdown(self) -> str:
        lines = [
            f"**{self.method}**: {len(self.removed)} of {self.sublayers_before} sub-layers "
            f"removed (by {self.selection}); every block kept.",
            "",
            "| block | sub-layer | parameters | score (1 − cos) | measured |",
            "|---:|---|---:|---:|---:|",
            *(
                f"| {r.block} | {r.kind} | {r.params:,} | {r.score:.4g} | {r.measured:.4g} |"
                for r in self.removed
            ),
            "",
            self.params_line(),
        ]
        return "\n".join(lines) + self.quality_markdown()
