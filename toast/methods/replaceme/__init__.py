"""ReplaceMe (Shopkhoev et al., "ReplaceMe", arXiv 2505.02819): depth
pruning with a linear transform folded into the last kept block's
down-projection.

:func:`replaceme` runs the method; :class:`ReplaceMeConfig` holds its
options; ``toast.compress(model, data, method="replaceme", ...)`` reaches
it through the method registry.
"""

from __future__ import annotations

from toast.methods.base import Method, register
from toast.methods.replaceme.config import ReplaceMeConfig
from toast.methods.replaceme.cosine import CosineFit, fit_cosine
from toast.methods.replaceme.fold import TransformedProjection, down_projection, fold_transform
from toast.methods.replaceme.hooks import NotFoldableError
from toast.methods.replaceme.method import replaceme
from toast.methods.replaceme.params import compression_ratio, params_from_config
from toast.methods.replaceme.profile import DISTANCES, DistanceProfile, profile_distances
from toast.methods.replaceme.report import ReplaceMeReport

__all__ = [
    "DISTANCES",
    "METHOD",
    "CosineFit",
    "DistanceProfile",
    "NotFoldableError",
    "ReplaceMeConfig",
    "ReplaceMeReport",
    "TransformedProjection",
    "compression_ratio",
    "down_projection",
    "fit_cosine",
    "fold_transform",
    "params_from_config",
    "profile_distances",
    "replaceme",
]

METHOD = register(
    Method(
        name="replaceme",
        config=ReplaceMeConfig,
        run=replaceme,
        summary="remove blocks, fold a least-squares or cosine transform into the last kept one",
    )
)
