"""The numeric core, NumPy only (never imports torch): streaming moments,
the block error matrix and closed-form translators, over the C extension
:mod:`toast._core`."""

from toast.core.blas import blas_threads, get_blas_threads, set_blas_threads
from toast.core.errors import IllConditionedWarning, InSampleWarning, NonFiniteError
from toast.core.metrics import METRICS, error_matrix
from toast.core.moments import Moments, Pairs
from toast.core.moments import (
    restore_moments as _restore_moments,  # noqa: F401  (pickles from before toast.core was a package name it)
)
from toast.core.solvers import Translator, fit_residual, fit_translator, solve_gram

__all__ = [
    "METRICS",
    "IllConditionedWarning",
    "InSampleWarning",
    "Moments",
    "NonFiniteError",
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
