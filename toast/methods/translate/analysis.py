"""``toast.analyze``: the block error matrix of a model and the spans it suggests.

Index conventions: states ``0..L`` (state 0 is the embedding output, state
``i`` the output of block ``i - 1``); ``errors[i, j]`` scores replacing the
blocks ``range(i, j)`` by a map from state ``i`` to state ``j``. The papers
write that span as ``s → e`` with ``s = i - 1`` and ``e = j - 1`` (the
output of block ``s`` predicts the output of block ``e``).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from torch import nn

from toast._validation import Interval, Options, check, merge_alias
from toast.core import METRICS, Moments, Pairs, error_matrix
from toast.core.chunked import ChunkedMoments, PairMoments, pair_nbytes
from toast.hf.capture.massive import MassiveRows
from toast.hf.capture.states import Tokens, capture_moments
from toast.hf.data.calibration import Calibration
from toast.hf.data.progress import progress_counter
from toast.hf.data.text import TEXT_OPTIONS, as_batches
from toast.hf.model.blocks import BlockStack
from toast.methods.translate.config import ToastConfig
from toast.spans import Span, plan_spans

if TYPE_CHECKING:
    from toast.hf.capture.sequential import DiskModel

__all__ = ["Analysis", "Span", "analyze", "analyze_from_disk"]


@dataclass
class Analysis:
    """Moments of a model's states and the error matrix derived from them;
    ``massive`` the rows massive in some state, when recorded."""

    moments: Moments | ChunkedMoments | PairMoments
    errors: np.ndarray
    metric: str
    estimator: str
    tokens: str
    block_path: str
    ridge: float = 0.0
    massive: MassiveRows | None = field(default=None, repr=False)

    @property
    def num_blocks(self) -> int:
        return self.errors.shape[0] - 1

    @property
    def rows(self) -> int:
        return self.moments.rows

    def error_matrix(
        self, metric: str | None = None, estimator: str | None = None, ridge: float | None = None
    ) -> np.ndarray:
        """Another metric from the same moments (no new pass over the data;
        not from the pair moments a search's calibration keeps)."""
        if isinstance(self.moments, PairMoments):
            raise ValueError("the calibration kept the moments of its plans' spans only")
        return _errors(
            self.moments,
            metric or self.metric,
            estimator or self.estimator,
            self.ridge if ridge is None else ridge,
        )

    def _candidates(self, include_first_block: bool) -> list[Span]:
        first = 0 if include_first_block else 1
        n = self.errors.shape[0]
        return [
            Span(i, j, float(self.errors[i, j]))
            for i in range(first, n)
            for j in range(i + 1, n)
            if np.isfinite(self.errors[i, j])
        ]

    def top_spans(
        self,
        k: int = 5,
        num_blocks: int | None = None,
        include_first_block: bool = False,
        *,
        budget: int | None = None,
    ) -> list[Span]:
        """TOAST Algorithm 1: the ``k`` most redundant single spans.

        Ranked by the metric's redundant direction (ascending error for
        ``linear``). ``num_blocks`` keeps only spans of exactly that many
        blocks (``budget``: another name for it, the TOAST paper's). Block 0
        is never removed unless ``include_first_block`` (the papers always
        keep it).
        """
        k = check("k", k, Interval(int, 1, None))
        check("num_blocks", num_blocks, Interval(int, 1, None), None)
        check("budget", budget, Interval(int, 1, None), None)
        num_blocks = merge_alias("num_blocks", num_blocks, "budget", budget)
        spans = self._candidates(include_first_block)
        if num_blocks is not None:
            spans = [s for s in spans if s.num_blocks == num_blocks]
        descending = METRICS[self.metric] == "higher"
        spans.sort(key=lambda s: (-s.error if descending else s.error, s.start, s.stop))
        return spans[:k]

    def plan(
        self,
        max_blocks: int | None = None,
        max_error: float | None = None,
        allow_adjacent: bool = False,
        include_first_block: bool = False,
    ) -> list[Span]:
        """Non-overlapping spans to replace, chosen exactly by dynamic programming.

        Among sets of spans with a kept block between consecutive spans (the
        papers' ``e_i < s_j``; ``allow_adjacent=True`` drops that gap) and,
        with ``max_error``, each span's error at most ``max_error``: the most
        blocks removed, up to ``max_blocks``, and among those the smallest
        total predicted error. Needs a metric where lower means redundant.
        """
        if METRICS[self.metric] != "lower":
            raise ValueError(
                f"plan() needs a metric where lower means redundant; {self.metric!r} is not "
                "one (use metric='linear', 'affine', 'mse', 'cosine', 'angular' or 'euclidean')"
            )
        return plan_spans(
            self.errors,
            max_blocks=max_blocks,
            max_error=max_error,
            allow_adjacent=allow_adjacent,
            include_first_block=include_first_block,
        )

    def heatmap(self, spans: Iterable[Span] = (), ax: Any = None, title: str | None = None):
        """A matplotlib figure of the error matrix in the papers' s→e axes.

        Rows are the source block ``s`` (``-1`` is the embedding output), columns
        the target block ``e``; ``spans`` are outlined.
        """
        import matplotlib

        if ax is None:
            matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
        from matplotlib.patches import Rectangle

        if ax is None:
            fig, ax = plt.subplots(figsize=(6, 5))
        else:
            fig = ax.figure
        image = ax.imshow(
            np.ma.masked_invalid(self.errors),
            cmap="viridis_r" if METRICS[self.metric] == "lower" else "viridis",
        )
        labels = [str(s - 1) for s in range(self.errors.shape[0])]
        labels[0] = "emb"
        ticks = np.arange(self.errors.shape[0])
        ax.set_xticks(ticks, labels, fontsize=7)
        ax.set_yticks(ticks, labels, fontsize=7)
        ax.set_xlabel("target: output of block e")
        ax.set_ylabel("source: output of block s")
        for span in spans:
            ax.add_patch(
                Rectangle(
                    (span.stop - 0.5, span.start - 0.5), 1, 1, fill=False, edgecolor="red", lw=2
                )
            )
        fig.colorbar(image, ax=ax, label=f"{self.metric} ({self.estimator})")
        ax.set_title(title or f"{self.metric} error, {self.rows} rows ({self.tokens} tokens)")
        return fig

    def to_dataframe(self):
        """One row per span ``i < j`` with both notations and several metrics."""
        try:
            import pandas as pd
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("to_dataframe() needs pandas: pip install pandas") from exc
        extra = {m: self.error_matrix(m) for m in ("mse", "cosine", "cka")}
        records = []
        n = self.errors.shape[0]
        for i in range(n):
            for j in range(i + 1, n):
                records.append(
                    {
                        "start": i,
                        "stop": j,
                        "s": i - 1,
                        "e": j - 1,
                        "blocks": j - i,
                        self.metric: self.errors[i, j],
                        **{m: e[i, j] for m, e in extra.items() if m != self.metric},
                    }
                )
        return pd.DataFrame.from_records(records)


#: The estimators :func:`analyze` takes: ``"auto"`` is ``"gcv"`` with enough
#: rows, ``"cv"`` otherwise (:func:`enough_for_gcv`).
ESTIMATORS = ("auto", "cv", "gcv", "in_sample")

Estimator = Literal["auto", "cv", "gcv", "in_sample"]


def enough_for_gcv(rows: int, dim: int, folds: int) -> bool:
    """Whether ``rows`` rows of width ``dim`` are enough for ``"auto"`` to
    rank spans by generalised cross-validation: at least ``folds`` x
    ``(dim + 1)``, so that every fold of a ``folds``-fold split would hold
    more rows than the width. Below it a span's in-sample fit interpolates
    and its GCV (the in-sample error over ``1 - tr(H)/n``, undefined once
    ``n <= tr(H)``) says little, so ``"auto"`` measures on held-out folds
    instead; above it the two plan the same spans at every number of blocks
    from 1 to 8 on SmolLM2 and DINOv2 (``benchmarks/results/estimator.md``)
    and GCV costs one triangular solve a span against about four solves and
    products a fold."""
    return rows >= folds * (dim + 1)


def _auto_capture(
    estimator: str, metric: str, folds: int, capture: Any
) -> tuple[Moments | ChunkedMoments, BlockStack, MassiveRows | None, str]:
    """The moments :func:`analyze` forms for ``estimator``, with the one it
    resolves to: ``capture(folds)`` is the pass (``(moments, stack,
    recorder)``). ``"auto"`` passes once without folds and keeps it when
    :func:`enough_for_gcv`; with fewer rows it passes again with ``folds``
    fold sets (a short pass: the data are few) for ``"cv"``. The row
    metrics fit nothing and read no folds."""
    if estimator == "auto" and metric not in ("linear", "affine"):
        estimator = "gcv"
    if estimator != "auto":
        return (*capture(folds if estimator == "cv" else 0), estimator)
    moments, stack, recorder = capture(0)
    if enough_for_gcv(moments.rows, moments.dim, folds):
        return moments, stack, recorder, "gcv"
    need = pair_nbytes(moments.dim, folds)
    if isinstance(moments, ChunkedMoments) and need > moments.bound:
        # the folds' pass would fall back to GCV all the same (within_bound)
        warnings.warn(
            f"toast: {moments.rows:,} rows of width {moments.dim} are few for GCV, but "
            f"{folds} folds' statistics of one pair of states need {need / 2**30:.2f} GiB, more "
            f"than statistics_bytes={moments.bound / 2**30:.2f} GiB: the errors use GCV; give "
            f"statistics_bytes >= {need:,} or at least {folds * (moments.dim + 1):,} rows",
            stacklevel=4,
        )
        return moments, stack, recorder, "gcv"
    if isinstance(moments, ChunkedMoments):
        moments.close()
    del moments
    return (*capture(folds), "cv")


def _errors(
    moments: Moments | ChunkedMoments,
    metric: str,
    estimator: Any,
    ridge: float,
    progress: bool = False,
) -> np.ndarray:
    """The error matrix, NaN for the spans longer than the moments' pairs
    reach whatever the metric (the row metrics alone could give them, but
    not from disk, so the plans would differ); a chunk of states at a time
    from rows on disk (:class:`ChunkedMoments`, the same errors; its
    replays counted with ``progress``)."""
    if isinstance(moments, ChunkedMoments):
        estimator = within_bound(moments, metric, estimator)
        count = progress_counter("errors (rows on disk)", "replay", not progress)
        return moments.error_matrices([(metric, estimator, ridge)], on_replay=count)[0]
    errors = error_matrix(moments, metric=metric, estimator=estimator, ridge=ridge)
    far = np.triu(np.ones(errors.shape, dtype=bool), moments.layout()["span"] + 1)
    errors[far] = np.nan
    return errors


def within_bound(moments: Moments | ChunkedMoments, metric: str, estimator: Any) -> Any:
    """``estimator``, or ``"gcv"`` (warned) when the held-out errors' fold
    statistics of one source and one target exceed the bound of the rows
    on disk and generalised cross-validation, which needs no folds, fits."""
    held_out = metric in ("linear", "affine") and estimator == "cv"
    if not held_out or not isinstance(moments, ChunkedMoments) or moments.fits_folds():
        return estimator
    need = pair_nbytes(moments.dim, moments.folds)
    warnings.warn(
        f"toast: the {moments.folds} folds' statistics of one pair of states of width "
        f"{moments.dim} need {need / 2**30:.2f} GiB, more than statistics_bytes="
        f"{moments.bound / 2**30:.2f} GiB: the errors use estimator='gcv' (no folds) instead; "
        f"give statistics_bytes >= {need:,} to keep 'cv'",
        stacklevel=3,
    )
    return "gcv"


def analyze(
    model: nn.Module | str | os.PathLike,
    loader: Any,
    *,
    metric: str = "linear",
    estimator: Estimator = "cv",
    folds: int = 5,
    ridge: float = 0.0,
    tokens: Tokens = "all",
    pairs: Pairs = "all",
    precision: Literal["float64", "mixed"] = "float64",
    backend: Literal["auto", "c", "torch"] = "auto",
    calibration: Calibration | None = None,
    stack: BlockStack | None = None,
    massive_rows: bool = False,
    statistics_bytes: int | str | None = None,
    max_memory: int | str | None = None,
    sequential: bool | None = None,
    **options: Any,
) -> Analysis:
    """One pass of ``model`` over ``loader`` → the block error matrix.

    ``model`` may be a checkpoint folder: loaded when it fits ``max_memory``
    (default: the memory available now), else analysed block by block
    (:func:`analyze_from_disk`) with the moments fitted to what the budget
    leaves, as ``toast compress`` plans them (printed; refused up front when
    even one pair's do not fit); ``sequential`` forces a path.

    Every metric of :func:`toast.error_matrix` is then available from
    :meth:`Analysis.error_matrix` without another pass. With ``estimator="cv"``
    the moments keep ``folds`` fold sets (memory grows accordingly: see
    ``toast.Moments.estimate_nbytes``); ``estimator="gcv"`` needs none;
    ``"auto"`` (``toast.compress``'s default) is ``"gcv"`` when the pass
    gave at least ``folds x (width + 1)`` rows and otherwise passes again,
    with folds, for ``"cv"`` (:func:`enough_for_gcv`).
    ``backend`` is that of :func:`toast.hf.capture_moments` (the sums form on
    the model's device with torch, or on the host in the C core). Under
    ``torch.distributed`` each rank passes its shard of the data and gets the
    same analysis (see :func:`toast.hf.capture_moments`). ``calibration`` (or its
    fields as keywords: ``max_samples=...``, ``progress=False``...) bounds the
    pass, see :class:`toast.Calibration`. ``loader`` may be raw text with
    ``tokenizer=`` (and ``max_length``, ``batch_size``, ``num_samples``,
    ``pack``, ``field``), as for :func:`toast.compress`. ``massive_rows``
    also records the rows massive in some state (:class:`toast.hf.capture.massive.MassiveRows`,
    in ``Analysis.massive``; on this process's rows only).
    ``statistics_bytes`` bounds the moments: above it the rows wait on disk
    and the errors form a chunk of states at a time (the same errors; see
    :class:`toast.core.chunked.ChunkedMoments`).
    """
    check("metric", metric, Options(METRICS))
    text = {k: options.pop(k) for k in TEXT_OPTIONS if k in options}
    cal = Calibration.from_options(calibration, **options)
    if isinstance(model, (str, os.PathLike)):
        if not os.path.exists(model):
            raise TypeError(
                f"model must be a torch.nn.Module or a checkpoint folder; {os.fspath(model)!r} "
                "is neither (no such folder: models are read from local folders only)"
            )
        kw = dict(metric=metric, estimator=estimator, folds=folds, ridge=ridge, tokens=tokens,
                  pairs=pairs, precision=precision, massive_rows=massive_rows)  # fmt: skip
        batches = as_batches(loader, **text)
        path = (max_memory, sequential, backend)  # how the folder is read
        return _analyze_folder(model, batches, cal, statistics_bytes, *path, kw)
    if max_memory is not None or sequential is not None:
        raise ValueError("max_memory= and sequential= choose how a checkpoint folder is read: "
                         "pass the folder, or leave them out for a loaded model")  # fmt: skip
    options = dict(tokens=tokens, pairs=pairs, precision=precision, backend=backend,
                   calibration=cal, stack=stack, statistics_bytes=statistics_bytes)  # fmt: skip
    capture = _in_memory(model, as_batches(loader, **text), massive_rows, options)
    check("estimator", estimator, Options(ESTIMATORS))
    moments, stack, recorder, resolved = _auto_capture(estimator, metric, folds, capture)
    resolved = within_bound(moments, metric, resolved)
    errors = _errors(moments, metric, resolved, ridge, cal.progress)
    return Analysis(moments, errors, metric, resolved, tokens, stack.path, ridge, recorder)


def _in_memory(
    model: nn.Module, batches: Any, massive_rows: bool, options: dict[str, Any]
) -> Callable[[int], tuple[Moments | ChunkedMoments, BlockStack, MassiveRows | None]]:
    """The capture pass of :func:`analyze` with a given number of folds
    (what :func:`_auto_capture` calls once or twice)."""

    def capture(folds: int) -> tuple[Moments | ChunkedMoments, BlockStack, MassiveRows | None]:
        recorder = MassiveRows() if massive_rows else None
        moments, found = capture_moments(model, batches, folds=folds, observe=recorder, **options)
        return moments, found, recorder

    return capture


def _analyze_folder(
    folder: str | os.PathLike,
    batches: Any,
    cal: Calibration,
    statistics_bytes: int | str | None,
    max_memory: int | str | None,
    sequential: bool | None,
    backend: Any,
    kw: dict[str, Any],
) -> Analysis:
    """:func:`analyze` of a checkpoint folder, on the path its budget allows
    (``backend`` is the in-memory pass's; the block-by-block pass sums on the host)."""
    from toast.io.local import load_model
    from toast.methods.base import get_method
    from toast.methods.pipeline import plan_folder

    pairs = kw["pairs"]
    config = ToastConfig(  # what its plan reads: the moments' folds, pairs and bound
        max_error=math.inf,  # no plan: every pair the moments keep
        max_span=1 if pairs == "consecutive" else None if pairs == "all" else pairs,
        estimator=kw["estimator"],
        folds=kw["folds"],
        statistics_bytes="auto" if statistics_bytes is None else statistics_bytes,  # type: ignore[arg-type]
        calibration=cal,
    )
    method = get_method("toast")
    disk, config = plan_folder(
        method, folder, config, batches, max_memory, sequential, "toast analyze"
    )
    if disk is None:
        return analyze(load_model(folder), batches, calibration=cal, backend=backend, **kw,
                       statistics_bytes=statistics_bytes)  # fmt: skip
    return analyze_from_disk(disk, batches, calibration=cal, **kw,
                             statistics_bytes=config.statistics_bytes)  # fmt: skip


def analyze_from_disk(
    folder: str | os.PathLike | DiskModel,
    loader: Any,
    *,
    metric: str = "linear",
    estimator: Estimator = "cv",
    folds: int = 5,
    ridge: float = 0.0,
    tokens: Tokens = "all",
    pairs: Pairs = "all",
    precision: Literal["float64", "mixed"] = "float64",
    calibration: Calibration | None = None,
    buffer_dir: str | os.PathLike | None = None,
    massive_rows: bool = False,
    statistics_bytes: int | str | None = None,
    **options: Any,
) -> Analysis:
    """:func:`analyze` of the checkpoint in ``folder`` without loading the
    model: the blocks run one at a time from disk
    (:func:`toast.hf.capture.disk_moments.capture_moments_from_disk`) and give the
    same moments, so the same error matrix and plans. The states of every
    calibration token wait in a temporary directory under ``buffer_dir``.
    ``massive_rows`` records the rows massive in some state, as
    :func:`analyze` does."""
    from toast.hf.capture.disk_moments import capture_moments_from_disk
    from toast.hf.capture.sequential import DiskModel  # noqa: F811 (imported for typing above)

    check("metric", metric, Options(METRICS))
    text = {k: options.pop(k) for k in TEXT_OPTIONS if k in options}
    cal = Calibration.from_options(calibration, **options)
    batches = as_batches(loader, **text)

    def capture(with_folds: int) -> tuple[Moments | ChunkedMoments, BlockStack, Any]:
        recorder = MassiveRows() if massive_rows else None
        moments, stack = capture_moments_from_disk(
            DiskModel.open(folder, cal.blocks, cal.compute_dtype),
            batches,
            tokens=tokens,
            folds=with_folds,
            pairs=pairs,
            precision=precision,
            calibration=cal,
            buffer_dir=buffer_dir,
            observe=recorder,
            statistics_bytes=statistics_bytes,
        )
        return moments, stack, recorder

    check("estimator", estimator, Options(ESTIMATORS))
    moments, stack, recorder, resolved = _auto_capture(estimator, metric, folds, capture)
    resolved = within_bound(moments, metric, resolved)
    errors = _errors(moments, metric, resolved, ridge, cal.progress)
    return Analysis(moments, errors, metric, resolved, tokens, stack.path, ridge, recorder)
