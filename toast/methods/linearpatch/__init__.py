"""LinearPatch (Chen et al., "A Simple Linear Patch Revives Layer-Pruned
Large Language Models", NeurIPS 2025, arXiv 2505.24680), registered as
``toast.compress(model, data, method="linearpatch")``: the window of blocks
whose input and output are most alike (cosine) is removed and replaced by
``H diag(d) Hᵀ``, a per-channel scale in a Hadamard basis.

- :mod:`~toast.methods.linearpatch.config`: :class:`LinearPatchConfig` (torch-free);
- :mod:`~toast.methods.linearpatch.statistics`: the one pass (per-sample
  rotated magnitudes of every state, cosine of every pair of states);
- :mod:`~toast.methods.linearpatch.stages`: its stages (what ``toast.search`` runs);
- :mod:`~toast.methods.linearpatch.method`: the orchestrator and its report.

toast's own fits of the same form, from the moments alone
(``translator="rotated_diagonal"`` and ``"patch_ridge"`` of
``method="toast"``), are in :mod:`toast.core.patch`.
"""

from toast._lazy import lazy_getattr

_NAMES = {"LinearPatchConfig": "toast.methods.linearpatch.config"}

__all__ = sorted(_NAMES)

__getattr__ = lazy_getattr(__name__, _NAMES)
