"""ToaSt for vision transformers: coupled head-dimension pruning (SCWP, the
ToaSt paper §3.1) and Token Channel Selection (TCS, §3.2) in the FFN, on
Hugging Face ViT, DeiT, DINOv2, ViT-MAE and Swin models.

Modules (only :mod:`~toast.methods.toast_vit.schedules`,
:mod:`~toast.methods.toast_vit.macs` and :mod:`~toast.methods.toast_vit.budget`
are torch-free):

- :mod:`~toast.methods.toast_vit.schedules` — per-block FC1/FC2 ratios and
  head sparsity, the paper's named schedules;
- :mod:`~toast.methods.toast_vit.macs` — :func:`toast_macs`, MACs in ToaSt's
  convention from a config alone (``toast.methods.toast_vit.toast_macs``);
- :mod:`~toast.methods.toast_vit.budget` — :func:`fc2_heavy`, the
  fc2-heavy schedule search against a MAC budget;
- :mod:`~toast.methods.toast_vit.median` — Python wrappers of the C centers
  and scores;
- :mod:`~toast.methods.toast_vit.blocks` — the blocks of a ViT-like model, in
  global order;
- :mod:`~toast.methods.toast_vit.scwp` — :func:`prune_heads` (masked and
  dense forms);
- :mod:`~toast.methods.toast_vit.tcs` — :func:`enable_tcs` /
  :func:`disable_tcs`;
- :mod:`~toast.methods.toast_vit.finetune` — the optional recovery fine-tune;
- :mod:`~toast.methods.toast_vit.config` — :class:`ToastVitConfig`;
- :mod:`~toast.methods.toast_vit.compress` — :func:`compress_vit`, registered
  as ``toast.compress(..., method="toast-vit")``.
"""

from toast._lazy import lazy_getattr

_NAMES = {
    "METHOD": "toast.methods.toast_vit.compress",
    "ToastVitReport": "toast.methods.toast_vit.compress",
    "compress_vit": "toast.methods.toast_vit.compress",
    "ToastVitConfig": "toast.methods.toast_vit.config",
    "toast_macs": "toast.methods.toast_vit.macs",
}

__all__ = sorted(_NAMES)
__getattr__ = lazy_getattr(__name__, _NAMES)
