"""ReplaceMe's estimation pass: one pass over the calibration data fills,
for every cut, least-squares moments and/or a row buffer; then each cut's
transform is solved.

Shopkhoev et al., "ReplaceMe" (arXiv 2505.02819), §3.2: for a cut after
block ``i*``, T maps the MLP output ``M`` of block ``i*`` onto the part of
the state after the cut that its attention residual ``Y`` does not carry,
``M T ≈ L_{i*+n} − Y``. Least squares (Eq. 6) needs only the float64
moments ``MᵀM`` and ``Mᵀ(L − Y)``, solved in closed form by the C core
(with the Table 6 structures: diagonal, Eq. 13, or orthogonal); the
cosine objectives (Eqs. 7 and 8) need the rows themselves, kept in a
bounded, reservoir-sampled disk buffer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from toast.core import Moments, fit_translator
from toast.core.patch import PATCH_FITS, fit_patch
from toast.core.solvers import fit_linear_gram
from toast.hf.capture.distributed import Ranks, all_reduce_moments, all_reduce_sums, ranks_of
from toast.hf.capture.massive import massive
from toast.hf.capture.rows import RowSample
from toast.hf.capture.states import ForwardError, stream_states, uses_torch
from toast.hf.capture.torch_moments import TorchMoments
from toast.hf.data.calibration import warn_if_small
from toast.hf.evaluate.check import CheckSplit, RemovalCheck, best_candidate, unchecked_because
from toast.hf.model.blocks import BlockStack, find_blocks
from toast.methods.replaceme.check import check_fits
from toast.methods.replaceme.config import ReplaceMeConfig
from toast.methods.replaceme.cosine import fit_cosine
from toast.methods.replaceme.fold import NotFoldableError
from toast.methods.replaceme.hooks import MlpOutputs, no_kv_cache
from toast.spans import Span

__all__ = [
    "Cut",
    "Estimation",
    "Estimator",
    "Fits",
    "Fitted",
    "check_note",
    "fit_checked",
    "fits_sequentially",
    "flat_rows",
    "refit_won",
    "solve_cut",
]

# fit_cosine's arguments and the ReplaceMeConfig fields that fill them.
_COSINE_OPTIONS = {
    "solver": "solver",
    "lr": "lr",
    "batch_size": "rows_per_step",
    "epochs": "epochs",
    "lbfgs_steps": "lbfgs_steps",
    "tol": "tol",
    "penalty": "penalty",
    "penalty_weight": "penalty_weight",
}
_STRUCTURE_KIND = {"full": "linear", "diagonal": "diagonal", "orthogonal": "orthogonal"}


@dataclass
class Cut:
    """One span being estimated, with its accumulators."""

    span: Span
    moments: Moments | TorchMoments | None = None
    sample: RowSample | None = None
    rows: int = 0
    #: ``‖L − Y‖²`` of the rows the moments hold (what the patch fits score with)
    target_sq: float = 0.0

    @property
    def kept(self) -> int:
        """The block before the cut, whose down-projection receives T."""
        return self.span.start - 1

    def close(self) -> None:
        if self.sample is not None:
            self.sample.close()


@dataclass(frozen=True)
class Fitted:
    """One cut's result: its transform (None for UIDL), the LS Gram
    conditioning (NaN without LS), the cosine objective before and after
    training (None without it) and the size of its row buffer."""

    transform: np.ndarray | None
    condition: float = math.nan
    objective: tuple[float, float] | None = None
    buffer_bytes: int = 0
    rows_kept: int = 0


def flat_rows(x: torch.Tensor, d: int, keep: torch.Tensor | None) -> torch.Tensor:
    """``x`` as rows of width ``d``, only the ``keep`` ones when given."""
    x = x.reshape(-1, d)
    return x if keep is None else x[keep]


class Estimator:
    """The consumer of the estimation pass: opens each cut's accumulators
    on the first batch (when the width and device are known) and adds
    every batch's rows to them."""

    def __init__(
        self,
        cuts: list[Cut],
        config: ReplaceMeConfig,
        positions: dict[int, int],
        recorder: MlpOutputs | None,
        expected_rows: int | None,
    ) -> None:
        self.cuts, self.config, self.positions = cuts, config, positions
        self.recorder, self.expected_rows = recorder, expected_rows
        self.samples, self.dim = 0, 0  # for the calibration-size check

    def open_cut(self, cut: Cut, d: int, device: torch.device) -> None:
        """Creates ``cut``'s accumulators for rows of width ``d`` on ``device``."""
        config = self.config
        if config.needs_moments:
            # LS reads MᵀM, Mᵀ(L − Y) and the sums: nothing of the target alone
            precision = config.precision
            cut.moments = (
                TorchMoments(2, d, 0, "all", precision, device=device, row_stats=False, sources=1)
                if uses_torch(config.backend, device)
                else Moments(2, d, 0, "all", precision, row_stats=False, sources=1)
            )
        if config.objective != "cosine":
            return
        itemsize = np.dtype(config.buffer_dtype).itemsize
        row_bytes = config.buffer_states * d * itemsize
        capacity = config.max_buffer_bytes // len(self.cuts) // row_bytes
        if self.expected_rows:
            capacity = min(capacity, self.expected_rows)
        if capacity < 1:
            raise ValueError(
                f"max_buffer_bytes={config.max_buffer_bytes} cannot hold one row of "
                f"{row_bytes} bytes ({config.buffer_states} states x {d} x {itemsize} B)"
                + (f" for each of {len(self.cuts)} cuts" if len(self.cuts) > 1 else "")
            )
        cut.sample = RowSample(
            config.buffer_states,
            d,
            int(capacity),
            dtype=config.buffer_dtype,
            directory=config.buffer_dir,
            seed=config.calibration.seed,
            verbose=config.calibration.progress,
        )

    def __call__(self, rows: list[torch.Tensor], mask: torch.Tensor | None) -> int:
        recorder = self.recorder
        # cuts that start at the same block share its MLP output (taken once per pass)
        mlp = {} if recorder is None else {k: recorder.take(k) for k in {c.kept for c in self.cuts}}
        return self.add_batch(rows, mask, mlp)

    def add_batch(
        self, rows: list[torch.Tensor], mask: torch.Tensor | None, mlp: dict[int, torch.Tensor]
    ) -> int:
        """Adds one batch's states (and, folding, the MLP outputs ``mlp`` of the
        kept blocks) to every cut."""
        d = int(rows[0].shape[-1])
        self.samples, self.dim = self.samples + int(rows[0].shape[0]), d
        keep = None if (mask is None or self.config.include_padding) else mask.reshape(-1)
        for cut in self.cuts:
            if cut.moments is None and cut.sample is None:
                self.open_cut(cut, d, rows[0].device)
            lk = flat_rows(rows[self.positions[cut.span.start]], d, keep)
            ls = flat_rows(rows[self.positions[cut.span.stop]], d, keep)
            m = None if self.recorder is None else flat_rows(mlp[cut.kept], d, keep)
            self.add_rows(cut, lk, ls, m)
        return self.cuts[0].rows

    def add_rows(
        self, cut: Cut, lk: torch.Tensor, ls: torch.Tensor, m: torch.Tensor | None
    ) -> None:
        """Adds one batch's rows to ``cut``: the states before (``lk``) and after
        (``ls``) the cut and the kept block's MLP output ``m`` (None without it)."""
        if m is not None:
            a, target = m, ls.double() - lk.double() + m.double()  # L_{k+n} − Y_k
        else:
            a, target = lk, ls
        if cut.moments is not None:
            self._add_moments(cut, a, target.double())
        if cut.sample is not None:
            if self.config.buffer_states == 3 and m is not None:  # exact loss: M, Y, L_{k+n}
                cut.sample.add([m, lk.double() - m.double(), ls])
            else:
                cut.sample.add([a, target])
        cut.rows += int(a.shape[0])

    def _add_moments(self, cut: Cut, a: torch.Tensor, target: torch.Tensor) -> None:
        """``(a, target)`` into ``cut``'s LS moments, without the massive-activation
        rows with ``massive_rows="exclude"``."""
        moments = cut.moments
        assert moments is not None
        if self.config.massive_rows != "fit" and target.shape[0]:
            created = massive(target) & ~massive(a)
            if self.config.massive_rows == "exclude":
                a, target = a[~created], target[~created]
            else:  # "plain": those rows ask T to act as plain removal does
                target = torch.where(created[:, None], a, target)
        # in the products' working type, the core reads the rows in place
        work = torch.float32 if self.config.precision == "mixed" else torch.float64
        cut.target_sq += float(torch.sum(target * target))
        a, target = a.to(work), target.to(work)
        if isinstance(moments, TorchMoments):
            moments.update([a, target])
        else:
            moments.update([a.detach().cpu(), target.detach().cpu()])


def solve_cut(
    cut: Cut, config: ReplaceMeConfig, device: torch.device, start: np.ndarray | None = None
) -> Fitted:
    """The transform of one estimated cut (closes its row buffer); the
    cosine objective starts from ``start`` when given (else as ``init``
    says)."""
    ls, cond = None, math.nan
    if cut.moments is not None:
        moments = cut.moments
        if isinstance(moments, TorchMoments):
            moments = moments.to_moments()
        if config.structure in PATCH_FITS:
            # the states are (M, L − Y): the form's fit reads MᵀM, Mᵀ(L − Y), ‖L − Y‖²
            gram, cross = moments.cross(0, 0), moments.cross(0, 1)
            if config.ridge:
                gram = gram + float(config.ridge) * np.eye(gram.shape[0])
            t = fit_patch(config.structure, gram, cross, cut.target_sq, moments.rows)
        elif config.structure == "full":
            # the two blocks the solve reads, and the moments freed before it
            # (the memory plan counts a solve apart from its cut's moments)
            gram, cross, rows = moments.cross(0, 0), moments.cross(0, 1), moments.rows
            cut.moments = None
            del moments
            t = fit_linear_gram(gram, cross, rows, float(config.ridge))
            del gram, cross
        else:
            kind = _STRUCTURE_KIND[config.structure]
            t = fit_translator(moments, 0, 1, kind=kind, ridge=float(config.ridge))
        ls, cond = t.weight, t.condition
    if cut.sample is None:
        return Fitted(ls, cond)
    sample = cut.sample
    try:
        buffer_bytes = sample.capacity * sample.num_states * sample.dim * sample.dtype.itemsize
        three = sample.num_states == 3
        options = {arg: getattr(config, name) for arg, name in _COSINE_OPTIONS.items()}
        result = fit_cosine(
            sample.state(0),
            sample.state(2) if three else sample.state(1),
            sample.state(1) if three else None,
            init=ls if start is None else start,
            structure="diagonal" if config.structure == "diagonal" else "full",
            seed=config.calibration.seed,
            device=device,
            progress=config.calibration.progress,
            **options,
        )
        return Fitted(
            result.transform, cond, (result.initial, result.final), buffer_bytes, sample.rows
        )
    finally:
        sample.close()


@dataclass(frozen=True)
class Estimation:
    """What the estimation passes of one :func:`toast.methods.replaceme.replaceme` call share:
    the model and its block stack (found once), the calibration data, the
    options, and the token rows a profile pass counted (they cap the cosine
    buffer when all rows fit)."""

    model: nn.Module
    data: Iterable
    config: ReplaceMeConfig
    stack: BlockStack
    expected_rows: int | None = None
    #: plain removal measured on held-out data, shared by the copies
    #: :meth:`on` and :meth:`configured` make (the model unchanged)
    removed: dict[Any, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def after_surgery(self) -> Estimation:
        """The same, with the block stack looked up again by its path
        (and nothing measured before the surgery)."""
        return dataclasses.replace(self, stack=find_blocks(self.model, self.stack), removed={})

    def on(self, data: Iterable, expected_rows: int | None) -> Estimation:
        """The same estimation on other calibration data."""
        return dataclasses.replace(self, data=data, expected_rows=expected_rows)

    def configured(self, config: ReplaceMeConfig) -> Estimation:
        """The same estimation with other options (a placement ``"auto"`` tries)."""
        return dataclasses.replace(self, config=config)

    def check(
        self,
        spans: Sequence[Span],
        transforms: Sequence[np.ndarray | None],
        heldout: Iterable,
        alone: bool,
    ) -> list[RemovalCheck | None]:
        """Each cut's T against plain removal on ``heldout``, applied by hooks
        (:func:`toast.methods.replaceme.check.check_fits`)."""
        config = self.config
        return check_fits(
            self.model,
            self.stack,
            spans,
            transforms,
            config.placement,
            heldout,
            config.fallback,
            alone=alone,
            removed=self.removed,
        )

    def fit(
        self, spans: Sequence[Span], starts: Sequence[np.ndarray | None] | None = None
    ) -> tuple[list[Fitted], int]:
        """Estimates the transforms of ``spans`` in one pass over the data on
        the model as it is; returns them and the calibration rows used. The
        cosine objective of each span starts from its entry of ``starts``
        (a transform fitted before; None: as ``init`` says)."""
        (cuts,) = self._estimate([self.config], spans)
        return self._solved(self.config, cuts, starts)

    def fit_each(
        self, configs: Sequence[ReplaceMeConfig], spans: Sequence[Span]
    ) -> list[tuple[list[Fitted], int]]:
        """:meth:`fit` of ``spans`` under each of ``configs`` (placements and
        structures ``"auto"`` tries), from one pass: every config's
        accumulators see the same rows as in a pass of its own."""
        passes = self._estimate(configs, spans)
        return [self._solved(c, cuts) for c, cuts in zip(configs, passes, strict=True)]

    def _solved(
        self,
        config: ReplaceMeConfig,
        cuts: list[Cut],
        starts: Sequence[np.ndarray | None] | None = None,
    ) -> tuple[list[Fitted], int]:
        device = next(self.model.parameters()).device
        begin = [None] * len(cuts) if starts is None else list(starts)
        try:
            return [
                solve_cut(cut, config, device, start)
                for cut, start in zip(cuts, begin, strict=True)
            ], cuts[0].rows
        finally:
            for cut in cuts:
                cut.close()

    def _estimate(
        self, configs: Sequence[ReplaceMeConfig], spans: Sequence[Span]
    ) -> list[list[Cut]]:
        """One pass over the data filling the accumulators of every cut under
        each of ``configs`` (the pass's own options are the first's)."""
        config = configs[0]
        wanted = sorted({k for s in spans for k in (s.start, s.stop)})
        positions = {state: i for i, state in enumerate(wanted)}
        folding = [c.placement != "block" for c in configs]
        passes = [[Cut(s) for s in spans] for _ in configs]
        kept = [c.kept for c in passes[0]]
        check = any(c.check for c, f in zip(configs, folding, strict=True) if f)
        recorder = MlpOutputs(self.stack, kept, check) if any(folding) else None
        estimators = [
            Estimator(cuts, c, positions, recorder if f else None, self.expected_rows)
            for cuts, c, f in zip(passes, configs, folding, strict=True)
        ]
        consume = estimators[0] if len(estimators) == 1 else _Together(estimators, recorder)
        # sums shard over ranks; the cosine objective's row sample cannot:
        # then every rank forwards every batch (one process's sample)
        ranks = (
            None if any(c.objective == "cosine" for c in configs) else ranks_of(config.calibration)
        )
        try:
            with no_kv_cache(self.model):
                stream_states(
                    self.model,
                    self.data,
                    consume,
                    config.calibration,
                    stack=self.stack,
                    states=wanted,
                    tokens="all",
                    desc="replaceme: estimating",
                    shard=ranks is not None,
                )
        except BaseException as exc:
            for cut in (cut for cuts in passes for cut in cuts):
                cut.close()
            if isinstance(exc, ForwardError) and isinstance(exc.__cause__, NotFoldableError):
                raise exc.__cause__ from None
            raise
        finally:
            if recorder is not None:
                recorder.remove()
        if ranks is not None:
            for cuts, c in zip(passes, configs, strict=True):
                _reduce_cuts(cuts, c, ranks)
        first, rows = estimators[0], passes[0][0].rows
        if rows == 0:
            raise ValueError("the loader yielded no rows (empty loader, or every token masked out)")
        if config.objective != "identity":  # a d×d transform needs more rows than d
            warn_if_small(rows, first.dim, 0, first.samples, rows)
        return passes


def _reduce_cuts(cuts: list[Cut], config: ReplaceMeConfig, ranks: Ranks) -> None:
    """Every cut's sums over the ranks of a sharded pass (collective): its
    least-squares moments, rows and ``‖L − Y‖²``, as one process has them."""
    for cut in cuts:
        moments = cut.moments
        if isinstance(moments, TorchMoments):
            moments = moments.to_moments()
        mine = [0.0, 0.0] if moments is None else [1.0, float(moments.dim)]
        has, dim = all_reduce_sums(mine, ranks)
        if config.needs_moments and has:
            if moments is None:  # a rank given no batch joins with zeros
                d = round(dim / has)
                moments = Moments(2, d, 0, "all", config.precision, row_stats=False, sources=1)
            cut.moments = all_reduce_moments(moments, group=ranks.group)
        rows, target_sq = all_reduce_sums([cut.rows, cut.target_sq], ranks)
        cut.rows, cut.target_sq = int(rows), float(target_sq)


class _Together:
    """Several estimators fed by one pass: the kept blocks' MLP outputs
    taken once a batch and handed to every estimator that folds."""

    def __init__(self, estimators: list[Estimator], recorder: MlpOutputs | None) -> None:
        self.estimators, self.recorder = estimators, recorder
        self.kept = {c.kept for e in estimators if e.recorder is not None for c in e.cuts}

    def __call__(self, rows: list[torch.Tensor], mask: torch.Tensor | None) -> int:
        recorder = self.recorder
        mlp = {} if recorder is None else {k: recorder.take(k) for k in self.kept}
        for estimator in self.estimators:
            estimator.add_batch(rows, mask, mlp)
        return self.estimators[0].cuts[0].rows


class Fits(Protocol):
    """What :func:`fit_checked` needs of an estimation: in memory
    (:class:`Estimation`) or block by block from disk
    (:class:`toast.methods.replaceme.disk.DiskEstimation`)."""

    @property
    def config(self) -> ReplaceMeConfig: ...

    @property
    def expected_rows(self) -> int | None: ...

    def on(self, data: Iterable, expected_rows: int | None) -> Fits: ...

    def configured(self, config: ReplaceMeConfig) -> Fits: ...

    def check(
        self,
        spans: Sequence[Span],
        transforms: Sequence[np.ndarray | None],
        heldout: Iterable,
        alone: bool,
    ) -> list[RemovalCheck | None]: ...

    def fit(
        self, spans: Sequence[Span], starts: Sequence[np.ndarray | None] | None = None
    ) -> tuple[list[Fitted], int]: ...

    def fit_each(
        self, configs: Sequence[ReplaceMeConfig], spans: Sequence[Span]
    ) -> list[tuple[list[Fitted], int]]: ...


def fits_sequentially(config: ReplaceMeConfig) -> bool:
    """Whether several cuts are fitted one after the other (not checked, so
    nothing is held out for them)."""
    cuts = config.num_cuts if config.spans is None else len(config.spans)
    return config.fit == "sequential" and cuts > 1


def check_note(config: ReplaceMeConfig, split: CheckSplit, cuts: int) -> str:
    """Why the fits are not checked on held-out batches ("" when they are)."""
    if config.objective == "identity":
        return ""
    return unchecked_because(split, config.fit == "sequential" and cuts > 1)


def fit_checked(
    estimation: Fits,
    spans: list[Span],
    pool: list[Span],
    split: CheckSplit,
    note: str,
    refit: bool = True,
    fitted_already: tuple[list[Fitted], int] | None = None,
) -> tuple[list[Span], list[Fitted], int, list[RemovalCheck | None], list[RemovalCheck]]:
    """The cuts fitted in one pass and, unless ``note`` says why not,
    measured against plain removal on the held-out batches (a fit that
    lost is dropped with ``fallback``) and the winners fitted again on
    every batch (with ``refit``; else left as fitted on the fit part, for
    a caller that compares several of these runs and refits the winner
    with :func:`refit_won`). With candidate windows (``pool``), each is
    fitted and measured alone and the best becomes the cut. Returns the
    cuts, their fits, the rows used, the checks and every candidate's
    measurement. ``fitted_already``: the fits of ``pool or spans`` and
    their rows, when a shared pass made them (:meth:`Fits.fit_each`)."""
    fitted, rows = fitted_already or _fit_at_most(
        estimation, pool or spans, estimation.config.cuts_at_once
    )
    if note:
        return spans, fitted, rows, [], []
    transforms = [f.transform for f in fitted]
    measured = estimation.check(pool or spans, transforms, split.check, alone=bool(pool))
    kept = [
        dataclasses.replace(f, transform=None) if c is not None and c.used != "fitted" else f
        for f, c in zip(fitted, measured, strict=True)
    ]
    if not pool:
        if refit:
            kept, rows = refit_won(estimation, spans, kept, split, rows)
        return spans, kept, rows, measured, []
    candidates = [c for c in measured if c is not None]  # every candidate has a fit
    k = best_candidate(candidates)
    fitted = [kept[k]]
    if refit:
        fitted, rows = refit_won(estimation, [pool[k]], fitted, split, rows)
    return [pool[k]], fitted, rows, [measured[k]], candidates


def _fit_at_most(
    estimation: Fits, cuts: Sequence[Span], at_once: int | None
) -> tuple[list[Fitted], int]:
    """Every cut fitted, ``at_once`` of them a pass (None: all in one): the
    fits are independent, so only the passes and the memory differ."""
    step = len(cuts) if at_once is None else at_once
    fitted: list[Fitted] = []
    rows = 0
    for lo in range(0, len(cuts), max(step, 1)):
        part, used = estimation.fit(list(cuts[lo : lo + step]))
        fitted += part
        rows = max(rows, used)
    return fitted, rows


def refit_won(
    estimation: Fits, spans: Sequence[Span], fitted: list[Fitted], split: CheckSplit, rows: int
) -> tuple[list[Fitted], int]:
    """The cuts whose fit won the held-out check fitted again on every
    calibration batch (one more pass): the check chose the method, the
    held-out batch need not be lost to it. With ``fallback`` the refitted
    transforms are measured on the held-out batches once more (the other
    cuts as refitted) and a cut whose refit lost to plain removal keeps the
    transform that won the check: fitting on more rows moves T, and
    measured on tiny models it could then lose by 0.02% perplexity, so
    without this the model could end worse than plain removal on the very
    batches that chose the fit."""
    won = [k for k, f in enumerate(fitted) if f.transform is not None]
    if not won:
        return fitted, rows
    # the cosine buffer was sized for the fit part; the held-out part is at
    # most as large (check_fraction <= 0.5)
    expected = None if estimation.expected_rows is None else 2 * estimation.expected_rows
    # the cosine objective goes on from where the checked fit stopped
    cosine = estimation.config.objective == "cosine"
    starts = [fitted[k].transform for k in won] if cosine else None
    again, used = estimation.on(split.data, expected).fit([spans[k] for k in won], starts)
    refitted = list(fitted)
    for k, f in zip(won, again, strict=True):
        refitted[k] = f
    if not estimation.config.fallback:
        return refitted, used
    transforms = [f.transform for f in refitted]
    measured = estimation.check(spans, transforms, split.check, alone=False)
    lost = {k for k in won if (c := measured[k]) is not None and c.used != "fitted"}
    kept = [fitted[k] if k in lost else f for k, f in enumerate(refitted)]
    return kept, rows if len(lost) == len(won) else used
