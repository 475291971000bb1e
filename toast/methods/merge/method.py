"""The token reducers as registered methods: ``toast.compress(model, None,
method="tome", r=8)`` (``"rapid"``, ``"token-transforming"``, ``"atm"``,
``"pitome"`` alike) and ``toast compress MODEL --method tome --r 8``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from toast.hf.capture.states import forward_inputs
from toast.hf.model.blocks import find_blocks
from toast.hf.model.params import count_params
from toast.methods.base import BeforeSurgery, Method, Report, register
from toast.methods.merge import persist  # noqa: F401  (registers the "tome" model patch)
from toast.methods.merge.config import (
    AtmConfig,
    PitomeConfig,
    RapidConfig,
    TomeConfig,
    TransformingConfig,
)
from toast.methods.merge.install import MergeHandle, enable_reduction
from toast.methods.merge.macs import MergeMacs, merge_schedule, merged_macs, reduced_macs
from toast.methods.merge.reducers import Reducer, TomeReducer
from toast.methods.merge.sites import find_sites
from toast.methods.merge.stages import (
    ATM_STAGES,
    PITOME_STAGES,
    RAPID_STAGES,
    STAGES,
    TRANSFORMING_STAGES,
)
from toast.methods.merge.widths import example_input, merge_widths

__all__ = ["METHODS", "METHOD", "TomeReport", "compress_reduction", "compress_tome"]


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
        entry = _ENTRIES.get(self.method)
        title = self.method if entry is None else entry.title
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


def compress_reduction(
    model: nn.Module,
    data: Iterable[Any] | None,
    config: Any,
    reducer: Callable[[Any, int], Reducer],
    name: str,
) -> tuple[nn.Module, TomeReport]:
    """Installs ``reducer(config, num_blocks)`` on ``model`` in place and
    reports it. It uses no data and removes no block: ``data``, when given,
    sets the image size the report's MACs count (its first batch) and, for
    a reducer whose counts depend on the images (ATM), the counts."""
    stack = find_blocks(model)
    sites = find_sites(model, stack)
    widths = merge_widths(model, sites, stack, example_input(model, data, config.image_size))
    built = reducer(config, sites.num_blocks)
    handle = enable_reduction(
        model,
        built,
        proportional_attention=config.proportional_attention,
        unmerge_output=config.unmerge_output,
        merge_norm=config.merge_norm,
        sites=sites,
    )
    tokens: Sequence[tuple[float, float]] | None = built.tokens(widths.tokens, widths.prefix)
    if tokens is None and data is not None:
        tokens = _counted_tokens(model, handle, data)
    params = count_params(model)
    report = TomeReport(
        method=name,
        blocks_before=sites.num_blocks,
        blocks_after=sites.num_blocks,
        params_before=params,
        params_after=params,
        r=tuple(n - kept for n, kept in tokens) if tokens else (),
        macs_before=merged_macs(widths, (0,) * sites.num_blocks),
        macs_after=None if tokens is None else reduced_macs(widths, tokens),
        setting=built.state(),
    )
    if isinstance(built, TomeReducer):
        report.r = built.r  # what was asked per block (a capped count may be less)
    return model, report


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


@dataclass(frozen=True)
class _Entry:
    """One reducer as a registered method: its config, how a config builds
    its reducer, its stages, what the report calls it and the registry's
    one-line summary."""

    config: type
    build: Callable[[Any, int], Reducer]
    stages: Any
    title: str
    summary: str


_ENTRIES = {
    "tome": _Entry(
        TomeConfig,
        _tome,
        STAGES,
        "token merging",
        "ViT token merging (ToMe): bipartite soft matching, no training",
    ),
    "rapid": _Entry(
        RapidConfig,
        _rapid,
        RAPID_STAGES,
        "RAPID token pruning and merging",
        "ViT token pruning (early blocks) then merging by CLS attention (RAPID)",
    ),
    "token-transforming": _Entry(
        TransformingConfig,
        _transforming,
        TRANSFORMING_STAGES,
        "Token Transforming",
        "ViT many-to-many token reduction (Token Transforming), no training",
    ),
    "atm": _Entry(
        AtmConfig,
        _atm,
        ATM_STAGES,
        "adaptive token merging (ATM)",
        "ViT adaptive token merging by per-block similarity thresholds (ATM)",
    ),
    "pitome": _Entry(
        PitomeConfig,
        _pitome,
        PITOME_STAGES,
        "PiToMe energy-protected token merging",
        "ViT token merging that protects low-energy (informative) tokens (PiToMe)",
    ),
}


def _runner(name: str, build: Callable[[Any, int], Reducer]) -> Callable[..., Any]:
    def run(
        model: nn.Module,
        data: Iterable[Any] | None,
        config: Any,
        before_surgery: BeforeSurgery | None = None,
    ) -> tuple[nn.Module, TomeReport]:
        return compress_reduction(model, data, config, build, name)

    run.__doc__ = f"Installs {_ENTRIES[name].title} on ``model`` in place (see its config)."
    return run


METHODS = tuple(
    register(
        Method(
            name=name,
            config=entry.config,
            run=_runner(name, entry.build),
            needs_data=False,
            summary=entry.summary,
            stages=entry.stages,
        )
    )
    for name, entry in _ENTRIES.items()
)
METHOD = METHODS[0]
#: ``toast.compress(..., method="tome")``'s driver.
compress_tome = METHOD.run
