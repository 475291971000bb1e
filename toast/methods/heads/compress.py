"""``toast.compress(model, method="toast-vit", ...)``: SCWP head pruning, an
optional recovery fine-tune, then Token Channel Selection — in place."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from toast.hf.model.params import count_params
from toast.hf.model.vit import VitModel, vit_blocks
from toast.methods.base import BeforeSurgery, Method, Report, register
from toast.methods.heads.config import ToastVitConfig
from toast.methods.heads.finetune import finetune
from toast.methods.heads.macs import toast_macs
from toast.methods.heads.schedules import (
    Schedule,
    get_schedule,
    per_block_sparsity,
    skip_blocks,
)
from toast.methods.heads.scwp import PruneReport, prune_heads
from toast.methods.heads.stages import STAGES
from toast.methods.heads.tcs import TcsHandle, enable_tcs

__all__ = ["METHOD", "ToastVitReport", "compress_vit"]

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


def compress_vit(
    model: nn.Module,
    data: Iterable[Any] | None,
    config: ToastVitConfig,
    before_surgery: BeforeSurgery | None = None,
) -> tuple[nn.Module, ToastVitReport]:
    """ToaSt on an HF ViT / DeiT / DINOv2 / ViT-MAE / Swin model, in place
    (the fields are described on :class:`ToastVitConfig`):

    1. SCWP, :func:`toast.methods.heads.scwp.prune_heads` with ``config.head_sparsity``
       (default: the named schedule's ρ, else 0.9);
    2. if ``config.finetune_steps`` > 0, the recovery fine-tune
       (:func:`toast.methods.heads.finetune.finetune`) on ``data``
       (batches of ``(pixel_values, labels)``, dicts with labels, or
       anything ``config.loss_fn(model, batch)`` takes);
    3. TCS, :func:`toast.methods.heads.tcs.enable_tcs` with ``config.schedule`` (None: no TCS).

    ``data`` is only needed for the fine-tune: ToaSt itself uses no data.
    ``config.calibration.seed`` seeds the fine-tune and TCS's token samples.
    ToaSt removes no block, so ``before_surgery`` is never called.
    """
    if config.finetune_steps and data is None:
        raise ValueError("finetune_steps > 0 needs a loader")
    vm = vit_blocks(model)
    sched = get_schedule(config.schedule, vm.num_blocks)
    rho = dict(enumerate(_head_sparsity(config, sched, skip_blocks(config.skip, vm.stage_firsts))))
    gmacs_before = toast_macs(model.config, head_sparsity=0.0, image_size=config.image_size).gmacs
    params_before = count_params(model)
    pruning = prune_heads(model, rho, skip=(), blocks=vm, **_arguments(config, _SCWP))
    losses = _finetune(model, data, config)
    handle = _enable_tcs(model, sched, config, vm)
    gmacs_after = toast_macs(
        model.config, head_sparsity=rho, schedule=sched, skip=(), image_size=config.image_size
    ).gmacs
    report = ToastVitReport(
        method="toast-vit",
        blocks_before=vm.num_blocks,
        blocks_after=vm.num_blocks,
        params_before=params_before,
        params_after=count_params(model),
        pruning=pruning,
        schedule=sched,
        tcs=handle,
        gmacs_before=gmacs_before,
        gmacs_after=gmacs_after,
        finetune_losses=losses,
    )
    return model, report


def _arguments(config: ToastVitConfig, names: dict[str, str]) -> dict[str, Any]:
    """Keyword arguments ``{keyword: config.<field>}`` for ``names``."""
    return {keyword: getattr(config, name) for keyword, name in names.items()}


def _head_sparsity(config: ToastVitConfig, sched: Schedule, skip: list[int]) -> tuple[float, ...]:
    """ρ per block: the config's, else the named schedule's, else 0.9."""
    rho = config.head_sparsity
    if rho is None:
        rho = sched.head_sparsity if config.schedule is not None else 0.9
    return per_block_sparsity(rho, sched.num_blocks, skip)


def _finetune(model: nn.Module, data: Iterable[Any] | None, config: ToastVitConfig) -> list[float]:
    if not config.finetune_steps or data is None:
        return []
    options = _arguments(config, _FINETUNE)
    return finetune(model, data, seed=config.calibration.seed, **options)


def _enable_tcs(
    model: nn.Module, sched: Schedule, config: ToastVitConfig, vm: VitModel
) -> TcsHandle | None:
    if not sched.active_blocks:
        return None
    seed = config.calibration.seed
    return enable_tcs(model, sched, seed=seed, blocks=vm, **_arguments(config, _TCS))


METHOD = register(
    Method(
        name="toast-vit",
        config=ToastVitConfig,
        run=compress_vit,
        needs_data=False,
        summary="ViT head-dimension pruning by geometric median and Token Channel Selection",
        stages=STAGES,
    )
)
