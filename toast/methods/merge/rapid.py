"""RAPID as a token reducer: redundancy-aware pruning in the shallow blocks,
importance-driven merging in the deep ones (Choi & Jang, "RAPID: Layer-Wise
Redundancy-Aware Pruning and Importance-Driven Token Merging for Efficient
ViT", arXiv 2606.08156).

What the paper states (its abstract and figure captions; the method
section and code were not available):

- training-free and plug-and-play, with a per-block count ``r`` of tokens
  removed, as ToMe;
- at every block the tokens are first divided into two groups;
- shallow-to-middle blocks *prune* the tokens ranked highest by a score
  that combines redundancy with similarity; "Num." in its figure is the
  number of destination tokens whose similarity exceeds a threshold;
- deeper blocks *merge* the tokens ranked highest by a score that combines
  importance, read from the class token's attention, with similarity, so
  that the tokens the class token attends to are kept and less important,
  similar ones are fused.

What is toast's reading where the sources are silent (flagged, not the
paper's):

- the two groups are ToMe's split (even positions A are the sources, odd
  positions B the destinations; the protected prefix is never a source nor
  a destination), the similarity is the cosine of the block's keys averaged
  over heads, ``s_i`` is a source's best similarity and ``d_i`` its best
  destination, and ``r`` is capped as ToMe's
  (:func:`~toast.methods.merge.macs.effective_r`);
- the redundancy count is ``Num_i = #{j in B : S_ij > tau}`` with ``tau``
  (default 0.8) a fixed threshold on that cosine;
- the pruning score is ``R_i = s_i · Num_i``, ties broken by ``s_i``; the
  top ``r`` sources are dropped: their mass is lost, and for the source map
  (and an unmerged output) they stand for their best destination;
- the importance ``I_i`` is this block's class-token attention row averaged
  over heads (after proportional attention), normalised per image by its
  maximum over the non-prefix tokens; the merging score is
  ``M_i = s_i · (1 − Î_i)``, and the top ``r`` sources merge into their best
  destinations by the size-weighted mean;
- blocks before ``prune_until`` prune and the others merge; configs default
  it to half the depth (ToFu's switch), the paper's switch is not known;
- the kept tokens stay in positional order, as toast's ToMe keeps them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from toast.methods.merge.macs import effective_r, tokens_per_block
from toast.methods.merge.matching import Matching, bipartite_scores, matching_from_pairs
from toast.methods.merge.reducers import TokenView, is_int, is_real, register_reducer

__all__ = ["RapidReducer"]


@dataclass(frozen=True)
class RapidReducer:
    """RAPID (see the module docstring): ``r[i]`` tokens removed in block
    ``i``; blocks before ``prune_until`` prune by redundancy and similarity,
    the others merge by importance and similarity; ``tau``: the cosine
    threshold of the redundancy count."""

    r: tuple[int, ...]
    prune_until: int
    tau: float = 0.8

    name: ClassVar[str] = "rapid"
    needs_attention: ClassVar[bool] = True

    def __post_init__(self) -> None:
        r = self.r
        if isinstance(r, str | bytes) or not hasattr(r, "__iter__"):
            raise ValueError(f"RAPID's r must be a sequence of ints >= 0, one per block; got {r!r}")
        r = tuple(r)
        if not all(is_int(v) and v >= 0 for v in r):
            raise ValueError(f"RAPID's r must hold ints >= 0 (tokens removed per block); got {r!r}")
        object.__setattr__(self, "r", r)
        if not (is_int(self.prune_until) and 0 <= self.prune_until <= len(r)):
            raise ValueError(
                f"RAPID's prune_until must be an int from 0 to the number of blocks ({len(r)}): "
                f"the blocks before it prune; got {self.prune_until!r}"
            )
        tau = self.tau
        if not (is_real(tau) and -1.0 <= tau <= 1.0):
            raise ValueError(f"RAPID's tau must be a cosine threshold in [-1, 1]; got {tau!r}")
        object.__setattr__(self, "tau", float(tau))

    @property
    def num_blocks(self) -> int:
        return len(self.r)

    def reduce(self, position: int, view: TokenView) -> Matching | None:
        """Block ``position``'s pruning (before ``prune_until``) or merging."""
        batch, n, _ = view.metric.shape
        r = effective_r(self.r[position], n, view.prefix)
        if r == 0:
            return None
        prune = position < self.prune_until
        if not prune and view.cls_attention is None:
            raise ValueError("RAPID's merging blocks need the class token's attention in the view")
        with torch.no_grad():
            a_pos, b_pos, sims = bipartite_scores(view.metric, view.prefix)
            best, match = sims.max(dim=-1)  # each source's best destination
            free = (a_pos >= view.prefix).expand(batch, -1)
            if prune:
                order = _redundancy_order(sims, best, free, self.tau)
            else:
                assert view.cls_attention is not None  # checked above
                order = _importance_order(view.cls_attention, a_pos, best, free, view.prefix)
            src = a_pos[order[:, :r]]
            dst = b_pos[match.gather(1, order[:, :r])]
            return matching_from_pairs(src, dst, n, view.x.dtype if prune else None)

    def state(self) -> dict[str, Any]:
        return {"r": list(self.r), "prune_until": self.prune_until, "tau": self.tau}

    def tokens(self, tokens: int, prefix: int) -> tuple[tuple[int, int], ...]:
        # pruning and merging remove the same capped r tokens as ToMe
        return tokens_per_block(tokens, self.r, prefix)


def _redundancy_order(
    sims: torch.Tensor, best: torch.Tensor, free: torch.Tensor, tau: float
) -> torch.Tensor:
    """Sources by ``(s·Num, s)`` descending, stable; protected ones last."""
    count = (sims > tau).sum(dim=-1).to(best.dtype)
    # + 0.0 turns −0 (a negative s times 0) into +0, so every device sorts it as 0
    score = torch.where(free, best * count + 0.0, -torch.inf)
    by_best = torch.sort(best, dim=-1, descending=True, stable=True).indices
    # a stable sort by score of the order by s: ties in score stay in order of s
    by_score = torch.sort(score.gather(1, by_best), dim=-1, descending=True, stable=True).indices
    return by_best.gather(1, by_score)


def _importance_order(
    attention: torch.Tensor,
    a_pos: torch.Tensor,
    best: torch.Tensor,
    free: torch.Tensor,
    prefix: int,
) -> torch.Tensor:
    """Sources by ``s·(1 − Î)`` descending, stable; protected ones last."""
    peak = attention[:, prefix:].amax(dim=-1, keepdim=True)
    importance = (attention / peak)[:, a_pos].to(best.dtype)
    score = torch.where(free, best * (1.0 - importance) + 0.0, -torch.inf)
    return torch.sort(score, dim=-1, descending=True, stable=True).indices


def _rapid_from_state(state: Mapping[str, Any]) -> RapidReducer:
    missing = [key for key in ("r", "prune_until", "tau") if key not in state]
    if missing:
        raise ValueError(f"the rapid state must set {missing}")
    r = state["r"]
    if not (isinstance(r, list) and all(is_int(v) and v >= 0 for v in r)):
        raise ValueError(f"the rapid state's 'r' must be a list of ints >= 0; got {r!r}")
    prune_until = state["prune_until"]
    if not (is_int(prune_until) and 0 <= prune_until <= len(r)):
        raise ValueError(
            f"the rapid state's 'prune_until' must be an int from 0 to len(r) = {len(r)}; "
            f"got {prune_until!r}"
        )
    tau = state["tau"]
    if not (is_real(tau) and -1.0 <= tau <= 1.0):
        raise ValueError(f"the rapid state's 'tau' must be a number in [-1, 1]; got {tau!r}")
    return RapidReducer(tuple(r), prune_until, float(tau))


register_reducer("rapid", _rapid_from_state)
