"""ATM, Adaptive Token Merging (Lee & Choi, "Lossless Token Merging Even
Without Fine-Tuning in Vision Transformers", arXiv 2505.15160), as a token
reducer (:class:`AtmReducer`).

What the paper gives (as far as the sources reached):

- **Threshold-based merging** instead of ToMe's fixed top-``r``: in block
  ``l`` a source token merges only when its best match's cosine similarity
  exceeds that block's threshold ``θ_l``, so the number merged depends on
  the image (fewer merges on complex images, more on simple ones).
- **Per-layer thresholds on an exponential schedule**
  (:func:`atm_thresholds`): ``θ_l = max(α − (exp(β·(l − 1)) − 1), θ_min)``
  for ``l = 1..L``: strict in early blocks, where merging loses the most
  information, looser in late ones, floored at ``θ_min``.
- **Size-distinctive matching in the final blocks** (from a "splitting
  layer depth" on): the tokens are grouped by merging size and matched only
  across the groups, so two large tokens (whose merge costs the most, by
  the paper's error bound ``∝ n_i·n_j / (n_i + n_j) · cosine distance``)
  never merge together.
- ToMe's size-weighted merging and proportional attention (the installed
  forward does both, as for every reducer).

Toast's reading where the sources are silent:

- **Metric**: the block's attention keys averaged over heads (ToMe's), by
  cosine similarity.
- **Standard blocks** split the tokens exactly as
  :func:`~toast.methods.merge.matching.bipartite_soft_matching` does (even
  positions are sources A, odd ones destinations B, the protected prefix's
  rows and columns scored −∞).
- **Size-distinctive blocks** (``split_from``, 0-based, on): the
  unprotected tokens sorted stably by size (ties by position); the smaller
  half (``⌊N'/2⌋``) are the sources A, the rest the destinations B.
- **Batches** (the paper names a "batch-adaptive" rule but the sources do
  not give it): every image counts its sources above the threshold (capped
  as ToMe caps ``r``), and the whole batch merges the smallest of those
  counts, each image its best-scoring sources (a stable descending sort).
  Tensors stay rectangular and no pair at or below the threshold ever
  merges; an image with more pairs above it merges fewer than it would
  alone. With one image per batch this is exactly per-image ATM.

The kept tokens keep their positional order, so the protected prefix stays
first, as with ToMe.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from toast.methods.merge.macs import effective_r
from toast.methods.merge.matching import Matching, bipartite_scores, matching_from_pairs
from toast.methods.merge.reducers import TokenView, is_real, register_reducer

__all__ = ["AtmReducer", "atm_thresholds", "default_split_from", "threshold_matching"]


def atm_thresholds(
    num_blocks: int, alpha: float, beta: float, theta_min: float
) -> tuple[float, ...]:
    """The paper's threshold schedule for ``num_blocks`` blocks:
    ``θ_l = max(α − (exp(β·(l − 1)) − 1), θ_min)`` for ``l = 1..L``
    (``θ_1 = α``; ``β >= 0`` is how fast it falls with depth)."""
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
        raise ValueError(f"num_blocks must be an int >= 1; got {num_blocks!r}")
    for field, value in (("alpha", alpha), ("beta", beta), ("theta_min", theta_min)):
        if not is_real(value):
            raise ValueError(f"{field} must be a finite real number; got {value!r}")
    if beta < 0:
        raise ValueError(f"beta is a decay rate and must be >= 0; got {beta!r}")
    return tuple(
        max(alpha - (math.exp(beta * (layer - 1)) - 1.0), theta_min)
        for layer in range(1, num_blocks + 1)
    )


def default_split_from(num_blocks: int) -> int | None:
    """toast's default first size-distinctive block: the last third of the
    blocks (None for a single block; the paper's value could not be read)."""
    split = num_blocks - num_blocks // 3
    return split if split < num_blocks else None


@dataclass(frozen=True)
class AtmReducer:
    """ATM's threshold merging (see the module docstring): in block ``i``
    the sources whose best match's cosine similarity is above
    ``thresholds[i]`` merge (a threshold above 1 turns a block off);
    blocks from ``split_from`` (0-based; None: none) on match by size
    (smaller half into larger half) instead of by position."""

    thresholds: tuple[float, ...]
    split_from: int | None = None

    name: ClassVar[str] = "atm"
    needs_attention: ClassVar[bool] = False

    def __post_init__(self) -> None:
        values = self.thresholds
        if not isinstance(values, (tuple, list)) or not values:
            raise ValueError(
                f"thresholds must be a non-empty tuple, one threshold per block; got {values!r}"
            )
        bad = [v for v in values if not is_real(v)]
        if bad:
            raise ValueError(
                "thresholds must be finite real numbers (one above 1 turns its block off); "
                f"got {bad[0]!r}"
            )
        object.__setattr__(self, "thresholds", tuple(float(v) for v in values))
        split = self.split_from
        if split is not None and (
            not isinstance(split, int) or isinstance(split, bool) or not 0 <= split < len(values)
        ):
            raise ValueError(
                f"split_from must be a block index in [0, {len(values)}) or None (never); "
                f"got {split!r}"
            )

    @property
    def num_blocks(self) -> int:
        return len(self.thresholds)

    def reduce(self, position: int, view: TokenView) -> Matching | None:
        size_distinctive = self.split_from is not None and position >= self.split_from
        return threshold_matching(
            view.metric,
            self.thresholds[position],
            view.prefix,
            view.size_column() if size_distinctive else None,
        )

    def state(self) -> dict[str, Any]:
        return {"thresholds": list(self.thresholds), "split_from": self.split_from}

    def tokens(self, tokens: int, prefix: int) -> None:
        """None: how many tokens merge depends on the images."""
        return None


def _size_scores(
    metric: torch.Tensor, sizes: torch.Tensor, prefix: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Size-distinctive sets: the unprotected tokens sorted by size (a
    stable sort, so ties go by position), the smaller half the sources
    (``(B, |A|)``) and the rest the destinations (``(B, |B|)``), with their
    cosine similarities ``(B, |A|, |B|)``."""
    order = torch.sort(sizes[:, prefix:], dim=-1, stable=True).indices + prefix
    half = order.shape[1] // 2
    a_pos, b_pos = order[:, :half], order[:, half:]
    unit = metric / metric.norm(dim=-1, keepdim=True)
    rows = unit.gather(1, a_pos.unsqueeze(-1).expand(-1, -1, unit.shape[-1]))
    cols = unit.gather(1, b_pos.unsqueeze(-1).expand(-1, -1, unit.shape[-1]))
    return a_pos, b_pos, rows @ cols.transpose(-1, -2)


def threshold_matching(
    metric: torch.Tensor, threshold: float, prefix: int, sizes: torch.Tensor | None = None
) -> Matching | None:
    """ATM's merge for one block (see the module docstring): ``metric``
    ``(B, N, C)``; ``sizes`` ``(B, N)`` for size-distinctive matching, None
    for ToMe's alternating sets. None when no image has a source above
    ``threshold`` (the batch merges the smallest count)."""
    b, n, _ = metric.shape
    if sizes is None:
        cap = effective_r(n, n, prefix)
    else:
        cap = (n - prefix) // 2 if n > prefix else 0
    if cap == 0:
        return None
    with torch.no_grad():
        if sizes is None:
            a_pos, b_pos, scores = bipartite_scores(metric, prefix)
            a_pos, b_pos = a_pos.expand(b, -1), b_pos.expand(b, -1)
        else:
            a_pos, b_pos, scores = _size_scores(metric, sizes, prefix)
        best, match = scores.max(dim=-1)  # each source's most similar destination
        counts = (best > threshold).sum(dim=-1).clamp(max=cap)
        r = int(counts.min())
        if r == 0:
            return None
        order = torch.sort(best, dim=-1, descending=True, stable=True).indices[:, :r]
        src = a_pos.gather(1, order)  # (B, r) positions merged away
        dst = b_pos.gather(1, match.gather(1, order))  # their destinations
        return matching_from_pairs(src, dst, n)


def _atm_from_state(state: Mapping[str, Any]) -> AtmReducer:
    thresholds, split_from = state.get("thresholds"), state.get("split_from")
    if not (isinstance(thresholds, list) and thresholds and all(is_real(v) for v in thresholds)):
        raise ValueError(
            "the atm state's 'thresholds' must be a non-empty list of finite numbers; "
            f"got {thresholds!r}"
        )
    if "split_from" not in state:
        raise ValueError("the atm state must give 'split_from' (a block index, or null)")
    if split_from is not None and (not isinstance(split_from, int) or isinstance(split_from, bool)):
        raise ValueError(f"the atm state's 'split_from' must be an int or null; got {split_from!r}")
    return AtmReducer(tuple(float(v) for v in thresholds), split_from)


register_reducer("atm", _atm_from_state)
