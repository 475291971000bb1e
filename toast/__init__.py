"""toast: make pretrained transformers smaller and faster with no training.

The core measures how well each span of blocks is explained by a closed-form
map (the block error matrix) from streaming moments of captured activations,
and fits the translators that replace redundant spans.
"""

from toast.core import (
    METRICS,
    IllConditionedWarning,
    InSampleWarning,
    Moments,
    Translator,
    error_matrix,
    fit_residual,
    fit_translator,
    solve_gram,
)

__version__ = "0.1.0"

__all__ = [
    "METRICS",
    "IllConditionedWarning",
    "InSampleWarning",
    "Moments",
    "Translator",
    "__version__",
    "error_matrix",
    "fit_residual",
    "fit_translator",
    "solve_gram",
]
