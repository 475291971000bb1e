"""ReplaceMe (Shopkhoev et al., "ReplaceMe", arXiv 2505.02819): depth
pruning with a linear transform folded into the last kept block's
down-projection.

:func:`replaceme` runs the method; :class:`ReplaceMeConfig` holds its
options; ``toast.compress(model, data, method="replaceme", ...)`` reaches
it through the method registry.

- :mod:`~toast.methods.replaceme.config`: :class:`ReplaceMeConfig` (torch-free);
- :mod:`~toast.methods.replaceme.profile`: the distance profile and cut selection;
- :mod:`~toast.methods.replaceme.cuts`: explicit or profiled cuts;
- :mod:`~toast.methods.replaceme.estimate`: the pass estimating each cut's transform;
- :mod:`~toast.methods.replaceme.cosine`: the cosine objective (Adam, L-BFGS);
- :mod:`~toast.methods.replaceme.fold`: folding T into the down-projection;
- :mod:`~toast.methods.replaceme.report`, :mod:`~toast.methods.replaceme.params`;
- :mod:`~toast.methods.replaceme.method`: :func:`replaceme`, and the
  registration as ``"replaceme"`` (its stages alone);
- :mod:`~toast.methods.replaceme.stages`: the search's stages;
  :mod:`~toast.methods.replaceme.configured`: the stages a config asks for,
  which ``toast.compress`` runs through the one driver;
- :mod:`~toast.methods.replaceme.disk`: its passes on a checkpoint on disk,
  block by block, and the pruned checkpoint written without the model;
  :mod:`~toast.methods.replaceme.from_disk`: :func:`replaceme_from_disk`,
  the whole method on a folder;
- a model folder, in memory or from disk by the memory budget:
  ``toast.compress(folder, data, method="replaceme", output=...)``;
- the command line is ``toast compress MODEL --method replaceme ...``.
"""

from toast._lazy import lazy_getattr

_NAMES = {
    "ReplaceMeConfig": "toast.methods.replaceme.config",
    "DISTANCES": "toast.methods.replaceme.config",
    "CosineFit": "toast.methods.replaceme.cosine",
    "fit_cosine": "toast.methods.replaceme.cosine",
    "TransformedProjection": "toast.methods.replaceme.fold",
    "down_projection": "toast.methods.replaceme.fold",
    "fold_transform": "toast.methods.replaceme.fold",
    "NotFoldableError": "toast.methods.replaceme.fold",
    "METHOD": "toast.methods.replaceme.method",
    "replaceme": "toast.methods.replaceme.method",
    "replaceme_from_disk": "toast.methods.replaceme.from_disk",
    "write_replaceme": "toast.methods.replaceme.disk",
    "compression_ratio": "toast.methods.replaceme.params",
    "params_from_config": "toast.methods.replaceme.params",
    "DistanceProfile": "toast.methods.replaceme.profile",
    "profile_distances": "toast.methods.replaceme.profile",
    "ReplaceMeReport": "toast.methods.replaceme.report",
}

__all__ = sorted(_NAMES)
__getattr__ = lazy_getattr(__name__, _NAMES)
