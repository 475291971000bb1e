"""The options of ``toast.compress(..., method="toast")``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field
from typing import Any, ClassVar, Literal

from toast._validation import Interval, Options, Predicate, validate_fields
from toast.core import METRICS, Pairs
from toast.core.kinds import kind_names
from toast.hf.data.calibration import BACKEND_HELP, BACKENDS, TOKENS, Calibration, Tokens
from toast.methods.help import CHECK_FRACTION_HELP, FALLBACK_HELP, NUM_BLOCKS_HELP

__all__ = ["CLOSED_FORM", "GHOSTED", "GHOSTED_RIDGE", "STATISTICS_BYTES", "TRAINED", "ToastConfig"]

#: The analysis's moments above this many bytes keep the rows on disk
#: instead and form the errors a chunk of states at a time (the same errors):
#: "auto" is 1 GiB, or what one pair's held-out errors need when wider
#: (:func:`toast.core.chunked.resolve_bound`).
STATISTICS_BYTES: int | Literal["auto"] = "auto"

#: The translators TOAST fits in closed form from the moments and those it
#: trains (:data:`toast.core.kinds.KINDS`; LinearPatch's own map needs a pass
#: of its own, ``method="linearpatch"``).
CLOSED_FORM = kind_names(fit="moments")
TRAINED = kind_names(fit="trained")

#: Ghosted Layers' ε (arXiv 2605.15491): ``(XᵀX + εI) M = Xᵀ(Y − X)`` on sums of
#: float64 products, ``W = I + M``.
GHOSTED_RIDGE = 1e-6

#: Ghosted Layers as published, as TOAST options (:meth:`ToastConfig.ghosted`):
#: LLM-Streamline's window (the one of highest mean cosine between its input and
#: output states), a linear map without bias shrunk by ε towards the identity,
#: every row fitted as it is, every calibration batch fitting.
GHOSTED: dict[str, Any] = {
    "single_window": True,
    "metric": "cosine",
    "estimator": "gcv",  # the cosine needs no folds: none are kept
    "translator": "linear",
    "ridge": GHOSTED_RIDGE,
    "ridge_target": "identity",
    "massive_rows": "fit",
    "check_fraction": 0.0,
}


@dataclass(frozen=True)
class ToastConfig:
    """How TOAST analyses, plans and fits (see :func:`toast.compress`).

    Planning: ``num_blocks`` blocks to remove (at most: fewer where
    ``max_error`` allows fewer), each span within ``max_error``, or explicit
    ``spans``; ``budget`` is another name for ``num_blocks`` (the TOAST
    paper's; giving both with different values is an error);
    ``include_first_block`` lets a planned span start at block 0 (the
    papers keep it); ``max_span`` bounds the blocks one span may replace
    (None: any), and with it the analysis's memory: the
    moments keep only pairs of states at most that far apart (and from disk,
    only ``max_span + 1`` states wait there). Analysis: ``metric``,
    ``estimator``, ``folds``, ``tokens``, ``backend``; ``statistics_bytes``
    bounds the analysis's moments (above it the rows wait on disk and the
    errors are formed a chunk of states at a time, the same errors; see
    docs/large-models.md). Fitting:
    ``translator`` (closed form: identity, linear, affine, diagonal,
    orthogonal, and LinearPatch's Hadamard form fitted by least squares,
    rotated_diagonal, or least squares shrunk towards it, patch_ridge, see
    :mod:`toast.core.patch`; trained: mlp, resmlp with ``max_rows``,
    ``train_steps``, ``lr``), ``ridge``, ``fit``
    (``"independent"``: every span on the original model's activations, the
    papers' protocol; ``"sequential"``: each span on the partially
    compressed model). ``calibration`` bounds every pass over the data.

    Held-out check (in memory, independent fits): one calibration batch in
    every ``round(1 / check_fraction)`` (the last of each group; the last
    batch when there are at least 2 but fewer than one group; the last
    sequences of a single batch of two or more; nothing, with a warning and
    the report saying so, for one batch of one sequence: see
    :class:`toast.hf.evaluate.check.CheckSplit`) stays out of the analysis and the fits;
    each span's translator is then measured there against plain removal of
    the same blocks (perplexity for a causal LM, else output cosine), the
    report says which measured better, and with ``fallback`` a span whose
    translator lost is replaced by the identity (plain removal).
    ``check_fraction=0`` is the papers' protocol: every batch is analysed.
    With ``refit`` (default) each closed-form translator the check kept is
    then fitted again on every batch, the held-out ones too (one more pass
    over the held-out batches, at the spans' states only): the check
    chooses between fit and removal, and what it chose gets all the data
    (measured on SmolLM2: ``benchmarks/results/few_batches.md``);
    ``refit=False`` keeps the fits the check measured.

    Measured choice: with ``num_blocks``, the ``candidates`` plans of
    lowest predicted error (the planned spans, then the single windows of
    as many blocks) are each fitted in closed form and measured by
    cross-validation over the calibration batches (4 folds: every batch
    scored by the fits of the other folds' batches, perplexity pooled over
    every token; one batch: on its held-out sequences), and the best
    measured becomes the plan. The predicted errors rank windows within a
    few percent of each other by a figure of the states alone; on SmolLM2
    at 6 blocks the best predicted window is not the best measured
    (``benchmarks/results/windows.md``). ``candidates=1``, a sequential or
    trained fit, or ``check_fraction=0`` (the papers' protocols) keep the
    best predicted plan unmeasured, and the report says so.

    One window: ``single_window=True`` with ``num_blocks=n`` plans a single
    span of ``n`` blocks, the one of lowest error under ``metric`` among
    those starting at block 1 (0 with ``include_first_block``) and ending
    before the last block (LLM-Streamline's and LinearPatch's range); with
    ``metric="cosine"`` that is LLM-Streamline's rule, the window whose
    input and output states have the highest cosine per token, averaged
    over every token (ties: the earlier window).

    Ridge target: ``ridge_target="identity"`` (``translator="linear"``
    only) shrinks the map towards the identity instead of zero: ``W = I +
    M`` with ``(XᵀX + λI) M = Xᵀ(Y − X)``, i.e. ``min ‖XW − Y‖² + λ‖W −
    I‖²`` (Ghosted Layers' operator, with ``λ = ridge`` on the float64 sums;
    see :meth:`ghosted`). At ``ridge=0`` both targets give the same fit.

    Massive activations: with ``massive_rows="plain"`` (default) a linear or
    affine translator of a span that would have to create a row's massive
    activation (an attention sink: norm above 20× the batch median in the
    span's last state, not in its first) is fitted as if that row's target
    were its input, as plain removal leaves it (:mod:`toast.hf.capture.massive`; in
    memory, one process); ``"fit"`` fits every row alike (the papers). The
    error matrix always sees every row as it is.
    """

    num_blocks: int | None = None
    max_error: float | None = None
    spans: Sequence[tuple[int, int]] | None = None
    translator: str = "affine"
    fit: Literal["independent", "sequential"] = "independent"
    metric: str = "linear"
    estimator: Literal["auto", "cv", "gcv", "in_sample"] = "auto"
    folds: int = 5
    tokens: Tokens = "all"
    ridge: float | None = None
    include_first_block: bool = False
    max_span: int | None = None
    max_rows: int = 50_000
    train_steps: int = 300
    lr: float = 1e-3
    backend: Literal["auto", "c", "torch"] = "auto"
    check_fraction: float = 0.1
    fallback: bool = True
    refit: bool = True
    massive_rows: Literal["fit", "plain"] = "plain"
    single_window: bool = False
    candidates: int = 3
    ridge_target: Literal["zero", "identity"] = "zero"
    statistics_bytes: int | Literal["auto"] = STATISTICS_BYTES
    calibration: Calibration = field(default_factory=Calibration)
    #: another name for ``num_blocks`` (the TOAST paper's), init-only: read
    #: ``num_blocks`` (a config dict saved with ``budget`` still loads)
    budget: InitVar[int | None] = None

    #: other names of fields, each accepted as a keyword and on the command line
    ALIASES: ClassVar[dict[str, str]] = {"budget": "num_blocks"}

    #: What each option means on the command line (``toast compress --method toast``).
    HELP: ClassVar[dict[str, str]] = {
        "num_blocks": NUM_BLOCKS_HELP,
        "budget": "same as --num-blocks (TOAST's paper name for it)",
        "max_error": "largest predicted error per span",
        "translator": "translator kind",
        "fit": "fit every span on the original model, or each on the partly compressed one",
        "metric": "selection metric",
        "estimator": "how the error of a span is estimated",
        "folds": "cross-validation folds (--estimator cv, and auto with few rows)",
        "tokens": "rows of each sample that enter the statistics",
        "ridge": "ridge (L2) of the translators' least squares and of the error estimates "
        "(none: the minimum-norm solution)",
        "include_first_block": "block 0 may be removed too (the papers always keep it)",
        "max_span": "most blocks one span may replace (bounds the states kept from disk)",
        "max_rows": "rows sampled to train an mlp or resmlp translator",
        "train_steps": "training steps of an mlp or resmlp translator",
        "lr": "learning rate of an mlp or resmlp translator",
        "backend": BACKEND_HELP,
        "check_fraction": CHECK_FRACTION_HELP,
        "fallback": FALLBACK_HELP,
        "refit": "keep the fits the check measured (default: fitted again on every batch, the "
        "held-out ones too, once the check has kept them)",
        "massive_rows": "rows whose massive activation (attention sinks) the removed blocks "
        "would have to create: fitted as plain removal leaves them, or like every row (the "
        "papers)",
        "single_window": "one span of --num-blocks blocks, the window of lowest error from "
        "block 1 to before the last (with --metric cosine: LLM-Streamline's)",
        "candidates": "plans of --num-blocks measured by cross-validation over the "
        "calibration batches before one is kept (the planned spans, then the single windows "
        "of lowest predicted error); the best measured wins (1: the best predicted, "
        "unmeasured)",
        "ridge_target": "what --ridge shrinks a linear translator towards (identity: Ghosted "
        "Layers' W = I + M)",
        "statistics_bytes": "largest moments held in memory; above it the rows wait on disk "
        "and the errors form a chunk of states at a time (a size: 1GiB)",
    }

    _parameter_constraints: ClassVar[dict[str, list[Any]]] = {
        "num_blocks": [Interval(int, 1, None), None],
        "max_error": [Interval(float, 0, None), None],
        "spans": [Predicate(lambda v: isinstance(v, Sequence), "a list of (start, stop)"), None],
        "translator": [Options(CLOSED_FORM + TRAINED)],
        "fit": [Options(("independent", "sequential"))],
        "metric": [Options(METRICS)],
        "estimator": [Options(("auto", "cv", "gcv", "in_sample"))],
        "folds": [Interval(int, 2, None)],
        "tokens": [Options(TOKENS)],
        "ridge": [Interval(float, 0, None), None],
        "include_first_block": [bool],
        "max_span": [Interval(int, 1, None), None],
        "max_rows": [Interval(int, 1, None)],
        "train_steps": [Interval(int, 1, None)],
        "lr": [Interval(float, 0, None, closed="neither")],
        "backend": [Options(BACKENDS)],
        "check_fraction": [Interval(float, 0, 0.5, closed="both")],
        "fallback": [bool],
        "refit": [bool],
        "massive_rows": [Options(("fit", "plain"))],
        "single_window": [bool],
        "candidates": [Interval(int, 1, None)],
        "ridge_target": [Options(("zero", "identity"))],
        "statistics_bytes": [Interval(int, 1, None), Options(("auto",))],
        "calibration": [Calibration],
    }

    def __post_init__(self, budget: int | None) -> None:
        validate_fields(self, self._parameter_constraints, aliases={"budget": budget})
        if self.spans is not None and (self.num_blocks is not None or self.max_error is not None):
            raise ValueError(
                "give either spans=[(start, stop), ...] or num_blocks/max_error, not both"
            )
        if self.spans is None and self.num_blocks is None and self.max_error is None:
            raise ValueError(
                "give num_blocks=<blocks to remove>, max_error=..., or both (or spans=...)"
            )
        if self.single_window and (self.num_blocks is None or self.max_error is not None):
            raise ValueError("single_window=True plans one window of num_blocks=<blocks> blocks")
        if self.single_window and METRICS[self.metric] != "lower":
            raise ValueError(
                f"single_window=True needs a metric where lower means redundant, not "
                f"{self.metric!r}"
            )
        if self.ridge_target == "identity" and self.translator != "linear":
            raise ValueError(
                "ridge_target='identity' shrinks a linear map towards the identity: it needs "
                f"translator='linear', not {self.translator!r}"
            )
        longest = max((stop - start for start, stop in self.spans or ()), default=0)
        if self.max_span is not None and longest > self.max_span:
            raise ValueError(
                f"spans= has a span of {longest} blocks, longer than max_span={self.max_span}; "
                "raise max_span or leave it None"
            )

    @classmethod
    def ghosted(cls, num_blocks: int | None = None, **options: Any) -> ToastConfig:
        """Ghosted Layers (Yun et al., arXiv 2605.15491) as published
        (:data:`GHOSTED`), removing ``num_blocks`` blocks (or ``budget=``),
        with ``options`` (fields, and calibration options such as
        ``progress``) on top: the LLM-Streamline window, replaced by ``h ↦
        h W``, ``W = I + (XᵀX + εI)⁻¹ Xᵀ(Y − X)`` (ε = 1e-6, float64), ``X``
        and ``Y`` the original model's states entering and leaving the
        window, every token.
        """
        calibration_options, own = Calibration.split(options)
        merged: dict[str, Any] = {**GHOSTED, "num_blocks": num_blocks, **own}
        merged["calibration"] = Calibration.from_options(
            merged.get("calibration"), **calibration_options
        )
        return cls(**merged)

    @property
    def pairs(self) -> Pairs:
        """The pairs of states the analysis's moments keep: a plan of
        ``num_blocks`` blocks joins states at most ``num_blocks`` apart (a span
        ``(i, j)`` replaces ``j - i`` blocks), given spans their longest, so
        the moments need no pair further apart (``max_span`` bounds it
        further); every pair only for ``max_error`` alone."""
        reach = [self.max_span]
        if self.spans is not None:
            reach.append(max((stop - start for start, stop in self.spans), default=1))
        elif self.num_blocks is not None:  # with or without max_error
            reach.append(self.num_blocks)
        bounded = [r for r in reach if r is not None]
        return min(bounded) if bounded else "all"
