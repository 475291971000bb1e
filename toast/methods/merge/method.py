"""Token merging as a registered method: ``toast.compress(model, None,
method="tome", r=8)`` and ``toast compress MODEL --method tome --r 8``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

from toast.hf.model.blocks import find_blocks
from toast.hf.model.params import count_params
from toast.methods.base import BeforeSurgery, Method, Report, register
from toast.methods.merge import persist  # noqa: F401  (registers the "tome" model patch)
from toast.methods.merge.config import TomeConfig
from toast.methods.merge.install import enable_merging
from toast.methods.merge.macs import MergeMacs, merge_schedule, merged_macs
from toast.methods.merge.sites import find_sites
from toast.methods.merge.stages import STAGES
from toast.methods.merge.widths import example_input, merge_widths

__all__ = ["METHOD", "TomeReport", "compress_tome"]


@dataclass
class TomeReport(Report):
    """What ``compress(..., method="tome")`` did: no block and no parameter
    removed; ``r`` per block, and the MACs per image before and after
    (:mod:`toast.methods.merge.macs`, ToaSt's convention) with the tokens
    every block sees."""

    method: str
    blocks_before: int
    blocks_after: int
    params_before: int
    params_after: int
    r: tuple[int, ...]
    macs_before: MergeMacs
    macs_after: MergeMacs

    @property
    def mac_reduction(self) -> float:
        """``1 − MACs_after / MACs_before`` (every matmul)."""
        return 1.0 - self.macs_after.total / self.macs_before.total

    def to_markdown(self) -> str:
        before, after = self.macs_before, self.macs_after
        merged = sum(n - kept for n, kept in after.tokens)
        lines = [
            f"**{self.method}**: token merging on {self.blocks_after} block(s), "
            f"{merged} of {after.tokens[0][0]} tokens merged per image.",
            "",
            "| block | r | tokens in | tokens after |",
            "|---:|---:|---:|---:|",
        ]
        for b, (r, (n, kept)) in enumerate(zip(self.r, after.tokens, strict=True)):
            lines.append(f"| {b} | {r} | {n} | {kept} |")
        lines += [
            "",
            f"GMACs: {before.total / 1e9:.4g} → {after.total / 1e9:.4g} "
            f"(−{100 * self.mac_reduction:.1f}%, ×{before.total / after.total:.2f}); "
            f"{self.params_line()}.",
        ]
        return "\n".join(lines) + self.quality_markdown()


def compress_tome(
    model: nn.Module,
    data: Iterable[Any] | None,
    config: TomeConfig,
    before_surgery: BeforeSurgery | None = None,
) -> tuple[nn.Module, TomeReport]:
    """Installs token merging on ``model`` in place (the fields are described
    on :class:`TomeConfig`). Merging uses no data and removes no block:
    ``data``, when given, only sets the image size the report's MACs count
    (its first batch), and ``before_surgery`` is never called."""
    stack = find_blocks(model)
    sites = find_sites(model, stack)
    widths = merge_widths(model, sites, stack, example_input(model, data, config.image_size))
    rs = merge_schedule(config.r, sites.num_blocks, config.schedule)
    enable_merging(
        model,
        rs,
        proportional_attention=config.proportional_attention,
        unmerge_output=config.unmerge_output,
        sites=sites,
    )
    params = count_params(model)
    report = TomeReport(
        method="tome",
        blocks_before=sites.num_blocks,
        blocks_after=sites.num_blocks,
        params_before=params,
        params_after=params,
        r=rs,
        macs_before=merged_macs(widths, (0,) * sites.num_blocks),
        macs_after=merged_macs(widths, rs),
    )
    return model, report


METHOD = register(
    Method(
        name="tome",
        config=TomeConfig,
        run=compress_tome,
        needs_data=False,
        summary="ViT token merging (ToMe): bipartite soft matching, no training",
        stages=STAGES,
    )
)
