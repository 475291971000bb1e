"""The numeric core, NumPy only (never imports torch): streaming moments,
the block error matrix and closed-form translators, over the C extension
:mod:`toast._core`."""

from toast.core.blas import blas_threads, get_blas_threads, set_blas_threads
from toast.core.moments import (
    METRICS,
    IllConditionedWarning,
    InSampleWarning,
    Moments,
    Pairs,
    Translator,
    _restore_moments,  # noqa: F401  (pickles of Moments name this entry point)
    error_matrix,
    fit_residual,
    fit_translator,
    solve_gram,
)

__all__ = [
    "METRICS",
    "IllConditionedWarning",
    "InSampleWarning",
    "Moments",
    "Pairs",
    "Translator",
    "blas_threads",
    "error_matrix",
    "fit_residual",
    "fit_translator",
    "get_blas_threads",
    "set_blas_threads",
    "solve_gram",
]
