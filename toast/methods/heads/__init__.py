"""ToaSt for vision transformers: coupled head-dimension pruning (SCWP, the
ToaSt paper §3.1) and Token Channel Selection (TCS, §3.2) in the FFN, on
Hugging Face ViT, DeiT, DINOv2, ViT-MAE and Swin models.

Modules (only :mod:`~toast.methods.heads.schedules`,
:mod:`~toast.methods.heads.macs` and :mod:`~toast.methods.heads.budget`
are torch-free):

- :mod:`~toast.methods.heads.schedules` — per-block FC1/FC2 ratios and
  head sparsity, the paper's named schedules;
- :mod:`~toast.methods.heads.macs` — :func:`toast_macs`, MACs in ToaSt's
  convention from a config alone (``toast.methods.heads.toast_macs``);
- :mod:`~toast.methods.heads.budget` — :func:`fc2_heavy`, the
  fc2-heavy schedule search against a MAC budget;
- :mod:`~toast.methods.heads.median` — Python wrappers of the C centers
  and scores;
- :mod:`~toast.methods.heads.scwp` — :func:`prune_heads` (masked and
  dense forms);
- :mod:`~toast.methods.heads.tcs` — :func:`enable_tcs` /
  :func:`disable_tcs`; :mod:`~toast.methods.heads.tcs_mlp` — the TCS MLP
  they install;
- :mod:`~toast.methods.heads.finetune` — the optional recovery fine-tune;
- :mod:`~toast.methods.heads.config` — :class:`ToastVitConfig`;
- :mod:`~toast.methods.heads.stages` — the stages the search runs, and configured by
  the user's options what ``compress`` runs; :mod:`~toast.methods.heads.report` — its report;
- :mod:`~toast.methods.heads.compress` — :func:`compress_vit`, registered
  as ``toast.compress(..., method="toast-vit")``.
"""

from toast._lazy import lazy_getattr

_NAMES = {
    "METHOD": "toast.methods.heads.compress",
    "ToastVitReport": "toast.methods.heads.report",
    "compress_vit": "toast.methods.heads.compress",
    "ToastVitConfig": "toast.methods.heads.config",
    "toast_macs": "toast.methods.heads.macs",
}

__all__ = sorted(_NAMES)
__getattr__ = lazy_getattr(__name__, _NAMES)
