"""Tokens per block and multiply-accumulates of a model with token merging,
analytically, from widths read once (:class:`MergeWidths`).

The convention is ToaSt's (:mod:`toast.methods.heads.macs`: ToMe's and
DiffRate's GMACs, matmuls only), with every term at the tokens it sees.
A block that ``N`` tokens enter and ``N'`` leave (``N' = N − r``, ``r``
capped as :func:`effective_r` says) costs

- attention projections at ``N``: ``N · Σ in·out`` of the attention's
  linears (``4·N·D²`` for a plain ViT: Q, K, V and the output),
- attention products at ``N``: ``2·N²·W`` (``Q·Kᵀ`` and ``A·V``, ``W`` the
  attention width, ``D`` unpruned),
- the MLP at ``N'`` (merging happens between attention and MLP):
  ``N' · Σ in·out`` of its linears (``2·N·D·F``; DINOv2's SwiGLU its three).

The patch embedding costs ``N_p · D · C·P²`` once; layers outside the
blocks (poolers, classifier heads) are counted once per image as measured
(``outside``). LayerNorm, softmax, GELU and the merging itself are not
counted. The linear part (everything but the attention products and the
patch embedding, a convolution) is what ``toast.macs(...,
convention="linear")`` and ``toast.search`` count with hooks on a forward.

This module does not import torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from toast._validation import Interval, Options, check

__all__ = [
    "BlockWidths",
    "MergeMacs",
    "MergeWidths",
    "SCHEDULES",
    "SCHEDULE_HELP",
    "effective_r",
    "merged_macs",
    "reduced_macs",
    "tokens_per_block",
]


#: Named schedules, how an int ``r`` spreads over the blocks:
#:
#: - ``"constant"``: ``r`` in every block (ToMe's default);
#: - ``"decreasing"``: ToMe's ``2r`` in the first block down to 0 in the
#:   last, the same total;
#: - ``"delayed"``: nothing in the first block, ``r`` in every later one
#:   (the first block's inputs are bare patch embeddings, whose keys say
#:   least about which tokens are alike);
#: - ``"front"``: ``2r`` in the first sixth of the blocks (at least one),
#:   ``r`` after (reducing early saves the most MACs per token removed);
#: - ``"delayed-decreasing"``: nothing in the first block, then ToMe's
#:   decreasing schedule over the others.
#:
#: Which suits a model and a target is measured, not assumed: the search
#: proposes every one (:mod:`toast.methods.merge.stages`).
SCHEDULES = ("constant", "decreasing", "delayed", "front", "delayed-decreasing")

#: What ``--schedule`` means on the command line, for every reducer's config.
SCHEDULE_HELP = (
    "how r spreads over the blocks: constant; decreasing (2r down to 0); delayed (none in the "
    "first block); front (2r in the first sixth); delayed-decreasing"
)


def merge_schedule(
    r: int | Sequence[int], num_blocks: int, schedule: str = "constant"
) -> tuple[int, ...]:
    """``r`` per block: an int spread by ``schedule`` over ``num_blocks``
    blocks (one of :data:`SCHEDULES`; ``"constant"`` and ``"decreasing"``
    are ToMe's ``parse_r``), or a sequence of one ``r`` per block as given."""
    check("schedule", schedule, Options(SCHEDULES))
    if isinstance(r, Sequence):
        rs = tuple(int(check("r", v, Interval(int, 0, None))) for v in r)
        if len(rs) != num_blocks:
            raise ValueError(f"r must give one merge count per block ({num_blocks}); got {len(rs)}")
        return rs
    r = int(check("r", r, Interval(int, 0, None)))
    if schedule == "delayed" or schedule == "delayed-decreasing":
        if num_blocks == 1:
            return (0,)
        rest = "constant" if schedule == "delayed" else "decreasing"
        return (0, *merge_schedule(r, num_blocks - 1, rest))
    if schedule == "front":
        early = max(1, round(num_blocks / 6))
        return tuple(2 * r if i < early else r for i in range(num_blocks))
    if schedule == "constant" or num_blocks == 1:
        return (r,) * num_blocks
    step = 2 * r / (num_blocks - 1)
    return tuple(int(2 * r - step * i) for i in range(num_blocks))


def effective_r(r: int, tokens: int, prefix: int) -> int:
    """``r`` capped so that the ``prefix`` protected tokens and at least one
    token of each set remain: ``min(r, (N − prefix) // 2, free A tokens)``,
    0 when the set B has no free token (A: even positions, B: odd)."""
    free = max(tokens - prefix, 0)
    # free tokens at even / odd positions, counted from the first free one
    free_a = (free + (prefix % 2 == 0)) // 2
    free_b = free - free_a
    if free_b == 0:
        return 0
    return max(0, min(r, free // 2, free_a))


def tokens_per_block(tokens: int, rs: Sequence[int], prefix: int) -> tuple[tuple[int, int], ...]:
    """``(tokens entering, tokens after merging)`` of every block, for
    ``tokens`` input tokens (prefix included) and ``rs`` merges per block."""
    out = []
    for r in rs:
        kept = tokens - effective_r(r, tokens, prefix)
        out.append((tokens, kept))
        tokens = kept
    return tuple(out)


@dataclass(frozen=True)
class BlockWidths:
    """One block's linear MACs per token: ``attention`` (its projections)
    and ``mlp``, and its attention width ``width`` (``heads · head_dim``)."""

    attention: int
    mlp: int
    width: int


@dataclass(frozen=True)
class MergeWidths:
    """What a merged model's MACs are made of, read once from the model:
    ``tokens`` entering the first block (``prefix`` of them protected), the
    ``blocks``' widths, the patch embedding's MACs per image and the linear
    MACs per image ``outside`` the blocks."""

    tokens: int
    prefix: int
    blocks: tuple[BlockWidths, ...]
    patch_embed: int = 0
    outside: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


@dataclass(frozen=True)
class MergeMacs:
    """MACs per image: ``tokens`` per block (entering, after merging), and
    per block the ``linear`` part and the attention ``products``, plus the
    ``patch_embed`` and ``outside`` terms."""

    tokens: tuple[tuple[float, float], ...]
    linear_blocks: tuple[float, ...]
    products: tuple[float, ...]
    patch_embed: int
    outside: int

    @property
    def linear(self) -> float:
        """What hooks on every ``nn.Linear`` count (``convention="linear"``)."""
        return sum(self.linear_blocks) + self.outside

    @property
    def total(self) -> float:
        """Every matmul: linear layers, attention products, patch embedding."""
        return self.linear + sum(self.products) + self.patch_embed


def merged_macs(widths: MergeWidths, rs: Sequence[int]) -> MergeMacs:
    """The MACs per image of the model ``widths`` describes with ``rs``
    merges per block (all zeros: the model without merging)."""
    if len(rs) != widths.num_blocks:
        raise ValueError(
            f"rs must give one merge count per block ({widths.num_blocks}); got {len(rs)}"
        )
    return reduced_macs(widths, tokens_per_block(widths.tokens, rs, widths.prefix))


def reduced_macs(widths: MergeWidths, tokens: Sequence[tuple[float, float]]) -> MergeMacs:
    """The MACs per image of the model ``widths`` describes when its blocks
    see ``tokens`` (``(entering, after reducing)`` per block; averages over
    images are fine: a data-dependent reducer's counts)."""
    if len(tokens) != widths.num_blocks:
        raise ValueError(
            f"tokens must give one (in, after) pair per block ({widths.num_blocks}); "
            f"got {len(tokens)}"
        )
    tokens = tuple((n, kept) for n, kept in tokens)
    linear = tuple(
        n * b.attention + kept * b.mlp for (n, kept), b in zip(tokens, widths.blocks, strict=True)
    )
    products = tuple(2 * n * n * b.width for (n, _), b in zip(tokens, widths.blocks, strict=True))
    return MergeMacs(tokens, linear, products, widths.patch_embed, widths.outside)
