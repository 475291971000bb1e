"""Token reduction for vision transformers, training-free: token merging
(ToMe, Bolya et al., ICLR 2023: ``r`` similar tokens per block by bipartite
soft matching on the attention keys, size-weighted merging, proportional
attention) and, as other rules in the same frame, RAPID, Token
Transforming, ATM and PiToMe. See ``docs/merge.md``.

Modules:

- :mod:`~toast.methods.merge.matching` — the arithmetic (matching, merging);
- :mod:`~toast.methods.merge.reducers` — what a reducer is, and ToMe's;
- :mod:`~toast.methods.merge.rapid`, :mod:`~toast.methods.merge.transforming`,
  :mod:`~toast.methods.merge.atm`, :mod:`~toast.methods.merge.pitome` — the other
  reducers;
- :mod:`~toast.methods.merge.sites` — the blocks of HF and timm-layout ViTs;
- :mod:`~toast.methods.merge.install` — :func:`enable_reduction`,
  :func:`enable_merging` / :func:`disable_merging`;
- :mod:`~toast.methods.merge.macs` — tokens per block and analytic MACs
  (torch-free);
- :mod:`~toast.methods.merge.config` — :class:`TomeConfig`, :class:`RapidConfig`,
  :class:`TransformingConfig`, :class:`AtmConfig`, :class:`PitomeConfig`;
- :mod:`~toast.methods.merge.method` — registered as
  ``toast.compress(..., method="tome" | "rapid" | "token-transforming" | "atm" |
  "pitome")``, with their stages alone;
- :mod:`~toast.methods.merge.persist` — the merge state in saves;
- :mod:`~toast.methods.merge.stages` — the stages ``toast.search`` runs;
- :mod:`~toast.methods.merge.configured` — the stages ``toast.compress`` runs
  through the one driver, configured by the user's options;
- :mod:`~toast.methods.merge.labels` — how both name a setting (torch-free);
- :mod:`~toast.methods.merge.report` — :class:`TomeReport`.
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
    "RapidConfig": "toast.methods.merge.config",
    "TransformingConfig": "toast.methods.merge.config",
    "AtmConfig": "toast.methods.merge.config",
    "PitomeConfig": "toast.methods.merge.config",
    "enable_reduction": "toast.methods.merge.install",
    "TomeReport": "toast.methods.merge.report",
}

__all__ = sorted(_NAMES)
__getattr__ = lazy_getattr(__name__, _NAMES)
