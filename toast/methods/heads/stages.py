"""ToaSt's stages: weight-only (nothing captured), head pruning at a few
sparsities ρ, alone or extending another method's block removal, and for
MAC targets Token Channel Selection schedules; sizes exact from the
modules, predictions a weight-free proxy (ρ times the share of blocks
pruned; the FFN channels TCS drops per block), so they rank ToaSt's plans
among themselves only."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from toast.hf.data.calibration import Calibration
from toast.hf.model.blocks import BlockStack, find_blocks
from toast.hf.model.vit import Attention, VitModel, vit_blocks, vit_view
from toast.methods.heads.config import ToastVitConfig
from toast.methods.heads.finetune import finetune
from toast.methods.heads.macs import toast_macs, vit_arch
from toast.methods.heads.part import METHOD, HeadsPart, heads_parts
from toast.methods.heads.report import ToastVitReport
from toast.methods.heads.schedules import (
    Schedule,
    get_schedule,
    head_keep,
    per_block_sparsity,
    skip_blocks,
)
from toast.methods.heads.scwp import PruneReport, prune_heads
from toast.methods.heads.tcs import TcsHandle, enable_tcs
from toast.methods.stages import BaseStages, Layout, Plan, Request, Shared, Sizes, Stats

__all__ = [
    "HEAD_SPARSITIES",
    "STAGES",
    "TCS_SCHEDULES",
    "ConfiguredToastVitStages",
    "ConfiguredVitStats",
    "ToastVitStages",
    "ToastVitStats",
]

#: The head sparsities ρ a search tries (ToaSt's schedules use 0.5–0.9).
HEAD_SPARSITIES = (0.25, 0.5, 0.75, 0.9)
#: Token Channel Selection schedules a search tries on ViTs, for MAC and
#: latency targets (TCS removes no parameter): ToaSt's named schedules
#: prune the FFN channels of the last blocks hardest; these do so on the
#: last third of the blocks of any depth: ``{name: (FC1 ratio of the last
#: block, FC2 ratio of the last third)}``.
TCS_SCHEDULES: dict[str, tuple[float, float]] = {"late-0.5": (0.0, 0.5), "late-0.9": (0.3, 0.9)}
#: Blocks head pruning leaves intact (ToaSt's default: the first).
SKIP_HEADS = (0,)


def tcs_schedule(name: str, num_blocks: int) -> dict[str, dict[int, float]]:
    """The TCS schedule ``name`` of :data:`TCS_SCHEDULES` for ``num_blocks``
    blocks, as :func:`toast.methods.heads.tcs.enable_tcs` takes it (0-based blocks)."""
    fc1, fc2 = TCS_SCHEDULES[name]
    last_third = range(num_blocks - max(1, math.ceil(num_blocks / 3)), num_blocks)
    schedule: dict[str, dict[int, float]] = {"fc2": {b: fc2 for b in last_third}}
    if fc1:
        schedule["fc1"] = {num_blocks - 1: fc1}
    return schedule


def _head_dims_params(vm: VitModel) -> tuple[int, ...]:
    """Per block the parameters one head dimension costs."""
    return tuple(_head_dim_params(b.attention) for b in vm.blocks)


def _head_dim_params(attention: Attention) -> int:
    """Parameters one head dimension costs: a row of Q, K and V (with
    their biases) and a column of the output projection."""
    per_dim = 0
    for linear in (attention.q_proj, attention.k_proj, attention.v_proj):
        per_dim += linear.in_features + (1 if linear.bias is not None else 0)
    return per_dim + attention.o_proj.out_features


@dataclass
class ToastVitStats(Stats):
    """What sizes and predictions are made of, read from the weights:
    per block the parameters one head dimension costs and ``(heads,
    head_dim)``; the sparsities every head survives; and per ``(ρ,
    schedule)`` the FFN MACs Token Channel Selection saves, with the
    original's MACs in ToaSt's count (empty where TCS does not apply)."""

    head_dim_params: tuple[int, ...] = ()
    head_dims: tuple[tuple[int, int], ...] = ()
    sparsities: tuple[float, ...] = ()
    tcs_saved: dict[tuple[float, str], int] | None = None
    macs: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.head_dims)

    def head_params_removed(self, rho: float, spans: Iterable[tuple[int, int]] = ()) -> int:
        """Parameters ρ removes from the blocks no span removes."""
        gone = {k for a, b in spans for k in range(a, b)}
        total = 0
        for k, per_dim in enumerate(self.head_dim_params):
            if k in gone or k in SKIP_HEADS:
                continue
            heads, head_dim = self.head_dims[k]
            total += heads * (head_dim - head_keep(head_dim, rho)) * per_dim
        return total

    def head_proxy(self, rho: float, spans: Iterable[tuple[int, int]]) -> float:
        pruned = self.num_blocks - len(SKIP_HEADS) - sum(b - a for a, b in spans)
        return rho * max(pruned, 0) / self.num_blocks

    def tcs_proxy(self, name: str) -> float:
        # a weight-free proxy as for heads: the FFN channels dropped, per block
        schedule = tcs_schedule(name, self.num_blocks)
        dropped = sum(schedule["fc2"].values()) + sum(schedule.get("fc1", {}).values())
        return dropped / self.num_blocks


def _can_prune(head_dims: tuple[tuple[int, int], ...], rho: float) -> bool:
    """Whether ``rho`` leaves every pruned head at least one dimension."""
    try:
        for _, head_dim in head_dims:
            head_keep(head_dim, rho)
    except ValueError:
        return False
    return True


def _tcs_saved(config: object, num_blocks: int, rhos: Iterable[float]) -> dict:
    """FFN MACs per image each TCS schedule saves, in ToaSt's count, by ρ
    (empty for MLPs TCS does not take: SwiGLU)."""
    try:
        if vit_arch(config).swiglu:
            return {}
    except (ValueError, TypeError, AttributeError):
        return {}
    saved = {}
    for rho in rhos:
        full = toast_macs(config, head_sparsity=rho, schedule=None).ffn
        for name in TCS_SCHEDULES:
            schedule = tcs_schedule(name, num_blocks)
            pruned = toast_macs(config, head_sparsity=rho, schedule=schedule).ffn
            saved[(rho, name)] = int(round(full - pruned))
    return saved


class ToastVitStages(BaseStages):
    """ToaSt as stages (family ``"toast-vit"``; extends other methods'
    extendable plans as ``"<family>+toast-vit"``)."""

    def structure(self, model: nn.Module, stack: BlockStack) -> VitModel | None:
        # e.g. Swin's stages: no block removal beside heads, so no ToaSt either
        return vit_view(model, stack)

    def configured(self, config: ToastVitConfig) -> ConfiguredToastVitStages:
        return ConfiguredToastVitStages(config)

    def calibrate(
        self,
        model: nn.Module,
        data: Iterable,
        layout: Layout,
        shared: Shared | None,
        calibration: Calibration,
        max_blocks: int,
    ) -> ToastVitStats:
        vm = layout.part("toast-vit")
        if vm is None:
            return ToastVitStats(note="")
        head_dims = tuple((b.heads, b.head_dim) for b in vm.blocks)
        sparsities = tuple(rho for rho in HEAD_SPARSITIES if _can_prune(head_dims, rho))
        config = model.config
        saved = _tcs_saved(config, vm.num_blocks, (0.0, *sparsities))
        return ToastVitStats(
            head_dim_params=_head_dims_params(vm),
            head_dims=head_dims,
            sparsities=sparsities,
            tcs_saved=saved,
            macs=int(toast_macs(config).macs) if saved else 0,
        )

    def propose(self, stats: Stats, sizes: Sizes, max_blocks: int, macs_matter: bool) -> list[Plan]:
        assert isinstance(stats, ToastVitStats)
        if not stats.head_dims:
            return []
        schedules = [None, *TCS_SCHEDULES] if macs_matter and stats.tcs_saved else [None]
        plans = []
        for rho in [None, *stats.sparsities]:
            params = sizes.params - (0 if rho is None else stats.head_params_removed(rho))
            heads = 0.0 if rho is None else stats.head_proxy(rho, ())
            for name in schedules:
                if rho is None and name is None:
                    continue  # the original model
                predicted = heads + (0.0 if name is None else stats.tcs_proxy(name))
                unseen = 0 if name is None else stats.tcs_saved[(rho or 0.0, name)]  # type: ignore[index]
                plans.append(
                    Plan(
                        ("toast-vit",),
                        "toast-vit",
                        (),
                        None,
                        params,
                        predicted,
                        unseen_macs=unseen,
                        unseen_share=unseen / stats.macs if unseen else 0.0,
                        extendable=True,  # by token merging
                        parts=heads_parts(rho, name),
                    )
                )
        return plans

    def extend(self, plan: Plan, stats: Stats, sizes: Sizes) -> list[Plan]:
        assert isinstance(stats, ToastVitStats)
        if not stats.head_dims or plan.part(METHOD) is not None:
            return []
        return [
            plan.with_part(
                HeadsPart(rho),
                methods=(*plan.methods, METHOD),
                family=f"{plan.family}+{METHOD}",
                params_after=plan.params_after - stats.head_params_removed(rho, plan.spans),
                predicted_error=plan.predicted_error + stats.head_proxy(rho, plan.spans),
                extendable=False,
            )
            for rho in stats.sparsities
        ]

    def apply(self, model: nn.Module, plan: Plan, stats: Stats, layout: Layout) -> None:
        part: HeadsPart | None = plan.part(METHOD)
        if part is not None and part.head_sparsity is not None:
            prune_heads(model, part.head_sparsity, blocks=_remaining(model, layout))

    def finish(self, model: nn.Module, plan: Plan, stats: Stats, layout: Layout) -> None:
        part: HeadsPart | None = plan.part(METHOD)
        if part is not None and part.schedule is not None:
            vm = _remaining(model, layout)
            schedule = tcs_schedule(part.schedule, vm.num_blocks)
            enable_tcs(model, schedule, seed=0, blocks=vm)


def _remaining(model: nn.Module, layout: Layout) -> VitModel:
    """The layout's ViT blocks still in ``model``'s block list (another
    method's plan may have removed some), numbered anew."""
    vm = layout.part("toast-vit")
    assert vm is not None  # no ToaSt plan without it
    current = find_blocks(model, layout.stack).blocks  # the path, looked up again
    kept = [b for b in vm.blocks if any(b.block is m for m in current)]
    if len(kept) == vm.num_blocks:
        return vm
    blocks = tuple(dataclasses.replace(b, index=i) for i, b in enumerate(kept))
    return VitModel(vm.model_type, blocks, vm.prefix)


# Which config field feeds each keyword of the three steps ({keyword: field}).
_SCWP = {k: k for k in ("center", "index_sets", "coupling", "form", "rescale", "mask_bias")}
_FINETUNE = {
    "steps": "finetune_steps",
    **{k: k for k in ("lr", "min_lr", "weight_decay", "loss_fn")},
}
_TCS = {
    "scope": "tcs_scope",
    "form": "tcs_form",
    **{k: k for k in ("score", "weights", "sample_ratio", "hidden")},
}


def _arguments(config: ToastVitConfig, names: dict[str, str]) -> dict[str, Any]:
    """Keyword arguments ``{keyword: config.<field>}`` for ``names``."""
    return {keyword: getattr(config, name) for keyword, name in names.items()}


def _block_list(vm: VitModel) -> str:
    """The path of the list holding ``vm``'s blocks; for Swin, whose blocks
    sit in one list per stage, of the stages' list."""
    parents = {b.path.rpartition(".")[0] for b in vm.blocks}
    if len(parents) == 1:
        return parents.pop()
    return vm.blocks[0].path.rsplit(".", 3)[0]  # <stages>.<i>.blocks.<j>


def _named_sparsity(config: ToastVitConfig, sched: Schedule) -> Any:
    """The ρ the config asks for: its own, else the named schedule's, else 0.9."""
    rho = config.head_sparsity
    if rho is None:
        rho = sched.head_sparsity if config.schedule is not None else 0.9
    return rho


def _one_sparsity(config: ToastVitConfig, sched: Schedule) -> float | None:
    """The one ρ the config names (its own, else the named schedule's, else
    0.9); None when it gives one per block."""
    rho = _named_sparsity(config, sched)
    return float(rho) if isinstance(rho, (int, float)) else None


def _head_sparsity(config: ToastVitConfig, sched: Schedule, skip: list[int]) -> tuple[float, ...]:
    """ρ per block: the config's, else the named schedule's, else 0.9."""
    return per_block_sparsity(_named_sparsity(config, sched), sched.num_blocks, skip)


@dataclass
class ConfiguredVitStats(ToastVitStats):
    """What ``compress`` read before changing the model (the weights'
    figures of :class:`ToastVitStats`; the config's ViT blocks, TCS
    schedule, ρ per block, the MACs before and the FFN MACs TCS saves;
    ``data``, the batches the fine-tune reads, None when none were given),
    and what ``apply`` and ``finish`` did, which the report shows: one
    compression's record, never cached."""

    data: Iterable | None = None
    vm: VitModel | None = None
    schedule: Schedule | None = None
    rho: dict[int, float] = field(default_factory=dict)
    gmacs_before: float = 0.0
    tcs_macs: int = 0
    pruning: PruneReport | None = None
    losses: list[float] = field(default_factory=list)
    tcs: TcsHandle | None = None
    gmacs_after: float = 0.0


def _tcs_macs(config: object, stats: ConfiguredVitStats, image_size: int | None) -> int:
    """FFN MACs per image the configured TCS schedule saves at the
    configured ρ, in ToaSt's count (0: no TCS, or an MLP it does not take)."""
    assert stats.schedule is not None
    if not stats.schedule.active_blocks:
        return 0
    try:
        if vit_arch(config).swiglu:
            return 0
    except (ValueError, TypeError, AttributeError):
        return 0
    full, pruned = (
        toast_macs(config, head_sparsity=stats.rho, schedule=s, skip=(), image_size=image_size).ffn
        for s in (None, stats.schedule)
    )
    return int(round(full - pruned))


class ConfiguredToastVitStages(ToastVitStages):
    """ToaSt as ``toast.compress`` runs it: the one plan the config fixes
    (ρ per block, the TCS schedule, every SCWP and TCS option, the
    fine-tune), applied as :func:`toast.methods.heads.compress.compress_vit`
    documents; the plan equals the search's where the search has that
    setting (one ρ of :data:`HEAD_SPARSITIES` on every block but the first,
    the default options)."""

    def __init__(self, config: ToastVitConfig) -> None:
        self.config = config

    def request(self, config: Any) -> Request:
        return Request()  # the config fixes the plan: no size to ask

    def reach(self, request: Request) -> int:
        return 0

    def choose(self, plans: Sequence[Plan], request: Request) -> Plan | None:
        return plans[0] if plans else None

    def data_optional(self, request: Any) -> bool:
        return True  # ToaSt reads the weights; data only for the fine-tune

    def layout(self, model: nn.Module, blocks: str | None) -> Layout | None:
        # ToaSt's one discovery, as before the driver: its ViT blocks (ToaSt's
        # error for any other model), the stack their list (``blocks`` unread)
        vm = vit_blocks(model)
        return Layout(find_blocks(model, _block_list(vm)), {"toast-vit": vm})

    def calibrate(
        self,
        model: nn.Module,
        data: Iterable | None,
        layout: Layout,
        shared: Shared | None,
        calibration: Calibration,
        max_blocks: int,
    ) -> ConfiguredVitStats:
        config = self.config
        if config.finetune_steps and data is None:
            raise ValueError("finetune_steps > 0 needs a loader")
        vm = layout.part("toast-vit")
        if vm is None:  # a layout found otherwise: the driver asks layout() first
            vm = vit_blocks(model)
        sched = get_schedule(config.schedule, vm.num_blocks)
        skip = skip_blocks(config.skip, vm.stage_firsts)
        macs = toast_macs(model.config, head_sparsity=0.0, image_size=config.image_size)
        stats = ConfiguredVitStats(
            head_dim_params=_head_dims_params(vm),
            head_dims=tuple((b.heads, b.head_dim) for b in vm.blocks),
            data=data,
            vm=vm,
            schedule=sched,
            rho=dict(enumerate(_head_sparsity(config, sched, skip))),
            gmacs_before=macs.gmacs,
        )
        stats.tcs_macs = _tcs_macs(model.config, stats, config.image_size)
        stats.macs = int(macs.macs) if stats.tcs_macs else 0
        return stats

    def propose(self, stats: Stats, sizes: Sizes, max_blocks: int, macs_matter: bool) -> list[Plan]:
        assert isinstance(stats, ConfiguredVitStats) and stats.schedule is not None
        return [_configured_plan(self.config, stats, sizes)]

    def apply(self, model: nn.Module, plan: Plan, stats: Stats, layout: Layout) -> None:
        # the weights: SCWP, then the fine-tune that recovers from it
        assert isinstance(stats, ConfiguredVitStats)
        config = self.config
        stats.pruning = prune_heads(
            model, stats.rho, skip=(), blocks=stats.vm, **_arguments(config, _SCWP)
        )
        if config.finetune_steps and stats.data is not None:
            options = _arguments(config, _FINETUNE)
            stats.losses = finetune(model, stats.data, seed=config.calibration.seed, **options)

    def finish(self, model: nn.Module, plan: Plan, stats: Stats, layout: Layout) -> None:
        # run time: TCS on the fine-tuned weights, and the MACs it leaves
        assert isinstance(stats, ConfiguredVitStats) and stats.schedule is not None
        config, sched = self.config, stats.schedule
        if sched.active_blocks:
            seed = config.calibration.seed
            stats.tcs = enable_tcs(
                model, sched, seed=seed, blocks=stats.vm, **_arguments(config, _TCS)
            )
        stats.gmacs_after = toast_macs(
            model.config,
            head_sparsity=stats.rho,
            schedule=sched,
            skip=(),
            image_size=config.image_size,
        ).gmacs

    def report(
        self, plan: Plan, stats: Stats, sizes: Sizes, spans: Sequence[Any], params_after: int
    ) -> ToastVitReport:
        assert isinstance(stats, ConfiguredVitStats) and stats.vm is not None
        assert stats.pruning is not None and stats.schedule is not None  # apply ran
        return ToastVitReport(
            method="toast-vit",
            blocks_before=stats.vm.num_blocks,
            blocks_after=stats.vm.num_blocks,
            params_before=sizes.params,
            params_after=params_after,
            pruning=stats.pruning,
            schedule=stats.schedule,
            tcs=stats.tcs,
            gmacs_before=stats.gmacs_before,
            gmacs_after=stats.gmacs_after,
            finetune_losses=stats.losses,
        )


def _schedule_name(config: ToastVitConfig, sched: Schedule) -> str:
    """How a plan names the configured TCS schedule: the search's name
    where it is one of :data:`TCS_SCHEDULES`, else the config's name, else
    its description."""
    n = sched.num_blocks
    for name in TCS_SCHEDULES:
        if get_schedule(tcs_schedule(name, n), n) == sched:
            return name
    return config.schedule if isinstance(config.schedule, str) else sched.describe()


def _configured_plan(config: ToastVitConfig, stats: ConfiguredVitStats, sizes: Sizes) -> Plan:
    """The plan the config fixes, sized and predicted as the search's
    (:meth:`ToastVitStages.propose`): exactly its plan where the config
    names one ρ on every block but the first (the search's
    :data:`SKIP_HEADS`), else the same count per block."""
    assert stats.schedule is not None
    sched, n = stats.schedule, stats.num_blocks
    one = _one_sparsity(config, sched)
    if one is not None and tuple(stats.rho.values()) == per_block_sparsity(one, n, SKIP_HEADS):
        removed, heads = stats.head_params_removed(one), stats.head_proxy(one, ())
    else:
        removed = sum(
            h * (d - head_keep(d, stats.rho[k])) * stats.head_dim_params[k]
            for k, (h, d) in enumerate(stats.head_dims)
        )
        heads = sum(stats.rho.values()) / n
    if config.form != "dense":
        removed = 0  # the masked form zeroes the weights it prunes: none go
    name = None
    if sched.active_blocks:
        name = _schedule_name(config, sched)
        heads += (sum(sched.fc2) + sum(sched.fc1)) / n
    unseen = stats.tcs_macs
    return Plan(
        ("toast-vit",),
        "toast-vit",
        (),
        None,
        sizes.params - removed,
        heads,
        unseen_macs=unseen,
        unseen_share=unseen / stats.macs if unseen else 0.0,
        extendable=True,
        # ρ = 0 prunes nothing: no head pruning, as the search's plans say
        parts=heads_parts(one or None, name),
    )


STAGES = ToastVitStages()
