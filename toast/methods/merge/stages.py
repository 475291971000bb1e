"""Token reduction's stages, one class for every reducer (ToMe, ATM, Token
Transforming, RAPID): weight-free (nothing captured), every setting of the
reducer's grid that reduces something (only for MAC and latency targets),
alone or, for reducers whose token counts do not depend on the images,
extending another method's extendable plan (block removal, ToaSt's head
pruning, both; not Token Channel Selection).

Sizes are exact (reduction removes no parameter). MACs per setting are
analytic where the counts are (:mod:`toast.methods.merge.macs`), and
measured on the first calibration batch where they depend on the images
(ATM's thresholds); the search's hooks count the built model either way,
since :meth:`ReducerStages.apply` installs the reducer on the built copy
before it is measured. The prediction is a weight-free proxy (the share
of token-block visits reduced away), so it ranks a reducer's plans among
themselves only.

A plan names its setting in its :class:`~toast.methods.merge.part.MergePart`
(``merge`` in its dict): ToMe's ``r`` (an int, as before other reducers
existed) or another reducer's setting label (a str such as
``"RAPID r=11, prune<6"``).

ToMe and RAPID are proposed at every schedule of
:data:`~toast.methods.merge.macs.SCHEDULES`, each schedule its own family
(``"tome"``, ``"tome-delayed"``, ...): the search measures the best of
each, so the shape that suits the model and the target is chosen by
measurement (on DINOv2's scored photographs ToMe's delayed schedule leads
at 40% fewer MACs and the front one at 55%; ``benchmarks/README.md``).
Other methods' plans are extended by the constant schedule only.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from torch import nn

from toast.hf.data.calibration import Calibration
from toast.hf.model.blocks import BlockStack, find_blocks
from toast.hf.model.vit import vit_view
from toast.methods.merge.configured import ConfiguredReducer
from toast.methods.merge.install import enable_reduction, measured_tokens
from toast.methods.merge.labels import (
    atm_key,
    family,
    pitome_key,
    rapid_key,
    tome_key,
    transforming_key,
    visits,
)
from toast.methods.merge.macs import (
    SCHEDULES,
    MergeWidths,
    merge_schedule,
    merged_macs,
    reduced_macs,
    tokens_per_block,
)
from toast.methods.merge.part import MergePart
from toast.methods.merge.reducers import Reducer, TomeReducer
from toast.methods.merge.sites import MERGE_TYPES, MergeSites, Site, timm_sites
from toast.methods.merge.widths import example_input, merge_widths
from toast.methods.stages import BaseStages, Layout, Plan, Shared, Sizes, Stats

__all__ = [
    "ATM_STAGES",
    "EXTEND_SAVINGS",
    "PITOME_STAGES",
    "RAPID_STAGES",
    "STAGES",
    "TRANSFORMING_STAGES",
    "ReducerStages",
    "TOME_NORMS",
    "TomeStages",
    "TomeStats",
]

#: A reducer alone is proposed at every setting of its grid (a dozen to a
#: few dozen plans), so that a MAC target finds the one that just meets it.
#: The linear-MAC savings whose smallest setting extends other methods'
#: plans (every extendable plan times each of these).
EXTEND_SAVINGS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)

#: A setting's reducer for a model of that many reducing blocks (a partial
#: of a module-level function: the search's cache pickles the stats).
Build = Callable[[int], Reducer]


@dataclass(frozen=True)
class Setting:
    """One entry of a reducer's grid: its builder, the schedule that
    spreads its counts over the blocks and how a merged token's norm is set
    (:data:`~toast.methods.merge.config.MERGE_NORMS`); plans of one
    schedule and norm form one family, so the search measures each."""

    build: Build
    schedule: str = "constant"
    merge_norm: str = "average"


@dataclass
class TomeStats(Stats):
    """The reduced model's widths (None: not a ViT reduction supports), and
    per setting its linear-MAC saving, proxy and grid entry (builder,
    schedule and merge norm), in the grid's order (savings grow along it within a
    schedule)."""

    widths: MergeWidths | None = None
    savings: dict[Hashable, float] | None = None
    proxies: dict[Hashable, float] | None = None
    settings: dict[Hashable, Setting] | None = None
    extendable: bool = True

    def r_for(self, saving: float) -> Hashable | None:
        """The first setting of the constant schedule and the paper's
        average saving at least ``saving`` (None: none does)."""
        assert self.savings is not None and self.settings is not None
        settings = self.settings
        return next(
            (
                k
                for k, s in self.savings.items()
                if s >= saving
                and settings[k].schedule == "constant"
                and settings[k].merge_norm == "average"
            ),
            None,
        )

    def family(self, name: str, key: Hashable) -> str:
        """The family of a plan of reducer ``name`` alone at setting ``key``
        (:func:`toast.methods.merge.labels.family`)."""
        assert self.settings is not None
        setting = self.settings[key]
        return family(name, setting.schedule, setting.merge_norm)


class ReducerStages(BaseStages):
    """A token reducer as stages (family ``name``; extends other methods'
    extendable plans as ``"<family>+<name>"``). Subclasses give the grid."""

    name = "tome"
    chain_last = True

    def grid(self, widths: MergeWidths) -> dict[Hashable, Setting]:
        """Every setting to propose, in order of growing reduction within
        each schedule."""
        raise NotImplementedError

    def configured(self, config: Any) -> ConfiguredReducer:
        """The stages ``compress`` runs: the one setting ``config`` asks for."""
        return ConfiguredReducer(self.name, config)

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
        sites = layout.part(self.name)
        if sites is None:
            return TomeStats()
        try:
            example = example_input(model, data)
        except ValueError:
            return TomeStats(note=f"{self.name}: the image size is unknown")
        widths = merge_widths(model, sites, layout.stack, example)
        return self._settings(model, sites, widths, example)

    def _settings(
        self, model: nn.Module, sites: MergeSites, widths: MergeWidths, example: Any
    ) -> TomeStats:
        base = merged_macs(widths, (0,) * widths.num_blocks)
        visited, _ = visits(base.tokens)
        savings: dict[Hashable, float] = {}
        proxies: dict[Hashable, float] = {}
        settings: dict[Hashable, Setting] = {}
        analytic = True
        for key, setting in self.grid(widths).items():
            reducer = setting.build(widths.num_blocks)
            tokens: Sequence[tuple[float, float]] | None = reducer.tokens(
                widths.tokens, widths.prefix
            )
            if tokens is None:
                analytic = False
                tokens = measured_tokens(model, sites, reducer, example)
            _, reduced = visits(tokens)
            if reduced <= 0:
                continue
            macs = reduced_macs(widths, tokens)
            savings[key] = 1.0 - macs.linear / base.linear
            proxies[key], settings[key] = reduced / visited, setting
        return TomeStats(
            widths=widths,
            savings=savings,
            proxies=proxies,
            settings=settings,
            extendable=analytic,
        )

    def _plan(self, stats: TomeStats, base: Plan | None, key: Hashable, params: int) -> Plan:
        # the MACs reduction saves show in no parameter count: the search's
        # pre-measurement filter reads them as unseen_share (the hooks see them)
        assert stats.proxies is not None and stats.savings is not None
        merge = key if isinstance(key, (int, str)) else str(key)
        if base is None:
            saving = stats.savings[key]
            return Plan(
                (self.name,),
                stats.family(self.name, key),
                (),
                None,
                params,
                stats.proxies[key],
                unseen_share=saving,
                parts=(MergePart(self.name, merge),),
            )
        kept = 1.0 - base.blocks_removed / stats.widths.num_blocks if stats.widths else 0.0
        return Plan(
            (*base.methods, self.name),
            f"{base.family}+{self.name}",
            base.spans,
            base.translator,
            base.params_after,
            base.predicted_error + stats.proxies[key],
            unseen_macs=base.unseen_macs,
            unseen_share=base.unseen_share + kept * stats.savings[key],
            parts=(*base.parts, MergePart(self.name, merge)),
        )

    def propose(self, stats: Stats, sizes: Sizes, max_blocks: int, macs_matter: bool) -> list[Plan]:
        assert isinstance(stats, TomeStats)
        if not macs_matter or not stats.savings:
            return []
        return [self._plan(stats, None, key, sizes.params) for key in stats.savings]

    def extend(self, plan: Plan, stats: Stats, sizes: Sizes) -> list[Plan]:
        assert isinstance(stats, TomeStats)
        # Not over Token Channel Selection: its saving is counted analytically
        # at the full token count, which reduction would make wrong; not
        # for image-dependent counts, measured on the whole model only.
        if not stats.savings or not stats.extendable:
            return []
        if any(part.fixes_tokens for part in plan.parts):
            return []
        keys = dict.fromkeys(k for k in map(stats.r_for, EXTEND_SAVINGS) if k is not None)
        return [self._plan(stats, plan, key, plan.params_after) for key in keys]

    def apply(self, model: nn.Module, plan: Plan, stats: Stats, layout: Layout) -> None:
        # installed here, not in finish: the search's hook count then sees the fewer tokens
        assert isinstance(stats, TomeStats)
        part: MergePart | None = plan.part(self.name)
        if part is None:
            return
        if stats.settings is None or part.setting not in stats.settings:
            # never measure a reduction plan without its reduction
            raise ValueError(
                f"{self.name}: the calibration has no setting {part.setting!r}; calibrate again "
                "(a search cache from another toast version: toast cache clear)"
            )
        sites = _remaining(model, layout, self.name)
        setting = stats.settings[part.setting]
        enable_reduction(
            model, setting.build(sites.num_blocks), sites=sites, merge_norm=setting.merge_norm
        )


#: The merge norms the search measures for ToMe beside the paper's average:
#: Token Fusion's MLERP (on DINOv2 it keeps the CLS feature closer to the
#: original's at the same MACs; ``benchmarks/README.md``).
TOME_NORMS = ("average", "max")


class TomeStages(ReducerStages):
    """ToMe: every ``r`` that merges more than the one before, at every
    schedule of :data:`~toast.methods.merge.macs.SCHEDULES` and merge norm
    of :data:`TOME_NORMS` (the paper's constant schedule and average keyed
    by ``r``, the others by their label)."""

    name = "tome"

    def grid(self, widths: MergeWidths) -> dict[Hashable, Setting]:
        return {
            tome_key(r, schedule, norm): Setting(
                partial(tome_reducer, r, schedule=schedule), schedule, norm
            )
            for norm in TOME_NORMS
            for schedule in SCHEDULES
            for r in _counts(widths, schedule)
        }


def tome_reducer(r: int, num_blocks: int, schedule: str = "constant") -> TomeReducer:
    """ToMe at ``r`` spread over ``num_blocks`` blocks by ``schedule``."""
    return TomeReducer(merge_schedule(r, num_blocks, schedule), schedule)


def _remaining(model: nn.Module, layout: Layout, name: str) -> MergeSites:
    """The layout's reduction sites still in ``model``'s block list (another
    method's plan may have removed or replaced some), numbered and named
    by their place in the list now."""
    found = layout.part(name)
    assert found is not None  # no reduction plan without it
    stack = find_blocks(model, layout.stack)  # the path, looked up again
    mine = {id(s.block): s for s in found.sites}
    sites = tuple(
        Site(i, f"{stack.path}.{i}", block, mine[id(block)].kind)
        for i, block in enumerate(stack.blocks)
        if id(block) in mine
    )
    return MergeSites(sites, found.prefix, found.kind)


def _counts(widths: MergeWidths, schedule: str = "constant") -> list[int]:
    """Every ``r`` whose spread by ``schedule`` removes more tokens than the
    one before it (ToMe's cap ends the list)."""
    counts, last = [], 0
    for r in range(1, widths.tokens):
        rs = merge_schedule(r, widths.num_blocks, schedule)
        pairs = tokens_per_block(widths.tokens, rs, widths.prefix)
        removed = sum(n_in - kept for n_in, kept in pairs)
        if removed == last:
            break
        counts.append(r)
        last = removed
    return counts


#: RAPID's switch from pruning to merging, as shares of the blocks: the
#: search measures which suits the model (the paper's is not known; toast's
#: config defaults to half).
RAPID_SPLITS = (1 / 3, 1 / 2, 2 / 3)


def rapid_reducer(r: int, split: float, num_blocks: int, schedule: str = "constant") -> Reducer:
    """RAPID at ``r`` spread by ``schedule``, pruning in the first ``split``
    of the blocks."""
    from toast.methods.merge.rapid import RapidReducer

    return RapidReducer(merge_schedule(r, num_blocks, schedule), round(split * num_blocks))


class RapidStages(ReducerStages):
    """RAPID: every ``r`` times every switch of :data:`RAPID_SPLITS`, at
    every schedule of :data:`~toast.methods.merge.macs.SCHEDULES`."""

    name = "rapid"

    def grid(self, widths: MergeWidths) -> dict[Hashable, Setting]:
        n = widths.num_blocks
        return {
            rapid_key(r, round(split * n), schedule): Setting(
                partial(rapid_reducer, r, split, schedule=schedule), schedule
            )
            for schedule in SCHEDULES
            for r in _counts(widths, schedule)
            for split in RAPID_SPLITS
        }


#: Token Transforming's temperatures the search measures (toast's reading;
#: the paper's value is not known): near-hard sharing and the config's default.
TEMPERATURES = (0.02, 0.1)


def transforming_reducer(r: int, temperature: float, num_blocks: int) -> Reducer:
    """Token Transforming at a constant ``r`` and ``temperature``."""
    from toast.methods.merge.transforming import TransformingReducer

    return TransformingReducer((r,) * num_blocks, temperature)


class TransformingStages(ReducerStages):
    """Token Transforming: every constant ``r`` times every temperature of
    :data:`TEMPERATURES`."""

    name = "token-transforming"

    def grid(self, widths: MergeWidths) -> dict[Hashable, Setting]:
        return {
            transforming_key(r, t): Setting(partial(transforming_reducer, r, t))
            for r in _counts(widths)
            for t in TEMPERATURES
        }


#: ATM's schedules the search measures: the first block's threshold and
#: the decay (``θ_l = max(α − (exp(β(l − 1)) − 1), 0.5)``, small-to-large
#: matching in the last third); their counts are measured on the first
#: calibration batch, since they depend on the images.
ATM_ALPHAS = (0.9, 0.95, 0.98, 0.99, 0.995, 0.999)
ATM_BETAS = (0.005, 0.01, 0.02, 0.05)
ATM_THETA_MIN = 0.5


def atm_reducer(alpha: float, beta: float, num_blocks: int) -> Reducer:
    """ATM with the paper's threshold schedule at ``alpha`` and ``beta``."""
    from toast.methods.merge.atm import AtmReducer, atm_thresholds, default_split_from

    thresholds = atm_thresholds(num_blocks, alpha, beta, ATM_THETA_MIN)
    return AtmReducer(thresholds, default_split_from(num_blocks))


class AtmStages(ReducerStages):
    """ATM: the paper's threshold schedule over :data:`ATM_ALPHAS` ×
    :data:`ATM_BETAS`, strictest first."""

    name = "atm"

    def grid(self, widths: MergeWidths) -> dict[Hashable, Setting]:
        return {
            atm_key(a, b): Setting(partial(atm_reducer, a, b))
            for a in sorted(ATM_ALPHAS, reverse=True)
            for b in ATM_BETAS
        }


#: PiToMe's first-block margins the search measures: the paper's and the
#: code's DeiT setting.
PITOME_MARGINS = (0.9, 0.75)


def pitome_reducer(r: int, margin: float, num_blocks: int) -> Reducer:
    """PiToMe at a constant ``r``, margins falling linearly from ``margin``."""
    from toast.methods.merge.pitome import PitomeReducer, pitome_margins

    return PitomeReducer((r,) * num_blocks, pitome_margins(num_blocks, margin))


class PitomeStages(ReducerStages):
    """PiToMe: every constant ``r`` times every margin of :data:`PITOME_MARGINS`."""

    name = "pitome"

    def grid(self, widths: MergeWidths) -> dict[Hashable, Setting]:
        return {
            pitome_key(r, m): Setting(partial(pitome_reducer, r, m))
            for r in _counts(widths)
            for m in PITOME_MARGINS
        }


STAGES = TomeStages()
PITOME_STAGES = PitomeStages()
RAPID_STAGES = RapidStages()
TRANSFORMING_STAGES = TransformingStages()
ATM_STAGES = AtmStages()
