"""Fitting the translators of planned spans: closed form from moments, or
trained on a row sample; on the original model (independent) or on the
partially compressed one (sequential)."""

from __future__ import annotations

import warnings
from collections.abc import Collection, Iterable, Sequence

import numpy as np
from torch import nn

from toast.core import IllConditionedWarning, Moments, Translator, fit_translator
from toast.core.chunked import ChunkedMoments, PairMoments
from toast.core.errors import explain_rank_deficiency
from toast.core.patch import PATCH_FITS, fit_patch
from toast.core.solvers import gram_rank, solve_gram
from toast.hf.capture.distributed import broadcast_module
from toast.hf.capture.massive import MassiveRows
from toast.hf.capture.rows import RowSample, capture_rows
from toast.hf.capture.states import capture_moments
from toast.hf.model.blocks import BlockStack
from toast.methods.translate.analysis import Analysis
from toast.methods.translate.config import CLOSED_FORM, ToastConfig
from toast.spans import Span
from toast.translators import train_translator

__all__ = ["FEW_ROWS_RIDGE", "FewRowsWarning", "Fitter", "records_massive_rows"]

# Ridge (relative to the mean diagonal of XᵀX) for fits with rows <= dim.
FEW_ROWS_RIDGE = 1e-3


class FewRowsWarning(UserWarning):
    """A translator was fitted from no more rows than features (ridge used)."""


def records_massive_rows(config: ToastConfig) -> bool:
    """Whether the analysis records the massive rows for the fits: a plain
    correction of closed-form least squares (``massive_rows="plain"``), on
    one process's rows (a sharded pass gathers every rank's: not so when
    each rank passes its own shard, ``shard=False``)."""
    cal = config.calibration
    return (
        config.massive_rows == "plain"
        and config.translator in ("linear", "affine")
        and not (cal.is_distributed and not cal.shard)
    )


class Fitter:
    """Fits the configured kind of translator for spans of one model."""

    def __init__(self, config: ToastConfig) -> None:
        self.config = config
        self.conditions: list[float] = []
        self.ranks: list[int | None] = []
        self._ill_conditioned: str | None = None  # the first explanation, issued once

    def warn_ill_conditioned(self, already: Collection[str] = ()) -> None:
        """One :class:`IllConditionedWarning` for all the fits of a run, saying why
        (e.g. a post-LN model's structural rank loss) and what to do, if any fit was
        and the run has not said so already (``already``: the messages issued)."""
        if self._ill_conditioned is not None and self._ill_conditioned not in already:
            warnings.warn(self._ill_conditioned, IllConditionedWarning, stacklevel=3)

    def closed_form(
        self,
        moments: Moments,
        i: int,
        j: int,
        massive: MassiveRows | None = None,
        target_sq: float | None = None,
    ) -> Translator:
        """The closed-form translator of ``blocks[i:j]`` from the moments, with
        the massive-row correction when ``massive`` is given (a relative ridge
        and a warning when there are too few rows); ``target_sq``:
        ``tr(X_jᵀ X_j)`` when the moments do not hold that block (the
        Hadamard-basis fits score their residuals with it)."""
        kind, ridge, relative = self.config.translator, self.config.ridge, False
        if ridge is None and kind in ("linear", "affine") and moments.rows <= moments.dim:
            ridge, relative = FEW_ROWS_RIDGE, True
            warnings.warn(
                f"fitting blocks[{i}:{j}] from {moments.rows} rows of width {moments.dim}: "
                f"least squares is underdetermined, so a ridge of {FEW_ROWS_RIDGE} (relative "
                "to the mean diagonal of XᵀX) is used; pass ridge=... or more data",
                FewRowsWarning,
                stacklevel=5,
            )
        if kind in PATCH_FITS:
            return self._patch(moments, i, j, massive, target_sq)
        if self.config.ridge_target == "identity":
            return self._towards_identity(moments, i, j, massive, ridge or 0.0, relative)
        t = None
        if massive is not None and kind in ("linear", "affine"):
            t = massive.plain_fit(moments, i, j, kind == "affine", ridge or 0.0, relative)
        with warnings.catch_warnings():
            # explained once per run by warn_ill_conditioned, not once per span
            warnings.simplefilter("ignore", IllConditionedWarning)
            if t is None:
                t = fit_translator(moments, i, j, kind=kind, ridge=ridge, ridge_relative=relative)
        self.conditions.append(t.condition)
        self.ranks.append(t.rank)
        if t.ill_conditioned and self._ill_conditioned is None:
            _, hint = gram_rank(moments, i, center=kind == "affine")
            self._ill_conditioned = explain_rank_deficiency(t.rank, moments.dim, moments.rows, hint)
        return t

    def _towards_identity(
        self,
        moments: Moments,
        i: int,
        j: int,
        massive: MassiveRows | None,
        ridge: float,
        relative: bool,
    ) -> Translator:
        """The linear map shrunk towards the identity (``ridge_target=
        "identity"``, Ghosted Layers' operator): ``W = I + M``, ``(XᵀX + λI)
        M = XᵀY − XᵀX`` from the float64 sums, solved by the core's policy
        (Cholesky, else an eigendecomposition pseudo-inverse); ``λ`` relative
        to the mean diagonal of ``XᵀX`` when ``relative``."""
        if massive is None:
            gram, cross = moments.cross(i, i), moments.cross(i, j)
        else:
            target_sq = float(np.trace(moments.cross(j, j)))
            gram, cross, _ = massive.plain_moments(moments, i, j, target_sq)
        gram = np.asarray(gram, dtype=np.float64)
        lam = ridge * float(np.mean(np.diag(gram))) if relative else ridge
        step, condition, rank, method = solve_gram(gram, np.asarray(cross) - gram, lam)
        weight = np.eye(gram.shape[0]) + step
        t = Translator("linear", weight, np.zeros(gram.shape[0]), condition, rank, method)
        self.conditions.append(t.condition)
        self.ranks.append(t.rank)
        return t

    def _patch(
        self,
        moments: Moments,
        i: int,
        j: int,
        massive: MassiveRows | None,
        target_sq: float | None,
    ) -> Translator:
        """A Hadamard-basis fit (:mod:`toast.core.patch`), massive rows'
        targets as plain removal leaves them when ``massive`` is given."""
        if target_sq is None:
            target_sq = float(np.trace(moments.cross(j, j)))
        if massive is None:
            gram, cross = moments.cross(i, i), moments.cross(i, j)
        else:
            gram, cross, target_sq = massive.plain_moments(moments, i, j, target_sq)
        t = fit_patch(self.config.translator, gram, cross, target_sq, moments.rows)
        self.conditions.append(t.condition)
        self.ranks.append(t.rank)
        return t

    def closed_forms(self, spans: list[Span], analysis: Analysis) -> list[Translator]:
        """The closed-form translator of each span from the analysis's
        moments (with its massive rows, when it recorded them): all a
        closed form needs, in memory or from disk."""
        massive, moments = analysis.massive, analysis.moments
        if not isinstance(moments, (ChunkedMoments, PairMoments)):
            return [self.closed_form(moments, s.start, s.stop, massive) for s in spans]
        # rows on disk: each span's fit from the moments of its two states
        # (and, for the fits that score residuals, the target's trace)
        patch = self.config.translator in PATCH_FITS
        traces = moments.traces() if patch else None
        return [
            self.closed_form(
                moments.pair(s.start, s.stop),
                0,
                1,
                massive and massive.of(s.start, s.stop),
                None if traces is None else float(traces[s.stop]),
            )
            for s in spans
        ]

    def closed_forms_with(
        self,
        spans: list[Span],
        analysis: Analysis,
        more: Moments | ChunkedMoments,
        states: list[int],
        more_massive: MassiveRows | None = None,
    ) -> list[Translator]:
        """:meth:`closed_forms` from the analysis's moments and ``more``, the
        moments of further batches at ``states`` (moment ``k`` is state
        ``states[k]``; ``more_massive`` their massive rows), summed: the
        translators of an analysis of both sets of batches together."""
        base = analysis.moments
        full = isinstance(base, Moments) and isinstance(more, Moments)
        patch = self.config.translator in PATCH_FITS
        out = []
        for s in spans:
            a, b = states.index(s.start), states.index(s.stop)
            pair = _pair(base, s.start, s.stop, full).merge(_pair(more, a, b, full))
            massive = None
            if analysis.massive is not None:
                massive = analysis.massive.of(s.start, s.stop)
                if more_massive is not None:
                    massive = massive.joined(more_massive.of(a, b))
            target_sq = None
            if patch and not full:
                target_sq = _trace(base, s.stop) + _trace(more, b)
            out.append(self.closed_form(pair, 0, 1, massive, target_sq))
        return out

    def closed_forms_at(
        self,
        spans: Sequence[Span],
        moments: Moments | ChunkedMoments,
        states: list[int],
        massive: MassiveRows | None = None,
    ) -> list[Translator]:
        """:meth:`closed_forms` from ``moments`` alone, captured at ``states``
        (moment ``k`` is state ``states[k]``; ``massive`` their massive rows):
        the translators of another set of batches than the analysis's."""
        full = isinstance(moments, Moments)
        patch = self.config.translator in PATCH_FITS
        out = []
        for s in spans:
            a, b = states.index(s.start), states.index(s.stop)
            target_sq = _trace(moments, b) if patch and not full else None
            rows = None if massive is None else massive.of(a, b)
            out.append(self.closed_form(_pair(moments, a, b, full), 0, 1, rows, target_sq))
        return out

    def _trained(self, sample: RowSample, i: int, j: int, like: nn.Module) -> nn.Module:
        config = self.config
        module = train_translator(
            sample.state(i),
            sample.state(j),
            config.translator,
            steps=config.train_steps,
            lr=config.lr,
            seed=config.calibration.seed,
            progress=config.calibration.progress,
        )
        self.conditions.append(float("nan"))
        self.ranks.append(None)
        if config.calibration.is_distributed:
            # each rank sampled its own shard: take rank 0's translator everywhere
            broadcast_module(module, group=config.calibration.group)
        reference = next(like.parameters(), None)
        if reference is not None:
            module = module.to(dtype=reference.dtype, device=reference.device)
        return module

    def _rows(self, model: nn.Module, data: Iterable, states: list[int], stack: BlockStack):
        return capture_rows(
            model,
            data,
            states,
            capacity=self.config.max_rows,
            tokens=self.config.tokens,
            calibration=self.config.calibration,
            stack=stack,
        )

    def fit_all(
        self,
        model: nn.Module,
        data: Iterable,
        spans: list[Span],
        analysis: Analysis,
        stack: BlockStack,
    ) -> list:
        """One translator per span, all on the original model."""
        if self.config.translator in CLOSED_FORM:
            return list(self.closed_forms(spans, analysis))
        states = [k for s in spans for k in (s.start, s.stop)]
        with self._rows(model, data, states, stack) as rows:
            return [
                self._trained(rows, 2 * k, 2 * k + 1, stack.blocks[s.start])
                for k, s in enumerate(spans)
            ]

    def fit_one_on(
        self, model: nn.Module, data: Iterable, where: tuple[int, int], stack: BlockStack
    ):
        """The translator of ``blocks[where]`` on ``model`` as it is now."""
        if self.config.translator in CLOSED_FORM:
            moments, _ = capture_moments(
                model,
                data,
                states=list(where),
                tokens=self.config.tokens,
                folds=0,
                backend=self.config.backend,
                calibration=self.config.calibration,
                stack=stack,
            )
            assert isinstance(moments, Moments)  # no statistics bound: whole moments
            return self.closed_form(moments, 0, 1)
        with self._rows(model, data, list(where), stack) as rows:
            return self._trained(rows, 0, 1, stack.blocks[where[0]])


def _pair(moments: Moments | ChunkedMoments | PairMoments, i: int, j: int, full: bool) -> Moments:
    """A new two-state copy of states ``i`` and ``j`` of ``moments``: every
    block with ``full``, else the source's blocks alone (the form of
    :meth:`ChunkedMoments.pair`), so that copies from other batches merge."""
    if isinstance(moments, Moments):
        return moments.select([i, j], sources=None if full else 1)
    return moments.pair(i, j).select([0, 1], sources=1)


def _trace(moments: Moments | ChunkedMoments | PairMoments, j: int) -> float:
    """``tr(X_jᵀ X_j)``."""
    if isinstance(moments, Moments):
        return float(np.trace(moments.cross(j, j)))
    return float(moments.traces()[j])
