"""Warnings and exceptions of the numeric core.

:class:`NonFiniteError` is defined by the C binding (:mod:`toast._core`) so
that the update that finds NaN or Inf raises it with the failing state's
index; the torch backend (:mod:`toast.hf.torch_moments`) raises the same
type through :func:`non_finite_error`.
"""

from __future__ import annotations

import warnings

from toast import _core

__all__ = [
    "ILL_CONDITIONED",
    "IllConditionedWarning",
    "InSampleWarning",
    "NonFiniteError",
    "non_finite_error",
    "warn_ill_conditioned",
]

#: Condition number above which a fit is reported as ill-conditioned.
ILL_CONDITIONED = 1e10

#: A ValueError: the data holds NaN or Inf. ``.state`` is the index of the
#: failing entry of the states passed to ``Moments.update`` (None elsewhere).
NonFiniteError = _core.NonFiniteError


class InSampleWarning(UserWarning):
    """In-sample error with no more rows than features: the fit is exact."""


class IllConditionedWarning(UserWarning):
    """A Gram matrix was singular or nearly so; a pseudo-inverse was used."""


def non_finite_error(message: str, state: int | None) -> ValueError:
    """A :class:`NonFiniteError` carrying ``state`` (to raise)."""
    exc = NonFiniteError(message)
    exc.state = state
    return exc


def warn_ill_conditioned(message: str, stacklevel: int) -> None:
    """Issues an :class:`IllConditionedWarning` (``stacklevel`` counted from
    the caller of this function)."""
    warnings.warn(message, IllConditionedWarning, stacklevel=stacklevel + 1)
