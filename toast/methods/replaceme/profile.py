"""ReplaceMe's cut selection: the distance between every pair of states and
the window(s) of blocks that move the rows least.

Shopkhoev et al., "ReplaceMe" (arXiv 2505.02819), §3.1 and Eq. 4: the cut
``i*`` of ``n`` blocks minimises the distance between the hidden states
before and after it, averaged over calibration rows; the reference code
measures the angular distance ``acos(cos)/π`` on the last non-pad token of
each sequence, the paper's text says ``1 − cos``, and Fig. 5 ablates the L2
distance. Several cuts (the paper's multi-LT, §4.3) take non-overlapping
windows greedily.

Index conventions: state ``s`` is the output of block ``s − 1`` (state 0
the embedding output), before the final norm; a cut ``blocks[s:s+n]``
removes blocks ``s … s+n−1`` and is written ``s−1 → s+n−1`` in the paper.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from toast._validation import Interval, Options, check
from toast.hf.capture.distributed import Ranks, all_reduce_sums, ranks_of
from toast.hf.capture.states import TOKENS, Tokens, select_tokens, stream_states
from toast.hf.data.calibration import Calibration
from toast.hf.model.blocks import BlockStack
from toast.methods.replaceme.config import ADJACENT, DISTANCES
from toast.methods.replaceme.hooks import no_kv_cache
from toast.spans import Span

__all__ = [
    "DistanceProfile",
    "ProfileRows",
    "check_selection",
    "profile_distances",
    "select_windows",
]

# Bytes of float64 row-pair scratch per chunk of the distance pass.
_PROFILE_CHUNK_BYTES = 64 * 2**20


def check_selection(num_blocks: Any, num_cuts: Any, min_start: Any, total: int) -> int:
    """Checks a request for ``num_cuts`` windows removing ``num_blocks`` of
    ``total`` blocks, none starting before ``min_start``; returns the window
    (``num_blocks / num_cuts`` blocks). At least one block stays before the
    first cut: its down-projection receives the transform."""
    num_blocks = check("num_blocks", num_blocks, Interval(int, 1, total - 1))
    num_cuts = check("num_cuts", num_cuts, Interval(int, 1, None))
    if num_blocks % num_cuts:
        raise ValueError(
            f"num_blocks={num_blocks} is not a multiple of num_cuts={num_cuts}: every cut "
            "removes num_blocks / num_cuts blocks"
        )
    window = num_blocks // num_cuts
    check("min_start", min_start, Interval(int, 1, total - window))
    return window


@dataclass
class DistanceProfile:
    """Mean distances between every pair of states of a model.

    ``distances[metric][i, j]`` (``i < j``) is the mean over calibration rows
    of the distance between state ``i`` and state ``j``, i.e. how much the
    blocks ``range(i, j)`` move a row; NaN on and below the diagonal.
    ``tokens`` says which rows were used (``"last"``: the last non-pad token
    of each sequence, the reference code's choice); ``rows`` how many;
    ``token_rows`` how many token rows the same data gives with every
    (non-pad) token, the rows a transform is estimated on.
    """

    distances: dict[str, np.ndarray] = field(repr=False)
    tokens: str
    rows: int
    block_path: str
    token_rows: int = 0
    #: windows of smallest predicted least-squares error (``Span.error``
    #: that error), measured beside the distance's when the cut is chosen
    #: by measurement; empty when not asked for
    predicted: list[Span] = field(default_factory=list)

    def matrix(self, metric: str = "angular") -> np.ndarray:
        """The ``(L + 1, L + 1)`` matrix of one metric."""
        return self.distances[check("metric", metric, Options(self.distances))]

    @property
    def num_blocks(self) -> int:
        """``L``, the blocks of the profiled model."""
        return self.distances[DISTANCES[0]].shape[0] - 1

    def windows(self, window: int, metric: str = "angular") -> np.ndarray:
        """Distances of every window of ``window`` blocks: entry ``s`` is the
        distance between states ``s`` and ``s + window`` (removing
        ``blocks[s:s+window]``), for ``s = 0 … L − window``."""
        window = check("window", window, Interval(int, 1, self.num_blocks))
        d = self.matrix(metric)
        return np.array([d[s, s + window] for s in range(self.num_blocks - window + 1)])

    def ranked(
        self, num_blocks: int, count: int, *, metric: str = "angular", min_start: int = 1
    ) -> list[Span]:
        """The ``count`` single cuts of ``num_blocks`` blocks of smallest
        distance (overlapping ones included), smallest first; none starts
        before block ``min_start``."""
        total = self.num_blocks
        check_selection(num_blocks, 1, min_start, total)
        d = self.windows(num_blocks, metric)
        order = sorted(range(min_start, total - num_blocks + 1), key=lambda s: (d[s], s))
        return [Span(s, s + num_blocks, float(d[s])) for s in order[:count]]

    def select(
        self,
        num_blocks: int,
        num_cuts: int = 1,
        *,
        metric: str = "angular",
        min_start: int = 1,
        adjacent: Literal["merge", "forbid"] = "merge",
    ) -> list[Span]:
        """The cut(s) removing ``num_blocks`` blocks, chosen by distance.

        One cut (Eq. 4): the window of ``num_blocks`` blocks of smallest
        distance. Several cuts (the paper's multi-LT): ``num_cuts`` windows
        of ``num_blocks / num_cuts`` blocks each, taken greedily in ascending
        distance among those that do not overlap the ones already taken (the
        reference's ``select_non_overlapping_blocks``). Adjacent windows are
        fused into one cut with one transform (``adjacent="merge"``, the
        reference's ``merge_consecutive``) or not allowed at all
        (``"forbid"``: a kept block between cuts, the paper's Multi_LT_nc).
        No window starts before block ``min_start`` (at least 1: the
        transform goes into the block before the cut). Returns spans sorted
        by position, each with the distance between its end states.
        """
        return select_windows(
            self.matrix(metric), num_blocks, num_cuts, min_start=min_start, adjacent=adjacent
        )

    def to_csv(self, path: str | os.PathLike, window: int, metric: str = "angular") -> None:
        """Writes the reference code's ``layer_distances.csv`` (columns
        ``block_start, block_end, average_distance``; its block tuple equals
        toast's span ``(s, s + window)``)."""
        d = self.windows(window, metric)
        with open(path, "w", encoding="utf-8") as f:
            f.write("block_start,block_end,average_distance\n")
            for s, value in enumerate(d):
                f.write(f"{s},{s + window},{float(value)!r}\n")

    def plot(
        self,
        window: int,
        metric: str = "angular",
        *,
        cuts: Sequence[Span] = (),
        min_start: int = 1,
        ax: Any = None,
    ) -> Any:
        """Distance against window start (a line; starts before ``min_start``
        greyed, chosen cuts marked). Returns the matplotlib figure."""
        if ax is None:
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(7, 3.2))
        else:
            fig = ax.figure
        d = self.windows(window, metric)
        starts = np.arange(len(d))
        ax.plot(starts, d, marker="o", ms=3, lw=1.2, color="C0")
        if min_start > 0:
            ax.axvspan(-0.5, min_start - 0.5, color="0.85", label="not allowed (min_start)")
        for k, span in enumerate(cuts):
            if span.num_blocks == window:
                ax.plot(
                    span.start, d[span.start], "o", color="C3", ms=7, label=None if k else "cut"
                )
        ax.set_xlabel(f"first removed block s (window blocks[s:s+{window}])")
        ax.set_ylabel(f"{metric} distance")
        ax.set_title(
            f"ReplaceMe profile: {metric} distance, {self.tokens} tokens, {self.rows} rows"
        )
        ax.grid(alpha=0.3)
        if min_start > 0 or cuts:
            ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        return fig


def select_windows(
    matrix: np.ndarray,
    num_blocks: int,
    num_cuts: int = 1,
    *,
    min_start: int = 1,
    adjacent: Literal["merge", "forbid"] = "merge",
) -> list[Span]:
    """:meth:`DistanceProfile.select` on any ``(L + 1, L + 1)`` table of
    span scores (``matrix[s, e]`` for removing ``blocks[s:e]``, lower is
    better): a distance, or a predicted error. NaN entries are never
    chosen."""
    total = matrix.shape[0] - 1
    window = check_selection(num_blocks, num_cuts, min_start, total)
    check("adjacent", adjacent, Options(ADJACENT))
    d = np.array([matrix[s, s + window] for s in range(total - window + 1)])
    starts = [s for s in range(min_start, total - window + 1) if np.isfinite(d[s])]
    order = sorted(starts, key=lambda s: (d[s], s))
    chosen: list[int] = []
    gap = 1 if adjacent == "forbid" else 0
    for s in order:
        if len(chosen) == num_cuts:
            break
        if all(s + window + gap <= c or c + window + gap <= s for c in chosen):
            chosen.append(s)
    if len(chosen) < num_cuts:
        raise ValueError(
            f"cannot place {num_cuts} non-overlapping windows of {window} blocks"
            f"{' with a kept block between them' if adjacent == 'forbid' else ''} in "
            f"blocks {min_start}..{total - 1}; ask for fewer cuts or a lower min_start"
        )
    spans: list[tuple[int, int]] = []
    for s in sorted(chosen):
        if spans and spans[-1][1] == s:  # adjacent: "merge" (forbid never gets here)
            spans[-1] = (spans[-1][0], s + window)
        else:
            spans.append((s, s + window))
    return [Span(a, b, float(matrix[a, b])) for a, b in spans]


class _PairDistances:
    """Sums over rows of the distances between every pair of states."""

    def __init__(self, num_states: int) -> None:
        self.num_states = num_states
        self.sums = {m: np.zeros((num_states, num_states)) for m in DISTANCES}
        self.rows = 0

    def add(self, states: list[torch.Tensor], keep: torch.Tensor | None = None) -> None:
        """``states``: ``S`` tensors ``(rows, d)``; ``keep``: the indices of
        the rows to use (default all). Rows are taken a chunk at a time, so
        only one chunk of every state is ever copied."""
        S, d = len(states), int(states[0].shape[-1])
        rows = int(states[0].shape[0]) if keep is None else int(keep.numel())
        step = max(1, _PROFILE_CHUNK_BYTES // max(1, S * d * 8))
        for lo in range(0, rows, step):
            take = slice(lo, lo + step) if keep is None else keep[lo : lo + step]
            z = torch.stack([x[take] for x in states]).to(torch.float64)
            sq = (z * z).sum(-1)  # (S, r)
            gram = torch.einsum("ird,jrd->ijr", z, z)  # (S, S, r)
            norms = sq.sqrt()
            denom = norms[:, None] * norms[None, :]
            cos = torch.where(denom > 0, gram / denom.clamp_min(1e-300), torch.zeros_like(gram))
            cos = cos.clamp(-1.0, 1.0)
            sqdist = (sq[:, None] + sq[None, :] - 2.0 * gram).clamp_min(0.0)
            for name, value in (
                ("angular", torch.arccos(cos) / math.pi),
                ("cosine", 1.0 - cos),
                ("l2", sqdist.sqrt()),
            ):
                self.sums[name] += value.sum(-1).cpu().numpy()
        self.rows += rows

    def means(self) -> dict[str, np.ndarray]:
        upper = np.triu(np.ones((self.num_states, self.num_states), dtype=bool), k=1)
        return {m: np.where(upper, s / self.rows, np.nan) for m, s in self.sums.items()}


class ProfileRows:
    """The consumer of the profile pass: counts every token row (those the
    estimation pass will see) and adds the profile's tokens to the sums."""

    def __init__(self, tokens: str, include_padding: bool) -> None:
        self.tokens = tokens
        self.include_padding = include_padding
        self.token_rows = 0
        self.sums: _PairDistances | None = None

    def count(self, first: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Counts the token rows of one batch (state ``first``)."""
        if mask is None or self.include_padding:
            self.token_rows += int(first.shape[0] * first.shape[1])
        else:
            self.token_rows += int(mask.sum())

    def select(
        self, rows: list[torch.Tensor], mask: torch.Tensor | None
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The profile's rows of each state, flat, and the indices to keep."""
        # "last" is the last non-pad token even when padding is included.
        use_mask = None if (self.include_padding and self.tokens == "all") else mask
        chosen, chosen_mask = select_tokens(rows, use_mask, self.tokens)
        flat = [r.reshape(-1, r.shape[-1]) for r in chosen]
        keep = None if chosen_mask is None else chosen_mask.reshape(-1).nonzero().squeeze(1)
        return flat, keep

    def add(self, flat: list[torch.Tensor], keep: torch.Tensor | None) -> int:
        """Adds one batch's selected rows of every state to the sums."""
        if self.sums is None:
            self.sums = _PairDistances(len(flat))
        self.sums.add(flat, keep)
        return self.sums.rows

    def __call__(self, rows: list[torch.Tensor], mask: torch.Tensor | None) -> int:
        self.count(rows[0], mask)
        return self.add(*self.select(rows, mask))

    def reduce_over(self, ranks: Ranks) -> None:
        """The sums of every rank's rows (collective; after a pass sharded
        over ``ranks``): every rank then holds one process's profile."""
        sums = self.sums
        mine = [0.0, 0.0] if sums is None else [1.0, float(sums.num_states)]
        has, states = all_reduce_sums(mine, ranks)
        if has == 0:
            return
        if sums is None:  # this rank had no batch: zeros of the others' shape
            sums = self.sums = _PairDistances(round(states / has))
        packed = np.concatenate(
            [*(sums.sums[m].ravel() for m in DISTANCES), [sums.rows, self.token_rows]]
        )
        total = all_reduce_sums(packed, ranks)
        size = sums.num_states**2
        for k, m in enumerate(DISTANCES):
            sums.sums[m] = total[k * size : (k + 1) * size].reshape(sums.num_states, -1)
        sums.rows, self.token_rows = int(total[-2]), int(total[-1])

    def profile(self, block_path: str) -> DistanceProfile:
        """The profile of every row added."""
        if self.sums is None or self.sums.rows == 0:
            raise ValueError("the loader yielded no rows (empty loader, or every token masked out)")
        sums = self.sums
        return DistanceProfile(
            sums.means(), self.tokens, sums.rows, block_path, token_rows=self.token_rows
        )


def profile_distances(
    model: nn.Module,
    loader: Iterable,
    *,
    tokens: Tokens = "last",
    include_padding: bool = False,
    calibration: Calibration | None = None,
    stack: BlockStack | None = None,
    **options: Any,
) -> DistanceProfile:
    """One pass over ``loader``: the mean distance between every pair of states.

    States are the embedding output and every block's output, hooked on the
    blocks themselves, so the last state is taken *before* the final norm
    (``output_hidden_states`` of Llama-style models normalises it).
    ``tokens="last"`` (default) uses the last non-pad token of each sequence
    (the ReplaceMe reference code); ``"all"`` every non-pad token
    (``include_padding`` counts pad tokens too); ``"cls"`` and ``"mean"`` as
    in :func:`toast.hf.capture_moments`. Every distance of :data:`DISTANCES` is
    accumulated in float64; the mean is over rows (sequences for
    ``"last"``). ``calibration`` (or its fields as keywords: ``max_samples``,
    ``progress``...) bounds the pass; ``stack`` is the model's block stack
    when the caller has found it already.
    """
    check("tokens", tokens, Options(TOKENS))
    consume = ProfileRows(tokens, include_padding)
    cal = Calibration.from_options(calibration, **options)
    # Capture every token so that the rows of the estimation pass (all
    # tokens) are counted too; ProfileRows picks the profile's tokens.
    with no_kv_cache(model):
        stack = stream_states(
            model, loader, consume, cal, stack=stack, tokens="all", desc="replaceme: distances",
            shard=True,
        )  # fmt: skip
    ranks = ranks_of(cal)
    if ranks is not None:  # each rank saw its share of the batches
        consume.reduce_over(ranks)
    return consume.profile(stack.path)
