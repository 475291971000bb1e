"""Token Transforming (Zeng, Yu, Kong, Tang, arXiv 2506.05709, 2025) as a
token reducer: a many-to-many reduction, the ``shares`` form of
:class:`~toast.methods.merge.matching.Matching`.

What is the paper's (its abstract and Fig. 1 caption, the only parts of
it that could be read):

- token reduction written as an explicit matrix that maps the ``N``
  tokens to ``N' < N``; pruning (one-to-one: each remaining token comes
  from a single original token) and merging (many-to-one, exclusive
  groups) are special forms of that matrix;
- Token Transforming is the many-to-many form: every original token is
  shared among the remaining tokens, so less information is lost;
- it is training-free; on DeiT-S it removes 40% of the FLOPs and runs
  1.5x faster for 0.1 point of ImageNet top-1.

What is toast's reading (the method section, its equations and its
settings could not be read, and no code is released; every choice below
is a reconstruction, not the paper's text):

- the remaining tokens are *anchors*, existing tokens chosen by the class
  token's attention (EViT's informativeness score, with proportional
  attention over the sizes), kept in positional order after the
  protected prefix;
- every other token is shared among the anchors by a softmax over the
  anchors of ``cos(key_token, key_anchor) / temperature`` (keys averaged
  over heads, ToMe's metric; ``temperature`` 0.1 by default), so each
  column of the matrix sums to 1 and the total size is conserved; an
  anchor keeps its own identity (its column is one-hot), and the
  prefix is never touched;
- every output is the size-weighted mean of what it receives (the
  framework's :func:`~toast.methods.merge.matching.merge_tokens`:
  ``sizes' = P·s``, ``x' = P(s⊙x) / sizes'``), and an unmerged token is
  the mix of the outputs in its column's proportions;
- ``r[i]`` tokens leave block ``i`` (ToMe's constant-``r`` schedule is the
  usual choice), capped at ``(N − prefix) // 2`` so at least half of the
  free tokens stay as anchors.

The class token's attention row is the first token's: on a model with no
protected prefix it is a patch's row, which this reading does not cover
(the view carries no other attention).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from toast.methods.merge.matching import Matching, leaving_positions
from toast.methods.merge.reducers import TokenView, register_reducer

__all__ = ["TransformingReducer", "transforming_r", "transforming_shares"]


def transforming_r(r: int, tokens: int, prefix: int) -> int:
    """``r`` capped so that at least half of the free tokens stay as
    anchors: ``min(r, (N − prefix) // 2)`` (0 when nothing is free)."""
    return max(0, min(r, max(tokens - prefix, 0) // 2))


def _anchors(scores: torch.Tensor, count: int, prefix: int) -> torch.Tensor:
    """The positions (``(B, count)``, ascending) of the ``count`` free tokens
    with the largest ``scores`` (``(B, N)``); ties go to the earlier one."""
    free = scores[:, prefix:]
    # a stable descending sort keeps equal scores in positional order
    order = torch.sort(free, dim=-1, descending=True, stable=True).indices[:, :count]
    return torch.sort(order, dim=-1).values + prefix


def transforming_shares(
    metric: torch.Tensor, kept: torch.Tensor, leaving: torch.Tensor, prefix: int, temperature: float
) -> torch.Tensor:
    """How each token of ``leaving`` (``(B, r)``) is shared among the
    outputs ``kept`` (``(B, N')``: the prefix, then the anchors), as
    ``(B, N', r)``: the softmax over the anchors of the metric's cosine
    similarity divided by ``temperature``; the prefix outputs get nothing."""
    unit = metric / metric.norm(dim=-1, keepdim=True)
    width = unit.shape[-1]
    anchor_unit = unit.gather(1, kept[:, prefix:, None].expand(-1, -1, width))
    leaving_unit = unit.gather(1, leaving[:, :, None].expand(-1, -1, width))
    cosine = anchor_unit @ leaving_unit.transpose(1, 2)  # (B, anchors, r)
    shares = (cosine / temperature).softmax(dim=1)
    return torch.cat([shares.new_zeros(shares.shape[0], prefix, shares.shape[2]), shares], dim=1)


@dataclass(frozen=True)
class TransformingReducer:
    """Token Transforming (see the module docstring): ``r[i]`` tokens
    leave block ``i``, each shared among the anchors by a softmax at
    ``temperature`` over key cosine similarity."""

    r: tuple[int, ...]
    temperature: float = 0.1

    name: ClassVar[str] = "token-transforming"
    needs_attention: ClassVar[bool] = True

    def __post_init__(self) -> None:
        r = self.r
        valid = isinstance(r, Sequence) and not isinstance(r, str)
        if not valid or not all(_is_count(v) for v in r):
            raise ValueError(
                f"TransformingReducer.r must be a sequence of ints >= 0 (tokens removed per "
                f"block); got {r!r}"
            )
        object.__setattr__(self, "r", tuple(int(v) for v in r))
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(
                f"TransformingReducer.temperature must be a finite number > 0 (e.g. 0.1); got {t!r}"
            )
        object.__setattr__(self, "temperature", float(t))

    @property
    def num_blocks(self) -> int:
        return len(self.r)

    def reduce(self, position: int, view: TokenView) -> Matching | None:
        """Block ``position``'s many-to-many reduction (None: ``r`` is 0 there)."""
        b, n, _ = view.x.shape
        prefix = view.prefix
        r = transforming_r(self.r[position], n, prefix)
        if r == 0:
            return None
        if view.cls_attention is None:
            raise ValueError("Token Transforming picks its anchors by the class token's attention")
        device = view.x.device
        with torch.no_grad():
            anchors = _anchors(view.cls_attention, n - prefix - r, prefix)
            head = torch.arange(prefix, device=device).expand(b, prefix)
            kept = torch.cat([head, anchors], dim=1)
            metric = view.metric
            if metric.dtype in (torch.float16, torch.bfloat16):
                metric = metric.float()  # the softmax at a small temperature needs the range
            leaving = leaving_positions(kept, n)
            shares = transforming_shares(metric, kept, leaving, prefix, self.temperature)
            # every token's largest share: its own output when kept
            new_index = torch.zeros(b, n, dtype=torch.long, device=device)
            new_index.scatter_(1, kept, torch.arange(kept.shape[1], device=device).expand_as(kept))
            new_index.scatter_(1, leaving, shares.argmax(dim=1))
            target = kept.gather(1, new_index)
        return Matching(target, kept, new_index, shares=shares)

    def state(self) -> dict[str, Any]:
        return {"r": list(self.r), "temperature": self.temperature}

    def tokens(self, tokens: int, prefix: int) -> tuple[tuple[int, int], ...]:
        """``(entering, after)`` per block for ``tokens`` input tokens."""
        out = []
        for r in self.r:
            after = tokens - transforming_r(r, tokens, prefix)
            out.append((tokens, after))
            tokens = after
        return tuple(out)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _from_state(state: Mapping[str, Any]) -> TransformingReducer:
    """The reducer a saved state describes (``ValueError`` naming what is wrong)."""
    r, temperature = state.get("r"), state.get("temperature")
    if not (isinstance(r, list) and all(_is_count(v) for v in r)):
        raise ValueError(
            f"the token-transforming state's 'r' must be a list of ints >= 0; got {r!r}"
        )
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not math.isfinite(temperature)
        or temperature <= 0
    ):
        raise ValueError(
            "the token-transforming state's 'temperature' must be a finite number > 0; "
            f"got {temperature!r}"
        )
    return TransformingReducer(tuple(r), float(temperature))


register_reducer("token-transforming", _from_state)
