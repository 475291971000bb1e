"""Token merging's stages: weight-free (nothing captured), every
constant-``r`` schedule that merges something (only for MAC and latency
targets), alone or extending another method's extendable plan (block
removal, ToaSt's head pruning, both; not Token Channel Selection). Sizes
are exact (merging removes no parameter); MACs per ``r`` are analytic
(:mod:`toast.methods.merge.macs`) and the search's hooks count the same,
since :meth:`TomeStages.apply` installs merging on the built copy before
it is measured. The prediction is a weight-free proxy (the share of
token-block visits merged away), so it ranks merging plans among
themselves only."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from toast.hf.data.calibration import Calibration
from toast.hf.model.blocks import BlockStack, find_blocks
from toast.hf.model.vit import vit_view
from toast.methods.merge.install import enable_merging
from toast.methods.merge.macs import MergeWidths, merge_schedule, merged_macs
from toast.methods.merge.sites import MERGE_TYPES, MergeSites, Site, timm_sites
from toast.methods.merge.widths import example_input, merge_widths
from toast.methods.stages import BaseStages, Layout, Plan, Shared, Sizes, Stats

__all__ = ["EXTEND_SAVINGS", "STAGES", "TomeStages", "TomeStats"]

#: Merging alone is proposed at every constant ``r`` (a dozen to a few
#: dozen plans), so that a MAC target finds the ``r`` that just meets it.
#: The linear-MAC savings whose smallest ``r`` extends other methods' plans
#: (every extendable plan times each of these).
EXTEND_SAVINGS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)


@dataclass
class TomeStats(Stats):
    """The merged model's widths (None: not a ViT merging supports), and
    per candidate ``r`` its linear-MAC saving and proxy."""

    widths: MergeWidths | None = None
    savings: dict[int, float] | None = None
    proxies: dict[int, float] | None = None

    def r_for(self, saving: float) -> int | None:
        """The smallest ``r`` saving at least ``saving`` (None: none does)."""
        assert self.savings is not None
        return next((r for r, s in sorted(self.savings.items()) if s >= saving), None)


def _candidates(widths: MergeWidths) -> tuple[dict[int, float], dict[int, float]]:
    """Linear-MAC saving and proxy of every constant ``r`` that merges something."""
    n = widths.num_blocks
    base = merged_macs(widths, (0,) * n)
    visits = sum(n_in for n_in, _ in base.tokens)
    savings, proxies = {}, {}
    last = 0
    for r in range(1, widths.tokens):
        macs = merged_macs(widths, merge_schedule(r, n))
        merged = sum(n_in - kept for n_in, kept in macs.tokens)
        if merged == last:
            break  # the cap: a larger r merges nothing more
        savings[r], proxies[r], last = 1.0 - macs.linear / base.linear, merged / visits, merged
    return savings, proxies


class TomeStages(BaseStages):
    """Token merging as stages (family ``"tome"``; extends other methods'
    extendable plans as ``"<family>+tome"``)."""

    def structure(self, model: nn.Module, stack: BlockStack) -> MergeSites | None:
        if getattr(getattr(model, "config", None), "model_type", None) in MERGE_TYPES:
            vm = vit_view(model, stack)  # the ViT blocks ToaSt found too: one discovery
            if vm is None:
                return None
            sites = tuple(Site(b.index, b.path, b.block, "hf") for b in vm.blocks)
            return MergeSites(sites, vm.prefix, "hf")
        return timm_sites(model, stack)

    def calibrate(
        self,
        model: nn.Module,
        data: Iterable,
        layout: Layout,
        shared: Shared | None,
        calibration: Calibration,
        max_blocks: int,
    ) -> TomeStats:
        sites = layout.part("tome")
        if sites is None:
            return TomeStats()
        try:
            example = example_input(model, data)
        except ValueError:
            return TomeStats(note="token merging: the image size is unknown")
        widths = merge_widths(model, sites, layout.stack, example)
        savings, proxies = _candidates(widths)
        return TomeStats(widths=widths, savings=savings, proxies=proxies)

    def _plan(self, stats: TomeStats, base: Plan | None, r: int, params: int) -> Plan:
        # the MACs merging saves show in no parameter count: the search's
        # pre-measurement filter reads them as unseen_share (the hooks see them)
        assert stats.proxies is not None and stats.savings is not None
        if base is None:
            saving = stats.savings[r]
            return Plan(
                ("tome",),
                "tome",
                (),
                None,
                None,
                params,
                stats.proxies[r],
                unseen_share=saving,
                merge=r,
            )
        kept = 1.0 - base.blocks_removed / stats.widths.num_blocks if stats.widths else 0.0
        return Plan(
            (*base.methods, "tome"),
            f"{base.family}+tome",
            base.spans,
            base.translator,
            base.head_sparsity,
            base.params_after,
            base.predicted_error + stats.proxies[r],
            schedule=base.schedule,
            unseen_macs=base.unseen_macs,
            unseen_share=base.unseen_share + kept * stats.savings[r],
            merge=r,
        )

    def propose(self, stats: Stats, sizes: Sizes, max_blocks: int, macs_matter: bool) -> list[Plan]:
        assert isinstance(stats, TomeStats)
        if not macs_matter or not stats.savings:
            return []
        return [self._plan(stats, None, r, sizes.params) for r in sorted(stats.savings)]

    def extend(self, plan: Plan, stats: Stats, sizes: Sizes) -> list[Plan]:
        assert isinstance(stats, TomeStats)
        # Not over Token Channel Selection: its saving is counted analytically
        # at the full token count, which merging would make wrong.
        if not stats.savings or plan.merge is not None or plan.schedule is not None:
            return []
        rs = dict.fromkeys(r for r in map(stats.r_for, EXTEND_SAVINGS) if r is not None)
        return [self._plan(stats, plan, r, plan.params_after) for r in rs]

    def apply(self, model: nn.Module, plan: Plan, stats: Stats, layout: Layout) -> None:
        # installed here, not in finish: the search's hook count then sees the fewer tokens
        if plan.merge is not None:
            enable_merging(model, plan.merge, sites=_remaining(model, layout))


def _remaining(model: nn.Module, layout: Layout) -> MergeSites:
    """The layout's merge sites still in ``model``'s block list (another
    method's plan may have removed or replaced some), numbered and named
    by their place in the list now."""
    found = layout.part("tome")
    assert found is not None  # no merging plan without it
    stack = find_blocks(model, layout.stack)  # the path, looked up again
    mine = {id(s.block): s for s in found.sites}
    sites = tuple(
        Site(i, f"{stack.path}.{i}", block, mine[id(block)].kind)
        for i, block in enumerate(stack.blocks)
        if id(block) in mine
    )
    return MergeSites(sites, found.prefix, found.kind)


STAGES = TomeStages()
