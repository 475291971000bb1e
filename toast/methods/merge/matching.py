"""Token merging's arithmetic (ToMe, Bolya et al., ICLR 2023, §3), on tensors.

- **Bipartite soft matching** (§3, "Bipartite soft matching"): the tokens
  go alternately into a set A (even positions) and a set B (odd
  positions); every A token is matched to its most similar B token by the
  cosine similarity of the metric (the block's attention keys averaged
  over heads); the ``r`` A tokens with the most similar matches are merged
  into their matches. Protected tokens (the prefix: CLS, DeiT's
  distillation token, DINOv2's registers) are neither sources (their A
  rows score −∞) nor destinations (their B columns score −∞).
- **Size-weighted merging**: a token's size ``s`` counts the input patches
  it stands for (1 at the start); a merge replaces a group by
  ``Σ s·x / Σ s`` with size ``Σ s``.
- **Proportional attention**: ``softmax(q·kᵀ·scale + log s)`` over the keys,
  so a merged key weighs as the tokens it stands for.

The kept tokens keep their positional order (stable), so the protected
prefix stays first and token 0 stays the CLS token. ``r`` is capped so that
the protected tokens and at least one token of each set remain:
``min(r, (N − prefix) // 2, free A tokens)``, 0 when B has no free token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toast.methods.merge.macs import effective_r

__all__ = ["Matching", "bipartite_soft_matching", "effective_r", "merge_tokens"]


@dataclass(frozen=True)
class Matching:
    """One merge of a ``(B, N)`` sequence: ``target[b, i]``, the current
    position token ``i`` merges into (itself when kept); ``kept[b]``, the
    kept positions in order (``(B, N − r)``); ``new_index[b, i]``, the
    position in the merged sequence that token ``i`` ends up in."""

    target: torch.Tensor
    kept: torch.Tensor
    new_index: torch.Tensor

    @property
    def r(self) -> int:
        return self.target.shape[1] - self.kept.shape[1]


def bipartite_soft_matching(metric: torch.Tensor, r: int, prefix: int) -> Matching | None:
    """The merge of ``r`` tokens by ``metric`` (``(B, N, C)``, e.g. the keys
    averaged over heads) with the first ``prefix`` tokens protected; None
    when the capped ``r`` is 0 (nothing merges)."""
    b, n, _ = metric.shape
    r = effective_r(r, n, prefix)
    if r == 0:
        return None
    device = metric.device
    with torch.no_grad():
        unit = metric / metric.norm(dim=-1, keepdim=True)
        a_pos = torch.arange(0, n, 2, device=device)
        b_pos = torch.arange(1, n, 2, device=device)
        scores = unit[:, a_pos] @ unit[:, b_pos].transpose(-1, -2)  # (B, |A|, |B|)
        scores[:, a_pos < prefix, :] = -torch.inf
        scores[:, :, b_pos < prefix] = -torch.inf
        best, match = scores.max(dim=-1)  # each A token's most similar B token
        order = torch.sort(best, dim=-1, descending=True, stable=True).indices
        src = a_pos[order[:, :r]]  # (B, r) positions merged away
        dst = b_pos[match.gather(1, order[:, :r])]  # their destinations
        target = torch.arange(n, device=device).expand(b, n).clone()
        target.scatter_(1, src, dst)
        merged = torch.zeros(b, n, dtype=torch.int8, device=device)
        merged.scatter_(1, src, 1)
        # a stable sort of "merged away" puts the kept positions first, in order
        kept = torch.sort(merged, dim=-1, stable=True).indices[:, : n - r]
        slot = torch.zeros(b, n, dtype=torch.long, device=device)
        slot.scatter_(1, kept, torch.arange(n - r, device=device).expand(b, n - r))
        new_index = slot.gather(1, target)
    return Matching(target, kept, new_index)


def merge_tokens(
    x: torch.Tensor, sizes: torch.Tensor, matching: Matching
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (``(B, N, D)``) and its ``sizes`` (``(B, N, 1)``) merged by
    ``matching``: every group's size-weighted mean and summed size, in the
    kept order."""
    b, n, d = x.shape
    total = torch.zeros(b, n, d, dtype=x.dtype, device=x.device)
    total.scatter_add_(1, matching.target.unsqueeze(-1).expand(b, n, d), x * sizes)
    size = torch.zeros(b, n, 1, dtype=sizes.dtype, device=sizes.device)
    size.scatter_add_(1, matching.target.unsqueeze(-1), sizes)
    kept = matching.kept.unsqueeze(-1)
    new_sizes = size.gather(1, kept)
    return total.gather(1, kept.expand(-1, -1, d)) / new_sizes, new_sizes
