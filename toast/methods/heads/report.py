"""ToaSt's report: what ``compress(..., method="toast-vit")`` did (the
pruned heads, the TCS schedule, the MACs before and after, the fine-tune's
losses), apart from the stages that build it so the search's stages and
the registration both read it."""

from __future__ import annotations

from dataclasses import dataclass, field

from toast.methods.base import Report
from toast.methods.heads.schedules import Schedule
from toast.methods.heads.scwp import PruneReport
from toast.methods.heads.tcs import TcsHandle

__all__ = ["ToastVitReport"]


@dataclass
class ToastVitReport(Report):
    """What ``compress(..., method="toast-vit")`` did. ToaSt removes no
    block (``blocks_before == blocks_after``); ``gmacs_*`` are
    ToaSt-convention GMACs per image (:func:`toast.methods.heads.toast_macs`)."""

    method: str
    blocks_before: int
    blocks_after: int
    params_before: int
    params_after: int
    pruning: PruneReport
    schedule: Schedule
    tcs: TcsHandle | None = field(repr=False)
    gmacs_before: float
    gmacs_after: float
    finetune_losses: list[float] = field(default_factory=list, repr=False)

    @property
    def mac_reduction(self) -> float:
        """``1 − GMACs_after / GMACs_before`` (the paper's "FLOPs↓")."""
        return 1.0 - self.gmacs_after / self.gmacs_before

    def to_markdown(self) -> str:
        p = self.pruning
        lines = [
            f"**{self.method}**: SCWP ({p.form}, center {p.center}, {p.index_sets} index sets) "
            f"on {len(p.blocks)} block(s); TCS {self.schedule.describe()}.",
            "",
            "| block | d_k' / d_k | FC1 ratio | FC2 ratio |",
            "|---:|---:|---:|---:|",
        ]
        kept = {b.index: f"{b.keep}/{b.head_dim}" for b in p.blocks}
        s = self.schedule
        for b in range(s.num_blocks):
            lines.append(f"| {b} | {kept.get(b, '—')} | {s.fc1[b]:g} | {s.fc2[b]:g} |")
        lines += [
            "",
            f"GMACs: {self.gmacs_before:.4g} → {self.gmacs_after:.4g} "
            f"(−{100 * self.mac_reduction:.1f}%, ×{self.gmacs_before / self.gmacs_after:.2f}); "
            f"{self.params_line()}.",
        ]
        if self.finetune_losses:
            lines.append(
                f"Fine-tuned {len(self.finetune_losses)} steps: loss "
                f"{self.finetune_losses[0]:.4g} → {self.finetune_losses[-1]:.4g}."
            )
        return "\n".join(lines) + self.quality_markdown()
