"""The options of :func:`toast.methods.replaceme.replaceme` and ``toast.compress(...,
method="replaceme")``: one frozen, validated dataclass.

The method is Shopkhoev et al., "ReplaceMe" (arXiv 2505.02819): windows
ranked by the angular distance on the last token (§3.1, Eq. 4), a
least-squares transform (Eq. 6) folded into the down-projection. toast's
defaults differ where measurement showed the paper's protocol losing to
plain removal or not converging (``benchmarks/bench_fits.py``): rows whose
massive activation the cut would create are fitted as plain removal leaves
them, the cut is chosen among the four closest windows by held-out loss,
every fit is checked against plain removal on held-out batches, and the
cosine objective starts from the LS solution and runs L-BFGS to
convergence. :meth:`ReplaceMeConfig.paper` gives the paper's protocol
(every row fitted, the distance alone choosing, no held-out batches, and
Table 13's Adam: lr 1e-4, batches of 1024 rows, 10 epochs from the
identity).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np

from toast._validation import Interval, Options, Predicate, check, validate_fields
from toast.core.moments import PRECISIONS
from toast.hf.data.calibration import BACKEND_HELP, BACKENDS, TOKENS, Calibration, Tokens
from toast.methods.help import CHECK_FRACTION_HELP, FALLBACK_HELP, NUM_BLOCKS_HELP

__all__ = [
    "ADJACENT",
    "DISTANCES",
    "OBJECTIVES",
    "PAPER",
    "PLACEMENTS",
    "SELECTIONS",
    "STRUCTURES",
    "ReplaceMeConfig",
    "distance_candidates_only",
]

#: Distances between two states, averaged over rows: ``"angular"`` =
#: ``acos(cos)/π`` (the reference code), ``"cosine"`` = ``1 − cos`` (the
#: paper's text), ``"l2"`` = ``‖a − b‖`` (the paper's ablation, Fig. 5).
DISTANCES = ("angular", "cosine", "l2")
ADJACENT = ("merge", "forbid")
OBJECTIVES = ("ls", "cosine", "identity")
STRUCTURES = ("full", "diagonal", "orthogonal", "rotated_diagonal", "patch_ridge")
#: Structures fitted in closed form only (no cosine objective)
LS_STRUCTURES = ("orthogonal", "rotated_diagonal", "patch_ridge")
PLACEMENTS = ("auto", "fold", "mlp", "block")
LOSSES = ("approximate", "exact")
SOLVERS = ("adam", "lbfgs")
PENALTIES = ("l1", "l2")
INITS = ("identity", "ls")
#: The paper's protocol (see :meth:`ReplaceMeConfig.paper`).
PAPER: dict[str, Any] = {
    "selection": "distance",
    "massive_rows": "fit",
    "candidates": 1,
    "predicted_candidates": 0,
    "check_fraction": 0.0,
    "solver": "adam",
    "lr": 1e-4,
    "rows_per_step": 1024,
    "epochs": 10,
    "init": "identity",
    "loss": "approximate",
}
#: What the least-squares fit does with the rows whose massive activation the
#: cut would have to create: rows whose target ``L_e − Y`` is more than
#: :data:`toast.hf.capture.massive.MASSIVE_RATIO` (20) times the batch's
#: median target norm while their
#: input M is not massive (an attention sink made inside the cut; a few
#: rows whose squared error outweighs all others ~10⁴-fold). ``"fit"``: like
#: every row (the paper); ``"exclude"``: left out; ``"plain"``: fitted to
#: what plain removal gives them (target M), so T leaves them as plain
#: removal would and fits every other row.
MASSIVE = ("fit", "exclude", "plain")
#: How the cuts are chosen (see :class:`ReplaceMeConfig`, **Selection**;
#: the scoring of the rules beyond the distance is in
#: :mod:`toast.methods.selection`).
SELECTIONS = ("distance", "block_influence", "sleb", "predicted", "measured")
FITS = ("independent", "sequential")


def _is_dtype(value: Any) -> bool:
    try:
        return np.dtype(value).kind == "f"
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class ReplaceMeConfig:
    """How ReplaceMe cuts, estimates and places its transforms.

    **Cut** (§3.1): ``num_blocks`` blocks in ``num_cuts`` windows chosen by
    the ``distance`` (``"angular"``, the reference code's; ``"cosine"``;
    ``"l2"``) on ``distance_tokens`` (the ``"last"`` non-pad token by
    default), none starting before block ``min_start``; ``adjacent`` windows
    merge into one cut or are forbidden (see
    :meth:`toast.methods.replaceme.DistanceProfile.select`). Or explicit
    ``spans=[(start, stop), ...]`` and no profile.

    **Selection** (``selection``, each usable with every objective):

    - ``"measured"`` (default): the ``candidates`` windows of smallest
      ``distance`` and the ``predicted_candidates`` windows of smallest
      predicted least-squares error (``"predicted"`` below; one more pass)
      are each fitted and measured on the held-out batches and the best
      becomes the cut (see "Cut chosen by measurement" below); without a
      held-out batch (one calibration batch of one sequence) the
      window of smallest predicted error; with ``candidates=1``, several
      cuts, plain removal or ``check_fraction=0`` it is ``"distance"``.
    - ``"distance"``: the window(s) of smallest ``distance`` alone (the
      paper's Eq. 4; ``candidates`` is not used).
    - ``"block_influence"``: ShortGPT (arXiv 2403.03853): the
      ``num_blocks`` blocks of lowest ``BI_i = 1 − mean cos(x_i, x_{i+1})``
      over every non-pad token, anywhere from ``min_start`` on; each
      maximal run of consecutive chosen blocks is one cut with its own
      transform (``num_cuts`` must stay 1: the runs decide).
    - ``"sleb"``: SLEB (arXiv 2402.09025): ``num_blocks`` times, the block
      whose removal from the model pruned so far gives the lowest
      calibration perplexity (output cosine for a model without an LM
      head), measured by skipping blocks with hooks (the model is untouched
      until the surgery); one forward of the calibration batches per
      remaining block per step. Runs become cuts as above.
    - ``"predicted"``: the window(s) whose least-squares transform has the
      smallest predicted error (toast's linear span error from one pass
      capturing the moments of the block states,
      :func:`toast.methods.selection.predicted_errors`).

    The rules other than ``"distance"`` and ``"measured"`` are in memory
    only (:mod:`toast.methods.selection`); each cut's ``Span.error`` holds
    the rule's score (summed block influence, the perplexity after the
    last SLEB step, the predicted error).

    **Transform**, per cut ``blocks[s:e]``, T with ``M T + Y ≈ L_e`` where
    ``M`` is the MLP output of block ``s − 1`` and ``Y`` its attention
    residual, on every non-pad token (every token with
    ``include_padding=True``, as the reference does):

    - ``objective="ls"`` (Eq. 6): ``T = (MᵀM + ridge·I)⁻¹ Mᵀ(L − Y)`` from
      float64 sums of exactly ``MᵀM``, ``Mᵀ(L − Y)`` and the column sums
      (``backend``: where they are formed; ``precision``: ``"float64"``
      products, or ``"mixed"``: float32 products of chunks of 4,096 rows
      summed in float64, see :class:`toast.Moments`);
      ``massive_rows`` says what it does with the few rows whose massive
      activation only the removed blocks create (see :data:`MASSIVE`);
      ``structure="diagonal"`` (Eq. 13) or ``"orthogonal"`` (Procrustes) for
      the Table 6 variants; ``"rotated_diagonal"``: LinearPatch's form
      ``H diag(d) Hᵀ`` (arXiv 2505.24680, ``H`` a Hadamard matrix of the
      width, :func:`toast.core.hadamard.hadamard`) with ``d`` the least-squares
      scale of each rotated channel, and ``"patch_ridge"``: least squares
      shrunk towards that form, ``λ`` by generalised cross-validation
      (:func:`toast.core.patch.fit_patch`). Both are full ``d × d`` maps, so
      they fold where ``"full"`` does. LinearPatch's own scale (a ratio of
      rotated magnitudes of the whole hidden state, ``method="linearpatch"``)
      is not defined on the MLP output a cut's T acts on; the least-squares
      scale of the same form is.
    - ``objective="cosine"``: :func:`toast.methods.replaceme.fit_cosine` on
      rows kept in a disk-backed buffer of at most ``max_buffer_bytes``
      (``buffer_dtype``, under ``buffer_dir``; reservoir-sampled beyond
      that); ``loss="exact"`` (Eq. 7, ``cos(M T + Y, L)``: the state the
      next block reads; the default, as it measured better than the
      approximate one from the same start) or ``"approximate"`` (Eq. 8,
      ``cos(M T, L − Y)``, the paper's default; its buffer keeps two states
      per row instead of three);
      ``init="ls"`` (default) starts from the LS solution (one pass gives
      both), ``"identity"`` from T = I; ``solver="lbfgs"`` (default: full
      batch, strong Wolfe line search, until the largest gradient entry, the
      change of the mean objective or the largest step entry is below
      ``tol``, or ``lbfgs_steps`` iterations) or ``"adam"`` (``lr``,
      ``rows_per_step`` rows per step, ``epochs``: Table 13);
      ``penalty``/``penalty_weight``.
    - ``objective="identity"``: T = I, plain removal (UIDL, the baseline).

    **Placement**: ``"fold"`` into the down-projection of block ``s − 1``
    (a standard checkpoint); ``"mlp"``: an explicit module after it
    (``d²`` extra parameters); ``"block"``: the paper's A.9 separate
    transform on the residual stream (a linear block in place of the cut,
    ``d²`` parameters; saved with :func:`toast.save_pretrained`). ``"auto"``
    (default) never refuses a supported family: where the MLP output enters
    the residual stream through the down-projection (or the structure is
    diagonal) it fits ``"fold"`` (as the paper) and ``"block"`` with the
    asked structure, each through the whole cut choice and held-out check
    below, and keeps the one whose model measured better on the held-out
    batches (the fold on ties, and without held-out batches: a fold maps
    the MLP output, the block placement the whole residual state, which a
    cut that changes the state in a way the MLP output cannot follow needs:
    on a real post-MLP-norm model of 18 blocks, 4 removed, the unmeasured
    fold of the last four blocks measured 6,954 where the block placement
    of the same cut measured 108); and where a norm follows the down-projection (Gemma
    2/3, OLMo-2: a full T does not fold there) it fits the placements that
    are exact there, in this order: a diagonal T folded into that norm's
    weight (a standard checkpoint), the asked ``structure`` kept as an
    ``"mlp"`` module, and as a ``"block"``; each goes through the whole
    cut choice and held-out check below (three times the estimation passes
    and held-out evaluations of one placement), and the one whose model
    measured best on the held-out batches is kept (the first on ties). Without
    held-out batches (``check_fraction=0``, one batch of one sequence,
    sequential fits) the first, the (diagonal) fold, is kept. From disk only
    the (diagonal) fold is fitted (the written checkpoint must be standard). The
    report says which was chosen and why (``placement_note``,
    ``placements``). ``fit="independent"`` estimates every
    cut in one pass on the original model; ``"sequential"`` each on the
    model with the previous cuts applied (one pass per cut). ``check``
    verifies on the first batch that each fold target's output moves
    exactly with its MLP output. ``calibration`` bounds every pass.

    **Cut chosen by measurement** (``selection="measured"``): for one cut
    (``num_cuts=1``, no ``spans``) and a fitted objective, the ``candidates`` windows of
    smallest distance and the ``predicted_candidates`` of smallest predicted
    LS error (in memory; from disk the distance's only) are all fitted in
    the one estimation pass and each is measured on the held-out batches
    (below); the cut is the one that measured best, fitted or plainly
    removed. The distance on the last token cannot see what a window costs
    the other tokens (an attention sink the window would have to create),
    nor how well a linear map can stand in for it; the held-out loss and
    the predicted error do (on SmolLM2 at 2 of 30 blocks the distance's
    windows measured 40.7 against 35.1 for the predicted one,
    ``benchmarks/bench_peers.py``). ``candidates=1`` lets the distance
    alone choose (the paper).

    **Held-out check**: one calibration batch in every ``round(1 /
    check_fraction)`` (the last of each group; the last batch when there are
    at least 2 but fewer than one group; the last sequences of a single
    batch of two or more; none with ``check_fraction=0``, and none, with a
    warning, for one batch of one sequence: see
    :class:`toast.hf.evaluate.check.CheckSplit`) is kept out of the cut
    choice and the fit; each fitted cut is then measured there against
    plain removal of the same blocks (perplexity, or output cosine), the
    report says which measured better,
    and with ``fallback`` a cut whose fit lost is removed plainly
    (:mod:`toast.methods.replaceme.check`; in-memory, independent fits);
    a cut whose fit won is fitted again on every batch (one more pass) and,
    with ``fallback``, measured once more (two more held-out evaluations):
    a refit that lost to plain removal there keeps the transform that won,
    so the model never measures worse than plain removal of its cuts on
    the held-out batches.
    ``check_fraction=0`` is the paper's protocol: every batch fits.

    **Memory**: ``cuts_at_once`` fits at most that many cuts (candidates
    included) in one estimation pass, each holding its float64 statistics
    (two ``d x d`` panels); None fits them all at once. Fits are
    independent, so the result is the same with more passes. From disk,
    ``max_memory`` sets it when all at once would not fit.
    """

    num_blocks: int | None = None
    objective: Literal["ls", "cosine", "identity"] = "ls"
    num_cuts: int = 1
    selection: Literal["distance", "block_influence", "sleb", "predicted", "measured"] = "measured"
    adjacent: Literal["merge", "forbid"] = "merge"
    spans: Sequence[tuple[int, int]] | None = None
    distance: Literal["angular", "cosine", "l2"] = "angular"
    distance_tokens: Tokens = "last"
    min_start: int = 1
    structure: Literal["full", "diagonal", "orthogonal", "rotated_diagonal", "patch_ridge"] = "full"
    ridge: float = 0.0
    massive_rows: Literal["fit", "exclude", "plain"] = "plain"
    loss: Literal["approximate", "exact"] = "exact"
    solver: Literal["adam", "lbfgs"] = "lbfgs"
    lr: float = 1e-4
    rows_per_step: int = 1024
    epochs: int = 10
    lbfgs_steps: int = 100
    tol: float = 1e-7
    penalty: Literal["l1", "l2"] | None = None
    penalty_weight: float = 0.0
    init: Literal["identity", "ls"] = "ls"
    placement: Literal["auto", "fold", "mlp", "block"] = "auto"
    fit: Literal["independent", "sequential"] = "independent"
    check_fraction: float = 0.1
    fallback: bool = True
    candidates: int = 4
    predicted_candidates: int = 2
    cuts_at_once: int | None = None
    include_padding: bool = False
    max_buffer_bytes: int = 8 * 2**30
    buffer_dtype: Any = np.float32
    buffer_dir: str | os.PathLike | None = None
    backend: Literal["auto", "c", "torch"] = "auto"
    precision: Literal["float64", "mixed"] = "float64"
    check: bool = True
    calibration: Calibration = field(default_factory=Calibration)

    #: What each option means on the command line (``toast compress --method replaceme``).
    HELP: ClassVar[dict[str, str]] = {
        "num_blocks": NUM_BLOCKS_HELP,
        "objective": "how the transform is fitted",
        "num_cuts": "number of transforms",
        "selection": "how the cut is chosen (measured: the windows of smallest distance and of "
        "smallest predicted error, each fitted and measured on held-out batches; distance: "
        "the paper's; block_influence: ShortGPT's; sleb: SLEB's greedy measured removal; "
        "predicted: the smallest predicted least-squares error)",
        "adjacent": "what to do with touching cuts",
        "distance": "distance of the cut profile",
        "distance_tokens": "tokens the profile measures",
        "min_start": "first block that may be cut",
        "structure": "structure of the LS transform",
        "ridge": "ridge (L2) of the least-squares transform (0: none)",
        "massive_rows": "rows whose massive activation (attention sinks) the cut would have to "
        "create: plain (fitted as plain removal leaves them), exclude (left out), fit (like "
        "every row, the paper)",
        "loss": "cosine objective: exact (of the state the next block reads) or approximate "
        "(the paper's)",
        "solver": "cosine solver: lbfgs (full batch, to convergence) or adam (the paper's)",
        "lr": "cosine with --solver adam: learning rate",
        "rows_per_step": "cosine with --solver adam: rows per step",
        "epochs": "cosine with --solver adam: epochs",
        "lbfgs_steps": "cosine with --solver lbfgs: most iterations",
        "tol": "cosine with --solver lbfgs: stop once the largest gradient entry, the change "
        "of the mean objective or the largest step entry is below it",
        "penalty": "cosine: penalty on the transform's entries (none: no penalty)",
        "penalty_weight": "cosine: weight of --penalty",
        "init": "cosine: start from the LS solution (ls) or the identity",
        "placement": "where the transform goes (auto: folded where exact, else the exact "
        "placement measured best on held-out batches)",
        "fit": "estimate every cut on the original model, or each on the model with the "
        "previous cuts applied",
        "check_fraction": CHECK_FRACTION_HELP,
        "fallback": FALLBACK_HELP,
        "candidates": "windows of smallest distance measured on held-out batches to choose the cut",
        "predicted_candidates": "windows of smallest predicted error measured beside them (one "
        "more pass; in memory only)",
        "cuts_at_once": "most cuts (candidates included) fitted in one estimation pass "
        "(default: all)",
        "include_padding": "fit on pad tokens too",
        "max_buffer_bytes": "cosine row buffer (a size: 8GiB)",
        "buffer_dir": "folder of the cosine row buffer (default: the temporary folder)",
        "backend": BACKEND_HELP,
        "precision": "products of the LS statistics (mixed: float32, faster, less exact)",
        "check": "skip checking on the first batch that each fold target's output moves "
        "exactly with its MLP output",
    }

    _parameter_constraints: ClassVar[dict[str, list[Any]]] = {
        "num_blocks": [Interval(int, 1, None), None],
        "objective": [Options(OBJECTIVES)],
        "num_cuts": [Interval(int, 1, None)],
        "selection": [Options(SELECTIONS)],
        "adjacent": [Options(ADJACENT)],
        "spans": [Predicate(lambda v: isinstance(v, Sequence), "a list of (start, stop)"), None],
        "distance": [Options(DISTANCES)],
        "distance_tokens": [Options(TOKENS)],
        "min_start": [Interval(int, 1, None)],
        "structure": [Options(STRUCTURES)],
        "ridge": [Interval(float, 0, math.inf, closed="left")],
        "massive_rows": [Options(MASSIVE)],
        "loss": [Options(LOSSES)],
        "solver": [Options(SOLVERS)],
        "lr": [Interval(float, 0, math.inf, closed="neither")],
        "rows_per_step": [Interval(int, 1, None)],
        "epochs": [Interval(int, 0, None)],
        "lbfgs_steps": [Interval(int, 1, None)],
        "tol": [Interval(float, 0, math.inf, closed="left")],
        "penalty": [Options(PENALTIES), None],
        "penalty_weight": [Interval(float, 0, math.inf, closed="left")],
        "init": [Options(INITS)],
        "placement": [Options(PLACEMENTS)],
        "fit": [Options(FITS)],
        "check_fraction": [Interval(float, 0, 0.5, closed="both")],
        "fallback": [bool],
        "candidates": [Interval(int, 1, None)],
        "predicted_candidates": [Interval(int, 0, None)],
        "cuts_at_once": [Interval(int, 1, None), None],
        "include_padding": [bool],
        "max_buffer_bytes": [Interval(int, 1, None)],
        "buffer_dtype": [Predicate(_is_dtype, "a floating-point NumPy dtype")],
        "buffer_dir": [str, os.PathLike, None],
        "backend": [Options(BACKENDS)],
        "precision": [Options(PRECISIONS)],
        "check": [bool],
        "calibration": [Calibration],
    }

    def __post_init__(self) -> None:
        validate_fields(self, self._parameter_constraints)
        if self.spans is None and self.num_blocks is None:
            raise ValueError("give num_blocks=<blocks to remove> (or spans=[(start, stop), ...])")
        if self.objective == "cosine" and self.structure in LS_STRUCTURES:
            raise ValueError(
                f"structure={self.structure!r} is a least-squares variant; use objective='ls'"
            )
        if self.selection in ("block_influence", "sleb") and self.num_cuts != 1:
            raise ValueError(
                f"selection={self.selection!r} chooses blocks one by one and makes each run of "
                "consecutive ones a cut: leave num_cuts=1"
            )
        if self.spans is None and self.num_blocks is not None and self.num_blocks % self.num_cuts:
            raise ValueError(
                f"num_blocks={self.num_blocks} is not a multiple of num_cuts={self.num_cuts}: "
                "every cut removes num_blocks / num_cuts blocks"
            )

    @property
    def needs_moments(self) -> bool:
        """Whether the estimation pass accumulates least-squares moments."""
        return self.objective == "ls" or (self.objective == "cosine" and self.init == "ls")

    @property
    def buffer_states(self) -> int:
        """States kept per cosine row: ``(M, L − Y)``, or ``(M, Y, L)`` for
        the exact loss (Eq. 7) of a folded transform."""
        return 3 if (self.placement != "block" and self.loss == "exact") else 2

    @classmethod
    def paper(cls, **options: Any) -> ReplaceMeConfig:
        """The paper's protocol (:data:`PAPER`: every row fitted, the
        distance alone choosing the cut, every calibration batch fitting, and
        for the cosine objective Table 13's Adam from the identity), with
        ``options`` (fields and calibration options) on top."""
        return cls.from_options(None, {**PAPER, **options})

    @classmethod
    def from_options(
        cls, config: ReplaceMeConfig | None = None, options: Mapping[str, Any] | None = None
    ) -> ReplaceMeConfig:
        """``config`` (or the defaults) with ``options`` overriding its
        fields; calibration options (``max_samples``, ``seed``, ``progress``,
        see :class:`toast.Calibration`) go into its ``calibration``."""
        calibration_options, own = Calibration.split(options or {})
        check("config", config, cls, None)
        if config is not None and not own and not calibration_options:
            return config
        base = (
            {}
            if config is None
            else {f.name: getattr(config, f.name) for f in dataclasses.fields(cls)}
        )
        merged = {**base, **own}
        merged["calibration"] = Calibration.from_options(
            merged.get("calibration"), **calibration_options
        )
        return cls(**merged)


def distance_candidates_only(config: ReplaceMeConfig) -> ReplaceMeConfig:
    """``config`` without the predicted-error candidates (a moments pass the
    block-by-block path does not make): what a checkpoint folder runs with,
    in memory or from disk alike, so both paths cut the same blocks."""
    if config.predicted_candidates == 0:
        return config
    return dataclasses.replace(config, predicted_candidates=0)
