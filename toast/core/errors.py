"""Warnings and exceptions of the numeric core.

:class:`NonFiniteError` is defined by the C binding (:mod:`toast._core`) so
that the update that finds NaN or Inf raises it with the failing state's
index; the torch backend (:mod:`toast.hf.capture.torch_moments`) raises the same
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
    "explain_rank_deficiency",
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


def explain_rank_deficiency(rank: int, dim: int, rows: int, ridge_hint: float) -> str:
    """Why a Gram matrix of width ``dim`` from ``rows`` rows has rank ``rank``,
    and what to do: the text of one :class:`IllConditionedWarning` per run.

    A deficiency of one or two directions with plenty of rows is structural:
    a post-LN block (BERT-style, a LayerNorm last) gives outputs of zero mean
    across features, up to the norm's scale and shift, so one direction never
    varies; the minimum-norm solution is then exact and no ridge is needed.
    Anything else gets the ridge to try, ``ridge_hint`` (1e-3 of the mean
    diagonal of XᵀX), or more data.
    """
    missing = dim - rank
    if rows > dim and 1 <= missing <= 2:
        return (
            f"block outputs have rank {rank} of width {dim}: the last operation of each "
            "block is a LayerNorm (a post-LN model such as BERT), whose outputs have zero "
            f"mean across features, so {missing} direction(s) never vary. This is structural, "
            "not a lack of data: the minimum-norm least-squares solution toast uses is exact "
            "on the remaining directions (the report's condition is infinite by design); "
            "no ridge is needed"
        )
    cause = (
        f"fewer rows ({rows}) than the width ({dim})"
        if rows <= dim
        else f"{missing} of {dim} directions carry (almost) no variance"
    )
    return (
        f"ill-conditioned least squares (rank {rank} of width {dim}): {cause}. The "
        f"minimum-norm solution was used; for a better-posed fit pass ridge={ridge_hint:.3g} "
        f"(--ridge {ridge_hint:.3g} on the command line: 1e-3 of the mean diagonal of "
        "XᵀX) or calibrate on more data"
    )
