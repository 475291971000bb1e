"""ToaSt for vision transformers: coupled head-dimension pruning (SCWP) and
Token Channel Selection (TCS) in the FFN, on Hugging Face ViT, DeiT, DINOv2,
ViT-MAE and Swin models.

Modules (import what you need; only :mod:`toast.vit.schedules` is torch-free):

- :mod:`toast.vit.schedules` — per-block FC1/FC2 ratios and head sparsity,
  the paper's named schedules, the fc2-heavy search against a MAC budget;
- :mod:`toast.vit.median` — Python wrappers of the C centers and scores;
- :mod:`toast.vit.models` — the blocks of a ViT-like model, in global order;
- :mod:`toast.vit.scwp` — :func:`prune_heads` (masked and dense forms);
- :mod:`toast.vit.tcs` — :func:`enable_tcs` / :func:`disable_tcs`;
- :mod:`toast.vit.finetune` — the optional recovery fine-tune loop;
- :mod:`toast.vit.compress` — ``toast.compress(..., method="toast-vit")``.

The MAC counter in ToaSt's convention is :mod:`toast.accounting_toast_vit`
(``toast.macs(config, head_sparsity=..., schedule=...)``).
"""
