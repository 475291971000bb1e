"""The options of ``toast.compress(..., method="toast-vit")``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from toast.hf.calibration import Calibration

__all__ = ["ToastVitConfig"]


@dataclass(frozen=True)
class ToastVitConfig:
    """How ToaSt prunes heads, selects FFN channels and (optionally)
    fine-tunes; see :func:`toast.methods.toast_vit.compress.compress_vit`
    for each field. ``calibration.seed`` seeds TCS's per-image draws and the
    fine-tune."""

    head_sparsity: float | Sequence[float] | Mapping[int, float] | None = None
    schedule: Any = None
    center: str = "geomedian"
    index_sets: str = "shared"
    coupling: str = "coupled"
    form: str = "dense"
    skip: Sequence[int] | str = (0,)
    rescale: bool = False
    mask_bias: bool = False
    tcs_scope: str = "image"
    tcs_form: str = "dense"
    score: str = "auto"
    weights: str = "paper"
    sample_ratio: float | None = None
    hidden: str = "kept"
    finetune_steps: int = 0
    lr: float = 1e-3
    min_lr: float = 1e-5
    weight_decay: float = 1e-4
    loss_fn: Callable | None = None
    image_size: int | None = None
    calibration: Calibration = field(default_factory=Calibration)
