"""Every compression a search may pick, with its size and predicted error
known before any is built.

A :class:`Candidate` is one recipe: plain removal of planned spans, TOAST
translators over planned spans, a ReplaceMe cut with its least-squares
transform, ToaSt head pruning, or (ViTs) removal combined with head
pruning. Sizes are exact parameter counts from the model's own modules.
Predictions come from the one calibration pass (:class:`Predictions`):

- span families: the span's relative error ``‖Y − f(X)‖ / ‖Y‖`` under the
  family's map (identity for plain removal, the least-squares linear or
  affine map for translators, the linear map for a ReplaceMe cut), summed
  over spans;
- ToaSt: a weight-only proxy, ``ρ`` times the share of blocks pruned (the
  block moments say nothing about heads), so it ranks ToaSt candidates
  among themselves only; combinations add both.

A search measures the best-predicted candidates of each family in turn,
so the scales of different families never compete.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from toast.accounting import translator_params
from toast.methods.toast_vit.schedules import head_keep
from toast.spans import plan_spans

__all__ = [
    "HEAD_SPARSITIES",
    "TCS_SCHEDULES",
    "Candidate",
    "Predictions",
    "Sizes",
    "best_windows",
    "enumerate_candidates",
    "tcs_schedule",
]

#: The head sparsities ρ a search tries (ToaSt's schedules use 0.5–0.9).
HEAD_SPARSITIES = (0.25, 0.5, 0.75, 0.9)
#: Token Channel Selection schedules a search tries on ViTs, for MAC and
#: latency targets (TCS removes no parameter): ToaSt's named schedules
#: prune the FFN channels of the last blocks hardest; these do so on the
#: last third of the blocks of any depth: ``{name: (FC1 ratio of the last
#: block, FC2 ratio of the last third)}``.
TCS_SCHEDULES: dict[str, tuple[float, float]] = {"late-0.5": (0.0, 0.5), "late-0.9": (0.3, 0.9)}
#: Alternatives per family and size beside the exact plan: single spans or
#: ReplaceMe windows, best predicted first.
ALTERNATIVES = 2


@dataclass(frozen=True)
class Candidate:
    """One compression recipe.

    ``family``: ``"plain"``, ``"toast"``, ``"replaceme"``, ``"toast-vit"``
    or ``"plain+toast-vit"`` / ``"toast+toast-vit"``; ``spans``: the
    ``(start, stop)`` block spans removed (original indices);
    ``translator``: what replaces each span (``"identity"``, ``"linear"``,
    ``"affine"``, ``"ls"`` for ReplaceMe's folded transform);
    ``head_sparsity``: ToaSt's ρ (None without head pruning);
    ``schedule``: a Token Channel Selection schedule of
    :data:`TCS_SCHEDULES` (None: no TCS); ``params``: the parameter count
    after; ``predicted``: the predicted error.
    """

    family: str
    spans: tuple[tuple[int, int], ...]
    translator: str | None
    head_sparsity: float | None
    params: int
    predicted: float
    schedule: str | None = None

    @property
    def key(self) -> str:
        """A stable identifier (the cache's key for its measurement)."""
        spans = ",".join(f"{a}-{b}" for a, b in self.spans)
        rho = "" if self.head_sparsity is None else f"{self.head_sparsity:g}"
        return f"{self.family}|{self.translator or ''}|{spans}|{rho}|{self.schedule or ''}"

    @property
    def blocks_removed(self) -> int:
        return sum(b - a for a, b in self.spans)

    @property
    def label(self) -> str:
        """A short name: the family and what it does."""
        parts = []
        if self.spans:
            spans = " ".join(f"[{a}:{b}]" for a, b in self.spans)
            parts.append(f"{_VERB.get(self.translator or '', self.translator)} blocks{spans}")
        if self.head_sparsity is not None:
            parts.append(f"heads ρ={self.head_sparsity:g}")
        if self.schedule is not None:
            parts.append(f"TCS {self.schedule}")
        return f"{self.family}: " + ", ".join(parts)

    def to_dict(self) -> dict:
        return {
            "key": self.key,
            "family": self.family,
            "label": self.label,
            "spans": [list(s) for s in self.spans],
            "translator": self.translator,
            "head_sparsity": self.head_sparsity,
            "schedule": self.schedule,
            "params": self.params,
            "predicted": self.predicted,
        }


_VERB = {"identity": "remove", "linear": "linear", "affine": "affine", "ls": "LS fold"}


@dataclass(frozen=True)
class Sizes:
    """What sizes are made of, read once from the model: parameters of the
    whole model and of each block, the hidden width, and for ViTs the
    parameters one head dimension costs in each block and each block's
    head dimension (empty for other models), and whether Token Channel
    Selection applies."""

    params: int
    block_params: tuple[int, ...]
    width: int
    head_dim_params: tuple[int, ...] = ()
    head_dims: tuple[tuple[int, int], ...] = ()  # (heads, head_dim) per block
    skip_heads: tuple[int, ...] = (0,)
    tcs: bool = False  # whether the MLPs take Token Channel Selection (fc1-GELU-fc2)

    @property
    def num_blocks(self) -> int:
        return len(self.block_params)

    @property
    def is_vit(self) -> bool:
        return bool(self.head_dim_params)

    def after_spans(self, spans: Sequence[tuple[int, int]], translator: str) -> int:
        removed = sum(sum(self.block_params[a:b]) for a, b in spans)
        added = 0 if translator in ("identity", "ls") else translator_params(translator, self.width)
        return self.params - removed + len(spans) * added

    def can_prune(self, rho: float) -> bool:
        """Whether ``rho`` leaves every pruned head at least one dimension."""
        try:
            for _, head_dim in self.head_dims:
                head_keep(head_dim, rho)
        except ValueError:
            return False
        return True

    def head_params_removed(self, rho: float, spans: Sequence[tuple[int, int]] = ()) -> int:
        """Parameters ToaSt's ρ removes from the blocks no span removes."""
        gone = {k for a, b in spans for k in range(a, b)}
        total = 0
        for k, per_dim in enumerate(self.head_dim_params):
            if k in gone or k in self.skip_heads:
                continue
            heads, head_dim = self.head_dims[k]
            total += heads * (head_dim - head_keep(head_dim, rho)) * per_dim
        return total


@dataclass(frozen=True)
class Predictions:
    """Relative span errors from the calibration pass: ``errors[kind][i, j]``
    for ``kind`` in ``identity``, ``linear``, ``affine`` (NaN where a span
    cannot be replaced)."""

    errors: dict[str, np.ndarray] = field(repr=False)

    def span_error(self, kind: str, spans: Sequence[tuple[int, int]]) -> float:
        table = self.errors["linear" if kind == "ls" else kind]
        return float(sum(table[a, b] for a, b in spans))


def _plans(predictions: Predictions, kind: str, n: int) -> Iterator[tuple[tuple[int, int], ...]]:
    """The exact plan of ``n`` blocks, then the best single spans of ``n``."""
    table = predictions.errors[kind]
    plan = plan_spans(table, max_blocks=n)
    if sum(s.num_blocks for s in plan) == n:
        yield tuple((s.start, s.stop) for s in plan)
    for span in best_windows(table, n):
        yield (span,)


def _span_candidates(sizes: Sizes, predictions: Predictions, n: int) -> Iterator[Candidate]:
    for family, kind in (("plain", "identity"), ("toast", "linear"), ("toast", "affine")):
        for spans in dict.fromkeys(_plans(predictions, kind, n)):
            yield Candidate(
                family,
                spans,
                kind,
                None,
                sizes.after_spans(spans, kind),
                predictions.span_error(kind, spans),
            )
    for window in best_windows(predictions.errors["linear"], n):
        spans = (window,)
        yield Candidate(
            "replaceme",
            spans,
            "ls",
            None,
            sizes.after_spans(spans, "ls"),
            predictions.span_error("ls", spans),
        )


def best_windows(table: np.ndarray, n: int) -> list[tuple[int, int]]:
    """The :data:`ALTERNATIVES` single spans of ``n`` blocks with the lowest
    error in ``table``, none starting at block 0 (the papers keep it, and a
    ReplaceMe cut folds into the block before it)."""
    windows = [(a, a + n) for a in range(1, table.shape[0] - n) if np.isfinite(table[a, a + n])]
    windows.sort(key=lambda s: table[s])
    return windows[:ALTERNATIVES]


def tcs_schedule(name: str, num_blocks: int) -> dict[str, dict[int, float]]:
    """The TCS schedule ``name`` of :data:`TCS_SCHEDULES` for ``num_blocks``
    blocks, as :func:`toast.enable_tcs` takes it (0-based blocks)."""
    fc1, fc2 = TCS_SCHEDULES[name]
    last_third = range(num_blocks - max(1, math.ceil(num_blocks / 3)), num_blocks)
    schedule: dict[str, dict[int, float]] = {"fc2": {b: fc2 for b in last_third}}
    if fc1:
        schedule["fc1"] = {num_blocks - 1: fc1}
    return schedule


def _tcs_proxy(sizes: Sizes, name: str) -> float:
    # a weight-free proxy as for heads: the FFN channels dropped, per block
    schedule = tcs_schedule(name, sizes.num_blocks)
    dropped = sum(schedule["fc2"].values()) + sum(schedule.get("fc1", {}).values())
    return dropped / sizes.num_blocks


def _head_proxy(sizes: Sizes, rho: float, spans: Sequence[tuple[int, int]]) -> float:
    pruned = sizes.num_blocks - len(sizes.skip_heads) - sum(b - a for a, b in spans)
    return rho * max(pruned, 0) / sizes.num_blocks


def _vit_candidates(
    sizes: Sizes, predictions: Predictions, max_blocks: int, tcs: bool
) -> Iterator[Candidate]:
    sparsities = [rho for rho in HEAD_SPARSITIES if sizes.can_prune(rho)]
    schedules = [None, *TCS_SCHEDULES] if tcs and sizes.tcs else [None]
    for rho in [None, *sparsities]:
        params = sizes.params - (0 if rho is None else sizes.head_params_removed(rho))
        heads = 0.0 if rho is None else _head_proxy(sizes, rho, ())
        for name in schedules:
            if rho is None and name is None:
                continue  # the original model
            predicted = heads + (0.0 if name is None else _tcs_proxy(sizes, name))
            yield Candidate("toast-vit", (), None, rho, params, predicted, name)
    for n in range(1, max_blocks + 1):
        for family, kind in (("plain", "identity"), ("toast", "affine")):
            plan = next(_plans(predictions, kind, n), None)
            if plan is None:
                continue
            for rho in sparsities:
                params = sizes.after_spans(plan, kind) - sizes.head_params_removed(rho, plan)
                predicted = predictions.span_error(kind, plan) + _head_proxy(sizes, rho, plan)
                yield Candidate(f"{family}+toast-vit", plan, kind, rho, params, predicted)


def enumerate_candidates(
    sizes: Sizes,
    predictions: Predictions,
    max_blocks: int,
    replaceme: bool = True,
    tcs: bool = False,
) -> list[Candidate]:
    """Every candidate removing at most ``max_blocks`` blocks (ReplaceMe's
    only when ``replaceme``; ViTs: Token Channel Selection only with
    ``tcs``), deduplicated, in no particular order."""
    found: dict[str, Candidate] = {}
    for n in range(1, max_blocks + 1):
        for candidate in _span_candidates(sizes, predictions, n):
            if candidate.family != "replaceme" or replaceme:
                found.setdefault(candidate.key, candidate)
    if sizes.is_vit:
        for candidate in _vit_candidates(sizes, predictions, max_blocks, tcs):
            found.setdefault(candidate.key, candidate)
    return [c for c in found.values() if math.isfinite(c.predicted)]
