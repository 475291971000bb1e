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
- **A merged token's norm** (:data:`MERGE_NORMS`): the size-weighted mean
  is shorter than the tokens it merges whenever their directions differ,
  a shift of the norms the next blocks never saw. ``"max"`` is MLERP (Token
  Fusion, Kim et al., WACV 2024): the mean's direction at the largest
  norm among the merged tokens; ``"mean"`` (toast's variant) at their
  size-weighted mean norm. Pruned tokens (weight 0) take no part in either.

The kept tokens keep their positional order (stable), so the protected
prefix stays first and token 0 stays the CLS token. ``r`` is capped so that
the protected tokens and at least one token of each set remain:
``min(r, (N − prefix) // 2, free A tokens)``, 0 when B has no free token.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from toast.methods.merge.config import MERGE_NORMS
from toast.methods.merge.macs import effective_r

__all__ = [
    "MERGE_NORMS",
    "Matching",
    "bipartite_scores",
    "bipartite_soft_matching",
    "carry_source",
    "effective_r",
    "leaving_positions",
    "matching_from_pairs",
    "merge_tokens",
    "unmerge",
]


@dataclass(frozen=True)
class Matching:
    """One reduction of a ``(B, N)`` sequence to ``(B, N')``, the form every
    token reducer returns.

    ``target[b, i]``: the current position token ``i`` goes into (itself
    when kept); ``kept[b]``: the kept positions in order (``(B, N')``);
    ``new_index[b, i]``: the position in the reduced sequence token ``i``
    ends up in (its state when the output is unmerged).

    ``weight`` (``(B, N)``, None: all 1): the share of a token's size that
    goes into its target; 0 prunes it (it adds nothing to its target, and
    an unmerged output gives it its target's state). ``shares``
    (``(B, N', r)``, None: none): a many-to-many reduction instead (Token
    Transforming): column ``k`` says how the ``k``-th token that leaves (in
    positional order) shares its size among the outputs (each column sums
    to 1); a kept token goes whole into its own output. Every output is the
    size-weighted mean of what it received, and an unmerged token is the
    mix of the outputs in its column's proportions. :attr:`spread` is the
    same as a dense ``(B, N', N)`` matrix, built on demand. With ``shares``
    set, ``target`` / ``new_index`` name each token's largest share."""

    target: torch.Tensor
    kept: torch.Tensor
    new_index: torch.Tensor
    weight: torch.Tensor | None = None
    shares: torch.Tensor | None = None

    @property
    def r(self) -> int:
        return self.target.shape[1] - self.kept.shape[1]

    @cached_property
    def leaving(self) -> torch.Tensor:
        """The positions (``(B, r)``, ascending) of the tokens reduced away:
        one sort, shared by the merge, the source map and :attr:`spread`."""
        return leaving_positions(self.kept, self.target.shape[1])

    @property
    def spread(self) -> torch.Tensor | None:
        """The many-to-many reduction as a dense ``(B, N', N)`` matrix
        (column ``i``: token ``i``'s shares; a kept token's is one-hot), or
        None for a one-to-one or many-to-one reduction."""
        if self.shares is None:
            return None
        b, n = self.target.shape
        dense = self.shares.new_zeros(b, self.kept.shape[1], n)
        dense.scatter_(2, self.kept.unsqueeze(-1), 1.0)
        leaving = self.leaving.unsqueeze(1).expand(-1, self.kept.shape[1], -1)
        return dense.scatter_(2, leaving, self.shares)

    def token_map(self) -> torch.Tensor:
        """What :func:`toast.hf.model.vit.merged_row` carries a row of the
        attention by: ``new_index`` for a merge, else the ``(B, N', N)``
        shares (a pruned token's are 0)."""
        spread = self.spread
        if spread is not None:
            return spread
        if self.weight is None:
            return self.new_index
        b, n = self.new_index.shape
        shape = (b, self.kept.shape[1], n)
        shares = torch.zeros(shape, dtype=self.weight.dtype, device=self.weight.device)
        return shares.scatter_(1, self.new_index.unsqueeze(1), self.weight.unsqueeze(1))


def bipartite_soft_matching(metric: torch.Tensor, r: int, prefix: int) -> Matching | None:
    """The merge of ``r`` tokens by ``metric`` (``(B, N, C)``, e.g. the keys
    averaged over heads) with the first ``prefix`` tokens protected; None
    when the capped ``r`` is 0 (nothing merges)."""
    b, n, _ = metric.shape
    r = effective_r(r, n, prefix)
    if r == 0:
        return None
    with torch.no_grad():
        a_pos, b_pos, scores = bipartite_scores(metric, prefix)
        best, match = scores.max(dim=-1)  # each A token's most similar B token
        order = torch.sort(best, dim=-1, descending=True, stable=True).indices
        src = a_pos[order[:, :r]]  # (B, r) positions merged away
        dst = b_pos[match.gather(1, order[:, :r])]  # their destinations
        return matching_from_pairs(src, dst, n)


def bipartite_scores(
    metric: torch.Tensor, prefix: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ToMe's split of ``metric`` (``(B, N, C)``): the source (even) and
    destination (odd) positions and their cosine similarities
    ``(B, |A|, |B|)``, −∞ where either is in the protected prefix."""
    n = metric.shape[1]
    unit = metric / metric.norm(dim=-1, keepdim=True)
    a_pos = torch.arange(0, n, 2, device=metric.device)
    b_pos = torch.arange(1, n, 2, device=metric.device)
    scores = unit[:, a_pos] @ unit[:, b_pos].transpose(-1, -2)
    scores[:, a_pos < prefix, :] = -torch.inf
    scores[:, :, b_pos < prefix] = -torch.inf
    return a_pos, b_pos, scores


def matching_from_pairs(
    src: torch.Tensor, dst: torch.Tensor, n: int, prune_dtype: torch.dtype | None = None
) -> Matching:
    """The reduction of ``n`` tokens sending positions ``src`` into ``dst``
    (both ``(B, r)``), the kept positions in order; ``prune_dtype`` set:
    the sources are pruned (weight 0, of that dtype; an unmerged output
    gives them their destination's state) instead of merged."""
    batch, r = src.shape
    device = src.device
    target = torch.arange(n, device=device).expand(batch, n).clone()
    target.scatter_(1, src, dst)
    removed = torch.zeros(batch, n, dtype=torch.int8, device=device)
    removed.scatter_(1, src, 1)
    # a stable sort of "removed" puts the kept positions first, in order
    kept = torch.sort(removed, dim=-1, stable=True).indices[:, : n - r]
    slot = torch.zeros(batch, n, dtype=torch.long, device=device)
    slot.scatter_(1, kept, torch.arange(n - r, device=device).expand(batch, n - r))
    weight = None
    if prune_dtype is not None:
        weight = torch.ones(batch, n, dtype=prune_dtype, device=device)
        weight.scatter_(1, src, 0.0)
    return Matching(target, kept, slot.gather(1, target), weight)


def merge_tokens(
    x: torch.Tensor, sizes: torch.Tensor, matching: Matching, norm: str = "average"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (``(B, N, D)``) and its ``sizes`` (``(B, N, 1)``) reduced by
    ``matching``: every output's size-weighted mean of what it receives
    and its received size, in the kept order; ``norm`` (:data:`MERGE_NORMS`)
    sets the norm of every output that received a token."""
    if norm not in MERGE_NORMS:
        raise ValueError(f"norm must be one of {MERGE_NORMS}; got {norm!r}")
    b, n, d = x.shape
    kept = matching.kept.unsqueeze(-1)
    kept_sizes = sizes.gather(1, kept)
    # only the tokens that leave are added in (a few dozen of a few hundred):
    # the kept ones start their own sums, in their order
    src = matching.leaving.unsqueeze(-1)
    if matching.shares is not None:
        if norm == "max":
            raise ValueError(
                "norm='max' needs each token to go into one output; a reduction that shares "
                "tokens among outputs takes norm='average' or 'mean'"
            )
        shares = matching.shares.to(x.dtype)  # (B, N', r)
        weighted = x * sizes
        total = weighted.gather(1, kept.expand(-1, -1, d)) + shares @ weighted.gather(
            1, src.expand(-1, -1, d)
        )
        received = kept_sizes.to(x.dtype) + shares @ sizes.gather(1, src).to(x.dtype)
        out = total / received
        if norm == "mean":
            lengths = x.norm(dim=-1, keepdim=True) * sizes
            summed = lengths.gather(1, kept) + shares @ lengths.gather(1, src)
            out = _at_norm(out, summed / received, received > kept_sizes)
        return out, received.to(sizes.dtype)
    mass = sizes.gather(1, src)
    if matching.weight is not None:
        mass = mass * matching.weight.unsqueeze(-1).gather(1, src)
    slot = matching.new_index.unsqueeze(-1).gather(1, src)
    moved = x.gather(1, src.expand(-1, -1, d))
    total = x.gather(1, kept.expand(-1, -1, d)) * kept_sizes
    total.scatter_add_(1, slot.expand(-1, -1, d), moved * mass)
    new_sizes = kept_sizes.scatter_add(1, slot, mass)
    out = total / new_sizes
    if norm != "average":
        # only the outputs that received a token change: their rows alone
        # are read and rescaled (a few dozen of a few hundred)
        target = _merged_norms(x, sizes, matching, src, moved, mass, slot, new_sizes, norm)
        rows = out.gather(1, slot.expand(-1, -1, d))
        merged = (new_sizes > kept_sizes).gather(1, slot)
        out.scatter_(1, slot.expand(-1, -1, d), _at_norm(rows, target.gather(1, slot), merged))
    return out, new_sizes


def _merged_norms(
    x: torch.Tensor,
    sizes: torch.Tensor,
    matching: Matching,
    src: torch.Tensor,
    moved: torch.Tensor,
    mass: torch.Tensor,
    slot: torch.Tensor,
    new_sizes: torch.Tensor,
    norm: str,
) -> torch.Tensor:
    """The norm each output that received a token takes (``(B, N', 1)``;
    other rows 0): the largest (``"max"``) or the size-weighted mean
    (``"mean"``) of its tokens' norms, the tokens that leave (``src``,
    their states ``moved`` and ``mass``) and the one kept in its place."""
    own = matching.target.unsqueeze(-1).gather(1, src)  # where each leaving token goes
    own_length = x.gather(1, own.expand_as(moved)).norm(dim=-1, keepdim=True)
    length = moved.norm(dim=-1, keepdim=True)
    start = torch.zeros_like(new_sizes, dtype=x.dtype)
    if norm == "max":
        # a pruned token (no mass) takes no part: its length counts as 0
        start.scatter_(1, slot, own_length)
        return start.scatter_reduce(1, slot, torch.where(mass > 0, length, 0.0), reduce="amax")
    start.scatter_(1, slot, own_length * sizes.gather(1, own))
    return start.scatter_add(1, slot, length * mass) / new_sizes


def _at_norm(out: torch.Tensor, target: torch.Tensor, merged: torch.Tensor) -> torch.Tensor:
    """``out`` with the rows where ``merged`` rescaled to the norms ``target``
    (a zero row stays zero)."""
    length = out.norm(dim=-1, keepdim=True)
    scale = torch.where(merged & (length > 0), target / length.clamp_min(1e-30), 1.0)
    return out * scale


def leaving_positions(kept: torch.Tensor, n: int) -> torch.Tensor:
    """The positions (``(B, N − N')``, ascending) of the ``n`` tokens that
    ``kept`` (``(B, N')``) leaves out."""
    out = torch.ones(kept.shape[0], n, dtype=torch.int8, device=kept.device)
    out.scatter_(1, kept, 0)
    order = torch.sort(out, dim=-1, descending=True, stable=True).indices
    return order[:, : n - kept.shape[1]]


def carry_source(source: torch.Tensor | None, matching: Matching) -> torch.Tensor:
    """The source map after ``matching``: from every input token to the
    current tokens, as an index (``(B, N₀)``, while every reduction was
    one-to-one or many-to-one) or as mixing weights (``(B, N₀, N')``, once a
    many-to-many reduction ran). ``source`` None: the identity."""
    if matching.shares is None:
        moved = matching.new_index
        if source is None:
            return moved
        if source.dim() == 2:
            return moved.gather(1, source)
        # a mix of current tokens: each current token's weight moves to its new slot
        shape = (*source.shape[:2], matching.kept.shape[1])
        out = torch.zeros(shape, dtype=source.dtype, device=source.device)
        return out.scatter_add_(2, moved.unsqueeze(1).expand_as(source), source)
    if source is None or source.dim() == 2:
        spread = matching.spread
        assert spread is not None  # shares are set
        back = spread.transpose(1, 2)  # (B, N, N'): each token's shares
        if source is None:
            return back
        return back.gather(1, source.unsqueeze(-1).expand(-1, -1, back.shape[2]))
    # source @ spreadᵀ, with the kept tokens' one-hot columns as a gather
    src = matching.leaving
    shares = matching.shares.to(source.dtype)  # (B, N', r)
    kept = matching.kept.unsqueeze(1).expand(-1, source.shape[1], -1)
    leaving = src.unsqueeze(1).expand(-1, source.shape[1], -1)
    return source.gather(2, kept) + source.gather(2, leaving) @ shares.transpose(1, 2)


def unmerge(x: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """Every input token's state from the current tokens ``x`` (``(B, N', D)``)
    by the ``source`` map :func:`carry_source` keeps."""
    if source.dim() == 2:
        return x.gather(1, source.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
    return source.to(x.dtype) @ x
