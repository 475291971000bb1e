"""Token merging (ToMe, Bolya et al., ICLR 2023) for vision transformers:
training-free, merges ``r`` similar tokens per block by bipartite soft
matching on the attention keys, with size-weighted merging and
proportional attention. See ``docs/merge.md``.

Modules:

- :mod:`~toast.methods.merge.matching` — the arithmetic (matching, merging);
- :mod:`~toast.methods.merge.sites` — the blocks of HF and timm-layout ViTs;
- :mod:`~toast.methods.merge.install` — :func:`enable_merging` /
  :func:`disable_merging`;
- :mod:`~toast.methods.merge.macs` — tokens per block and analytic MACs
  (torch-free);
- :mod:`~toast.methods.merge.config` — :class:`TomeConfig`;
- :mod:`~toast.methods.merge.method` — registered as
  ``toast.compress(..., method="tome")``;
- :mod:`~toast.methods.merge.persist` — the merge state in saves;
- :mod:`~toast.methods.merge.stages` — the stages ``toast.search`` runs.
"""

from toast._lazy import lazy_getattr

_NAMES = {
    "enable_merging": "toast.methods.merge.install",
    "disable_merging": "toast.methods.merge.install",
    "merge_schedule": "toast.methods.merge.macs",
    "merging_of": "toast.methods.merge.install",
    "MergeHandle": "toast.methods.merge.install",
    "merged_macs": "toast.methods.merge.macs",
    "tokens_per_block": "toast.methods.merge.macs",
    "TomeConfig": "toast.methods.merge.config",
    "TomeReport": "toast.methods.merge.method",
}

__all__ = sorted(_NAMES)
__getattr__ = lazy_getattr(__name__, _NAMES)
