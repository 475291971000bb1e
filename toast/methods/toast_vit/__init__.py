"""ToaSt for vision transformers: coupled head-dimension pruning (SCWP) and
Token Channel Selection (TCS) in the FFN, on Hugging Face ViT, DeiT, DINOv2,
ViT-MAE and Swin models.

Modules (import what you need; only :mod:`toast.methods.toast_vit.schedules` is torch-free):

- :mod:`toast.methods.toast_vit.schedules` — per-block FC1/FC2 ratios and head sparsity,
  the paper's named schedules, the fc2-heavy search against a MAC budget;
- :mod:`toast.methods.toast_vit.median` — Python wrappers of the C centers and scores;
- :mod:`toast.methods.toast_vit.blocks` — the blocks of a ViT-like model, in global order;
- :mod:`toast.methods.toast_vit.scwp` — :func:`prune_heads` (masked and dense forms);
- :mod:`toast.methods.toast_vit.tcs` — :func:`enable_tcs` / :func:`disable_tcs`;
- :mod:`toast.methods.toast_vit.finetune` — the optional recovery fine-tune loop;
- :mod:`toast.methods.toast_vit.compress` — ``toast.compress(..., method="toast-vit")``.

The MAC counter in ToaSt's convention is :mod:`toast.methods.toast_vit.macs`
(``toast.macs(config, head_sparsity=..., schedule=...)``).
"""

from toast.methods.toast_vit.compress import METHOD, ToastVitReport, compress_vit
from toast.methods.toast_vit.config import ToastVitConfig

__all__ = ["METHOD", "ToastVitConfig", "ToastVitReport", "compress_vit"]
