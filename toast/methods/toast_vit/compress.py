"""``toast.compress(model, method="toast-vit", ...)``: SCWP head pruning, an
optional recovery fine-tune, then Token Channel Selection — in place."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from toast.hf.params import count_params
from toast.methods.base import Method, register
from toast.methods.toast_vit.blocks import vit_blocks
from toast.methods.toast_vit.config import ToastVitConfig
from toast.methods.toast_vit.finetune import finetune
from toast.methods.toast_vit.macs import toast_macs
from toast.methods.toast_vit.schedules import Schedule, get_schedule, per_block_sparsity
from toast.methods.toast_vit.scwp import PruneReport, prune_heads
from toast.methods.toast_vit.tcs import TcsHandle, enable_tcs

__all__ = ["ToastVitReport", "compress_vit"]


@dataclass
class ToastVitReport:
    """What ``compress(..., method="toast-vit")`` did. ``gmacs_*`` are
    ToaSt-convention GMACs per image (:func:`toast.methods.toast_vit.macs.toast_macs`)."""

    method: str
    pruning: PruneReport
    schedule: Schedule
    tcs: TcsHandle | None = field(repr=False)
    params_before: int
    params_after: int
    gmacs_before: float
    gmacs_after: float
    finetune_losses: list[float] = field(default_factory=list, repr=False)

    @property
    def compression_by_params(self) -> float:
        return 1.0 - self.params_after / self.params_before

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
            f"parameters: {self.params_before:,} → {self.params_after:,} "
            f"(−{100 * self.compression_by_params:.1f}%).",
        ]
        if self.finetune_losses:
            lines.append(
                f"Fine-tuned {len(self.finetune_losses)} steps: loss "
                f"{self.finetune_losses[0]:.4g} → {self.finetune_losses[-1]:.4g}."
            )
        return "\n".join(lines)


def compress_vit(
    model: nn.Module,
    loader: Iterable | None = None,
    *,
    head_sparsity: float | Sequence[float] | Mapping[int, float] | None = None,
    schedule: Any = None,
    center: str = "geomedian",
    index_sets: str = "shared",
    coupling: str = "coupled",
    form: str = "dense",
    skip: Sequence[int] | str = (0,),
    rescale: bool = False,
    mask_bias: bool = False,
    tcs_scope: str = "image",
    tcs_form: str = "dense",
    score: str = "auto",
    weights: str = "paper",
    sample_ratio: float | None = None,
    hidden: str = "kept",
    seed: int = 0,
    finetune_steps: int = 0,
    lr: float = 1e-3,
    min_lr: float = 1e-5,
    weight_decay: float = 1e-4,
    loss_fn: Callable | None = None,
    image_size: int | None = None,
) -> tuple[nn.Module, ToastVitReport]:
    """ToaSt on an HF ViT / DeiT / DINOv2 / ViT-MAE / Swin model, in place.

    1. :func:`toast.prune_heads` with ``head_sparsity`` (default: the named
       schedule's ρ, else 0.9) and ``center``, ``index_sets``, ``coupling``,
       ``form``, ``skip``, ``rescale``, ``mask_bias``;
    2. if ``finetune_steps`` > 0, :func:`toast.methods.toast_vit.finetune.finetune` on
       ``loader`` (AdamW + cosine, masks re-applied; ``loss_fn(model, batch)``
       or batches of ``(pixel_values, labels)`` / dicts with labels);
    3. :func:`toast.enable_tcs` with ``schedule`` (``None``: no TCS) and
       ``tcs_scope``, ``tcs_form``, ``score``, ``weights``, ``sample_ratio``,
       ``hidden``, ``seed``.

    ``loader`` is only needed for the fine-tune: ToaSt itself uses no data.
    Returns the model and a :class:`ToastVitReport`.
    """
    vm = vit_blocks(model)
    sched = get_schedule(schedule, vm.num_blocks)
    if head_sparsity is None:
        head_sparsity = sched.head_sparsity if schedule is not None else 0.9
    if finetune_steps and loader is None:
        raise ValueError("finetune_steps > 0 needs a loader")
    skip_blocks = vm.stage_firsts() if skip == "stage_first" else list(skip)
    rho = per_block_sparsity(head_sparsity, vm.num_blocks, skip_blocks)
    config = model.config
    gmacs_before = toast_macs(config, head_sparsity=0.0, image_size=image_size).gmacs
    params_before = count_params(model)
    pruning = prune_heads(
        model,
        dict(enumerate(rho)),
        center=center,
        index_sets=index_sets,
        coupling=coupling,
        form=form,
        skip=(),
        rescale=rescale,
        mask_bias=mask_bias,
    )
    losses: list[float] = []
    if finetune_steps:
        losses = finetune(
            model,
            loader,
            steps=finetune_steps,
            lr=lr,
            min_lr=min_lr,
            weight_decay=weight_decay,
            loss_fn=loss_fn,
        )
    handle = None
    if sched.active_blocks:
        handle = enable_tcs(
            model,
            sched,
            scope=tcs_scope,
            seed=seed,
            score=score,
            weights=weights,
            form=tcs_form,
            sample_ratio=sample_ratio,
            hidden=hidden,
        )
    gmacs_after = toast_macs(
        config, head_sparsity=dict(enumerate(rho)), schedule=sched, skip=(), image_size=image_size
    ).gmacs
    report = ToastVitReport(
        method="toast-vit",
        pruning=pruning,
        schedule=sched,
        tcs=handle,
        params_before=params_before,
        params_after=pruning.params_after,
        gmacs_before=gmacs_before,
        gmacs_after=gmacs_after,
        finetune_losses=losses,
    )
    return model, report


def _run(model: nn.Module, data: Iterable | None, config: ToastVitConfig):
    options = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    options.pop("calibration")
    return compress_vit(model, data, seed=config.calibration.seed, **options)


METHOD = register(
    Method(
        name="toast-vit",
        config=ToastVitConfig,
        run=_run,
        needs_data=False,
        summary="ViT head-dimension pruning by geometric median and Token Channel Selection",
    )
)
