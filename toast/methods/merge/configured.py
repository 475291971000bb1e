"""The token reducers as ``toast.compress`` runs them: stages configured by
the user's options (:meth:`toast.methods.merge.stages.ReducerStages.configured`)
whose one plan is the setting the config asks for, run by the one driver
(:mod:`toast.methods.driver`): calibration finds the blocks and the widths
at the size the model runs at (the first batch of the data when given,
else ``image_size`` or the config's) and builds the reducer; ``finish``
installs it with the config's options and, where its counts depend on the
images (ATM), counts them on the data; the report is a
:class:`~toast.methods.merge.report.TomeReport`. Reduction uses no data
beyond that and removes no block or parameter.

The plan is sized and predicted as the search's
(:class:`~toast.methods.merge.stages.ReducerStages`), keyed by the same
labels (:mod:`toast.methods.merge.labels`): a setting the search's grid has
gives the search's very plan."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from toast.hf.capture.states import forward_inputs
from toast.hf.data.calibration import Calibration
from toast.methods.merge.config import (
    AtmConfig,
    PitomeConfig,
    RapidConfig,
    TomeConfig,
    TransformingConfig,
)
from toast.methods.merge.install import MergeHandle, enable_reduction, measured_tokens
from toast.methods.merge.labels import (
    NORM_LABELS,
    atm_key,
    family,
    pitome_key,
    rapid_key,
    schedule_suffix,
    tome_key,
    transforming_key,
    visits,
)
from toast.methods.merge.macs import MergeWidths, merge_schedule, merged_macs, reduced_macs
from toast.methods.merge.part import MergePart
from toast.methods.merge.reducers import Reducer, TomeReducer
from toast.methods.merge.report import TomeReport
from toast.methods.merge.sites import MergeSites, find_sites
from toast.methods.merge.widths import example_input, merge_widths
from toast.methods.stages import BaseStages, Layout, Plan, Request, Shared, Sizes, Stats

__all__ = ["BUILDERS", "ConfiguredReducer", "ReducedStats"]


def _tome(config: TomeConfig, n: int) -> Reducer:
    return TomeReducer(merge_schedule(config.r, n, config.schedule), config.schedule)


def _rapid(config: RapidConfig, n: int) -> Reducer:
    from toast.methods.merge.rapid import RapidReducer

    until = n // 2 if config.prune_until is None else config.prune_until
    return RapidReducer(merge_schedule(config.r, n, config.schedule), min(until, n), config.tau)


def _transforming(config: TransformingConfig, n: int) -> Reducer:
    from toast.methods.merge.transforming import TransformingReducer

    return TransformingReducer(merge_schedule(config.r, n, config.schedule), config.temperature)


def _atm(config: AtmConfig, n: int) -> Reducer:
    from toast.methods.merge.atm import AtmReducer, atm_thresholds, default_split_from

    thresholds = config.thresholds
    if thresholds is None:
        thresholds = atm_thresholds(n, config.alpha, config.beta, config.theta_min)
    elif len(thresholds) != n:
        raise ValueError(f"thresholds must give one value per block ({n}); got {len(thresholds)}")
    split = default_split_from(n) if config.split_from is None else config.split_from
    return AtmReducer(tuple(thresholds), split if split is None or split < n else None)


def _pitome(config: PitomeConfig, n: int) -> Reducer:
    from toast.methods.merge.pitome import PitomeReducer, pitome_margins

    rs = merge_schedule(config.r, n, config.schedule)
    return PitomeReducer(rs, pitome_margins(n, config.margin), config.alpha)


#: How each reducer's config builds its reducer for a model of ``n`` blocks.
BUILDERS: dict[str, Callable[[Any, int], Reducer]] = {
    "tome": _tome,
    "rapid": _rapid,
    "token-transforming": _transforming,
    "atm": _atm,
    "pitome": _pitome,
}


def _tome_key(c: TomeConfig, n: int) -> Hashable:
    if isinstance(c.r, int):
        return tome_key(c.r, c.schedule, c.merge_norm)
    return f"ToMe r={c.r}{schedule_suffix(c.schedule)}{NORM_LABELS[c.merge_norm]}"


def _rapid_key(c: RapidConfig, n: int) -> Hashable:
    until = min(n // 2 if c.prune_until is None else c.prune_until, n)
    tau = "" if c.tau == RapidConfig.tau else f", τ={c.tau:g}"
    return rapid_key(c.r, until, c.schedule) + tau + NORM_LABELS[c.merge_norm]


def _transforming_key(c: TransformingConfig, n: int) -> Hashable:
    label = transforming_key(c.r, c.temperature)
    return label + schedule_suffix(c.schedule) + NORM_LABELS[c.merge_norm]


def _atm_key(c: AtmConfig, n: int) -> Hashable:
    if c.thresholds is None:
        label = atm_key(c.alpha, c.beta)
        label += "" if c.theta_min == AtmConfig.theta_min else f", θ_min={c.theta_min:g}"
    else:
        label = "ATM thresholds (" + ", ".join(f"{t:g}" for t in c.thresholds) + ")"
    split = "" if c.split_from is None else f", size-matched from {c.split_from}"
    return label + split + NORM_LABELS[c.merge_norm]


def _pitome_key(c: PitomeConfig, n: int) -> Hashable:
    alpha = "" if c.alpha == PitomeConfig.alpha else f", α={c.alpha:g}"
    label = pitome_key(c.r, c.margin) + schedule_suffix(c.schedule)
    return label + alpha + NORM_LABELS[c.merge_norm]


#: Each reducer's config as the search's grid keys its setting (the grid's
#: own key where the grid has the setting, what it never varies named after).
_KEYS: dict[str, Callable[[Any, int], Hashable]] = {
    "tome": _tome_key,
    "rapid": _rapid_key,
    "token-transforming": _transforming_key,
    "atm": _atm_key,
    "pitome": _pitome_key,
}


def setting_key(name: str, config: Any, num_blocks: int) -> Hashable:
    """The key of the setting ``config`` asks of reducer ``name`` on
    ``num_blocks`` blocks (``MergePart.setting``), with the install options the
    search never varies named when not the defaults."""
    key = _KEYS[name](config, num_blocks)
    extra = "" if config.proportional_attention else ", no proportional attention"
    extra += "" if config.unmerge_output else ", merged output"
    return f"{key}{extra}" if extra else key


@dataclass
class ReducedStats(Stats):
    """What ``compress`` read before installing the reducer: the blocks it
    reduces, their widths at the size the model runs at, the example that
    size came from, the reducer the config builds, its tokens per block
    (analytic; None where they depend on the images) and those the plan's
    prediction counts (measured on the example where not analytic);
    ``data``, the batches ATM's counts are taken on (None: none given).
    Then what ``finish`` did: the handle, and the counts on the data."""

    data: Iterable | None = None
    sites: MergeSites | None = None
    widths: MergeWidths | None = None
    reducer: Reducer | None = None
    tokens: Sequence[tuple[float, float]] | None = None
    predicted: Sequence[tuple[float, float]] = ()
    handle: MergeHandle | None = None


def _counted_tokens(
    model: nn.Module, handle: MergeHandle, data: Iterable[Any]
) -> tuple[tuple[float, float], ...] | None:
    """The tokens per block averaged over ``data``'s batches (by images),
    from the installed reducer's own counts; None without data."""
    totals: list[list[float]] | None = None
    images = 0
    with torch.inference_mode():
        for batch in data:
            args, kwargs = forward_inputs(model, batch)
            model(*args, **kwargs)
            rows = next(t.shape[0] for t in (*args, *kwargs.values()) if torch.is_tensor(t))
            pairs = [[float(rows * n), float(rows * kept)] for n, kept in handle.tokens]
            totals = (
                pairs
                if totals is None
                else [[a + c, b + d] for (a, b), (c, d) in zip(totals, pairs, strict=True)]
            )
            images += rows
    if totals is None or images == 0:
        return None
    return tuple((a / images, b / images) for a, b in totals)


class ConfiguredReducer(BaseStages):
    """Reducer ``name`` as ``compress`` runs it with ``config`` (see the
    module docstring): one plan, the config's setting."""

    chain_last = True

    def __init__(self, name: str, config: Any) -> None:
        self.name = name
        self.config = config

    def _options(self) -> dict[str, Any]:
        """The config's options of :func:`enable_reduction`."""
        c = self.config
        return {
            "proportional_attention": c.proportional_attention,
            "unmerge_output": c.unmerge_output,
            "merge_norm": c.merge_norm,
        }

    def request(self, config: Any) -> Request:
        return Request()  # the config fixes the plan: no size to ask

    def reach(self, request: Request) -> int:
        return 0

    def choose(self, plans: Sequence[Plan], request: Request) -> Plan | None:
        return plans[0] if plans else None

    def data_optional(self, request: Any) -> bool:
        return True  # data only sets the size the model runs at, and ATM's counts

    def calibrate(
        self,
        model: nn.Module,
        data: Iterable | None,
        layout: Layout,
        shared: Shared | None,
        calibration: Calibration,
        max_blocks: int,
    ) -> ReducedStats:
        config, stack = self.config, layout.stack
        sites = find_sites(model, stack)
        example = example_input(model, data, config.image_size)
        widths = merge_widths(model, sites, stack, example)
        build = BUILDERS[self.name]
        reducer = build(config, sites.num_blocks)
        tokens: Sequence[tuple[float, float]] | None = reducer.tokens(widths.tokens, widths.prefix)
        predicted = tokens
        if predicted is None:  # as the search: counted on the example, by a reducer of its own
            fresh = build(config, sites.num_blocks)
            predicted = measured_tokens(model, sites, fresh, example, **self._options())
        return ReducedStats(
            data=data,
            sites=sites,
            widths=widths,
            reducer=reducer,
            tokens=tokens,
            predicted=predicted,
        )

    def propose(self, stats: Stats, sizes: Sizes, max_blocks: int, macs_matter: bool) -> list[Plan]:
        # sized and predicted as ReducerStages._plan does for a setting alone
        assert isinstance(stats, ReducedStats) and stats.widths is not None
        widths, config = stats.widths, self.config
        base = merged_macs(widths, (0,) * widths.num_blocks)
        visited, _ = visits(base.tokens)
        _, reduced = visits(stats.predicted)
        saving = 1.0 - reduced_macs(widths, stats.predicted).linear / base.linear
        key = setting_key(self.name, config, widths.num_blocks)
        schedule = getattr(config, "schedule", "constant")
        return [
            Plan(
                (self.name,),
                family(self.name, schedule, config.merge_norm),
                (),
                None,
                sizes.params,
                reduced / visited,
                unseen_share=saving,
                parts=(MergePart(self.name, key if isinstance(key, (int, str)) else str(key)),),
            )
        ]

    def apply(self, model: nn.Module, plan: Plan, stats: Stats, layout: Layout) -> None:
        return None  # no weight changes: reduction acts at run time (finish)

    def finish(self, model: nn.Module, plan: Plan, stats: Stats, layout: Layout) -> None:
        assert isinstance(stats, ReducedStats) and stats.reducer is not None
        stats.handle = enable_reduction(model, stats.reducer, sites=stats.sites, **self._options())
        if stats.tokens is None and stats.data is not None:
            stats.tokens = _counted_tokens(model, stats.handle, stats.data)

    def report(
        self, plan: Plan, stats: Stats, sizes: Sizes, spans: Sequence[Any], params_after: int
    ) -> TomeReport:
        assert isinstance(stats, ReducedStats) and stats.widths is not None
        assert stats.sites is not None and stats.reducer is not None
        tokens, widths, n = stats.tokens, stats.widths, stats.sites.num_blocks
        report = TomeReport(
            method=self.name,
            blocks_before=n,
            blocks_after=n,
            params_before=params_after,  # reduction removes no parameter
            params_after=params_after,
            r=tuple(n_in - kept for n_in, kept in tokens) if tokens else (),
            macs_before=merged_macs(widths, (0,) * n),
            macs_after=None if tokens is None else reduced_macs(widths, tokens),
            setting=stats.reducer.state(),
        )
        if isinstance(stats.reducer, TomeReducer):
            report.r = stats.reducer.r  # what was asked per block (a capped count may be less)
        return report
