"""Structured Coupled Weight Pruning (SCWP): ToaSt's head-dimension pruning.

For every pruned block and head ``h`` (``d_k`` dimensions), dimension ``j``
is one point of each coupled pair:

- QK: row ``j`` of ``W_Q^h`` next to row ``j`` of ``W_K^h`` (``nn.Linear``
  rows, i.e. the paper's columns), a vector of ``2D``;
- VO: row ``j`` of ``W_V^h`` next to column ``j`` of ``W_O^h``, also ``2D``.

Each point is scored by ``center`` (:data:`toast.methods.heads.median.CENTERS`): its
distance to the **geometric median** of the head's ``d_k`` points
(Weiszfeld, the default), to the **coordinate median** (the reference
code), FPGM's **sum of distances**, or its **L1** / **L2** norm. The points
closest to the center are redundant; every head keeps the
``floor(d_k (1 − ρ))`` highest-scoring dimensions (uniform across heads).

Index sets (``index_sets``):

- ``"shared"`` (default, the paper's Algorithm 1): one set per head from
  the mean score ``½(I_QK + I_VO)``, used by Q, K, V and the output
  projection;
- ``"independent"`` (the reference code): one set from ``I_QK`` for Q and K,
  another from ``I_VO`` for V and O;
- ``"nonaligned"`` (Fig. 3's control): Q, K, V and O each scored alone and
  pruned with their own indices (masked form only: a dot product over
  different dimensions of Q and K has no dense form).

Single-sided ablations (``coupling``, Table 15): ``"coupled"`` (default)
scores the ``2D`` vectors; ``"q_only"`` scores Q for QK and V for VO,
``"k_only"`` K and Oᵀ, ``"proj_only"`` Q and Oᵀ, ``"average"`` the mean of
the two halves' scores (the reference code's definitions).

Forms (``form``): ``"masked"`` zeroes the pruned rows of Q, K, V and
columns of O (biases kept unless ``mask_bias``: a pruned Q/K dimension then
adds the same logit to every key, which softmax ignores, and a pruned V
dimension meets a zero column of O, so both forms compute the same
function); ``"dense"`` re-packs Q, K, V into ``H · d_k'`` outputs and O into
``H · d_k'`` inputs and sets the attention's ``head_dim`` to ``d_k'``. The
softmax scale stays ``1/√d_k`` (the reference code's choice: pruning removes
terms of the dot product, it does not rescale it); ``rescale=True`` uses
``1/√d_k'``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from toast._validation import Options, check
from toast.hf.model.params import count_params
from toast.hf.model.vit import Attention, VitBlock, VitModel, vit_blocks
from toast.io.guard import guard_save
from toast.methods.heads.choices import COUPLINGS, FORMS, INDEX_SETS
from toast.methods.heads.median import CENTERS, GM_MAX_ITER, GM_TOL, dim_scores
from toast.methods.heads.schedules import head_keep, per_block_sparsity, skip_blocks

__all__ = [
    "COUPLINGS",
    "FORMS",
    "INDEX_SETS",
    "BlockPruning",
    "PruneReport",
    "apply_masks",
    "prune_heads",
]


# Markers left on a pruned attention module (plain attributes, so they follow
# the module through copy.deepcopy): the masks of the masked form, the
# original head width of the dense form.
_MASKS = "_toast_scwp_masks"
ORIGINAL_HEAD_DIM = "_toast_scwp_original_head_dim"

# Which halves score each pair in the single-sided ablations.
_SIDES = {
    "q_only": ("q", "v"),
    "k_only": ("k", "o"),
    "proj_only": ("q", "o"),
}


@dataclass
class BlockPruning:
    """What :func:`prune_heads` did to one block. ``keep`` dimensions of
    ``head_dim`` per head; ``indices[name]`` (``(heads, keep)``, sorted) the
    kept dimensions of ``"q"``, ``"k"``, ``"v"``, ``"o"``; ``iterations``
    the Weiszfeld steps of its point sets (geomedian only)."""

    index: int
    sparsity: float
    head_dim: int
    keep: int
    indices: dict[str, np.ndarray] = field(repr=False)
    iterations: np.ndarray = field(repr=False)


@dataclass
class PruneReport:
    """What :func:`prune_heads` did to a model."""

    form: str
    center: str
    index_sets: str
    coupling: str
    rescale: bool
    blocks: list[BlockPruning]
    params_before: int
    params_after: int

    @property
    def keep_counts(self) -> dict[int, int]:
        """Kept dimensions per head, by pruned block."""
        return {b.index: b.keep for b in self.blocks}

    def to_markdown(self) -> str:
        lines = [
            f"**SCWP** ({self.form}, center {self.center}, index sets {self.index_sets}, "
            f"{self.coupling} scores): {len(self.blocks)} block(s) pruned.",
            "",
            "| block | ρ | d_k' / d_k | Weiszfeld steps (max) |",
            "|---:|---:|---:|---:|",
        ]
        for b in self.blocks:
            steps = int(b.iterations.max()) if b.iterations.size else 0
            lines.append(f"| {b.index} | {b.sparsity:g} | {b.keep}/{b.head_dim} | {steps} |")
        lines.append("")
        lines.append(f"Parameters: {self.params_before:,} → {self.params_after:,}.")
        return "\n".join(lines)


def _head_rows(weight: torch.Tensor, heads: int, head_dim: int) -> np.ndarray:
    """``(heads, head_dim, D)`` float64 from an ``(H·d_k, D)`` weight."""
    w = weight.detach().to("cpu", torch.float64).numpy()
    return w.reshape(heads, head_dim, -1)


def _halves(blk: VitBlock) -> dict[str, np.ndarray]:
    a, h, dk = blk.attention, blk.heads, blk.head_dim
    return {
        "q": _head_rows(a.q_proj.weight, h, dk),
        "k": _head_rows(a.k_proj.weight, h, dk),
        "v": _head_rows(a.v_proj.weight, h, dk),
        "o": _head_rows(a.o_proj.weight.t(), h, dk),
    }


def _score_sets(
    sets: list[np.ndarray], center: str, tol: float, max_iter: int
) -> tuple[list[np.ndarray], np.ndarray]:
    """Scores of several ``(heads, d_k, p)`` point-set stacks in one C call
    per width ``p``; returns one ``(heads, d_k)`` array per stack."""
    out: list[np.ndarray] = [np.empty(0)] * len(sets)
    iters = []
    by_width: dict[int, list[int]] = {}
    for k, s in enumerate(sets):
        by_width.setdefault(s.shape[-1], []).append(k)
    for ks in by_width.values():
        stacked = np.concatenate([sets[k] for k in ks], axis=0)
        scores, it = dim_scores(stacked, center, tol=tol, max_iter=max_iter)
        heads = sets[ks[0]].shape[0]
        for pos, k in enumerate(ks):
            out[k] = scores[pos * heads : (pos + 1) * heads]
        iters.append(np.atleast_1d(it))
    return out, np.concatenate(iters)


def _top(scores: np.ndarray, keep: int) -> np.ndarray:
    """Per head, the ``keep`` highest scores (ties: the lower index), sorted."""
    order = np.argsort(-scores, axis=-1, kind="stable")[:, :keep]
    return np.sort(order, axis=-1)


def _block_indices(
    blk: VitBlock,
    keep: int,
    center: str,
    index_sets: str,
    coupling: str,
    tol: float,
    max_iter: int,
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    w = _halves(blk)
    if index_sets == "nonaligned":
        (sq, sk, sv, so), iters = _score_sets(
            [w["q"], w["k"], w["v"], w["o"]], center, tol, max_iter
        )
        return {
            "q": _top(sq, keep),
            "k": _top(sk, keep),
            "v": _top(sv, keep),
            "o": _top(so, keep),
        }, iters
    if coupling == "coupled":
        qk = np.concatenate([w["q"], w["k"]], axis=-1)
        vo = np.concatenate([w["v"], w["o"]], axis=-1)
        (s_qk, s_vo), iters = _score_sets([qk, vo], center, tol, max_iter)
    elif coupling == "average":
        (sq, sk, sv, so), iters = _score_sets(
            [w["q"], w["k"], w["v"], w["o"]], center, tol, max_iter
        )
        s_qk, s_vo = (sq + sk) / 2, (sv + so) / 2
    else:
        first, second = _SIDES[coupling]
        (s_qk, s_vo), iters = _score_sets([w[first], w[second]], center, tol, max_iter)
    if index_sets == "shared":
        shared = _top((s_qk + s_vo) / 2, keep)
        return {"q": shared, "k": shared, "v": shared, "o": shared}, iters
    qk_idx, vo_idx = _top(s_qk, keep), _top(s_vo, keep)
    return {"q": qk_idx, "k": qk_idx, "v": vo_idx, "o": vo_idx}, iters


def _flat_rows(indices: np.ndarray, head_dim: int) -> torch.Tensor:
    """Flat row numbers ``h · d_k + j`` of the kept dimensions, head-major."""
    heads = indices.shape[0]
    rows = indices + head_dim * np.arange(heads)[:, None]
    return torch.from_numpy(rows.reshape(-1).astype(np.int64))


def _row_mask(indices: np.ndarray, head_dim: int, like: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros(indices.shape[0] * head_dim, dtype=torch.bool)
    mask[_flat_rows(indices, head_dim)] = True
    return mask.to(like.device)


@dataclass
class _MaskState:
    """Masks kept on a masked-pruned attention module (for re-application
    after optimiser steps): ``True`` = kept output row (Q, K, V) or input
    column (O)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    bias: bool


@torch.no_grad()
def _apply_mask_state(attention: Attention, m: _MaskState) -> None:
    for name, mask in (("q_proj", m.q), ("k_proj", m.k), ("v_proj", m.v)):
        lin = getattr(attention, name)
        lin.weight[~mask.to(lin.weight.device)] = 0
        if m.bias and lin.bias is not None:
            lin.bias[~mask.to(lin.bias.device)] = 0
    o = attention.o_proj
    o.weight[:, ~m.o.to(o.weight.device)] = 0


def _mask_block(blk: VitBlock, idx: dict[str, np.ndarray], mask_bias: bool) -> None:
    a, dk = blk.attention, blk.head_dim
    state = _MaskState(
        _row_mask(idx["q"], dk, a.q_proj.weight),
        _row_mask(idx["k"], dk, a.k_proj.weight),
        _row_mask(idx["v"], dk, a.v_proj.weight),
        _row_mask(idx["o"], dk, a.o_proj.weight),
        mask_bias,
    )
    _apply_mask_state(a, state)
    setattr(a, _MASKS, state)


def _sliced_linear(
    lin: nn.Linear, rows: torch.Tensor | None, cols: torch.Tensor | None
) -> nn.Linear:
    w = lin.weight.detach()
    if rows is not None:
        w = w[rows.to(w.device)]
    if cols is not None:
        w = w[:, cols.to(w.device)]
    b: torch.Tensor | None = lin.bias
    if b is not None and rows is not None:
        b = b.detach()[rows.to(b.device)]
    # skip_init: the weights are copied in below, and an initialisation
    # would draw from (and so move) torch's global generator.
    new = nn.utils.skip_init(
        nn.Linear, w.shape[1], w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype
    )
    with torch.no_grad():
        new.weight.copy_(w)
        if b is not None:
            new.bias.copy_(b)
    new.train(lin.training)
    return new


def _densify_block(blk: VitBlock, idx: dict[str, np.ndarray], keep: int, rescale: bool) -> None:
    a, dk = blk.attention, blk.head_dim
    qk_rows = _flat_rows(idx["q"], dk)
    vo_rows = _flat_rows(idx["v"], dk)
    a.q_proj = _sliced_linear(a.q_proj, qk_rows, None)
    a.k_proj = _sliced_linear(a.k_proj, qk_rows, None)
    a.v_proj = _sliced_linear(a.v_proj, vo_rows, None)
    a.o_proj = _sliced_linear(a.o_proj, None, vo_rows)
    setattr(a, ORIGINAL_HEAD_DIM, dk)
    a.head_dim = keep
    if rescale:
        a.scaling = keep**-0.5


def _check_options(center: str, index_sets: str, coupling: str, form: str) -> None:
    check("center", center, Options(CENTERS))
    check("index_sets", index_sets, Options(INDEX_SETS))
    check("coupling", coupling, Options(COUPLINGS))
    check("form", form, Options(FORMS))
    if index_sets == "nonaligned" and form == "dense":
        raise ValueError(
            "index_sets='nonaligned' prunes Q and K (and V and O) at different dimensions, "
            "which has no dense form; use form='masked'"
        )
    if index_sets == "nonaligned" and coupling != "coupled":
        raise ValueError("index_sets='nonaligned' scores Q, K, V, O separately; leave coupling")


def _plan(vm: VitModel, rho: Sequence[float]) -> list[tuple[VitBlock, float, int]]:
    """``(block, ρ, kept width)`` of every block that loses dimensions."""
    plans = []
    for blk, r in zip(vm.blocks, rho, strict=True):
        if r <= 0:
            continue
        if hasattr(blk.attention, _MASKS) or hasattr(blk.attention, ORIGINAL_HEAD_DIM):
            raise ValueError(f"block {blk.index} is already head-pruned")
        keep = head_keep(blk.head_dim, r)
        if keep < blk.head_dim:
            plans.append((blk, r, keep))
    return plans


def prune_heads(
    model: nn.Module,
    sparsity: float | Sequence[float] | Mapping[int, float] = 0.9,
    *,
    center: str = "geomedian",
    index_sets: str = "shared",
    coupling: str = "coupled",
    form: str = "dense",
    skip: Sequence[int] | str = (0,),
    rescale: bool = False,
    mask_bias: bool = False,
    tol: float = GM_TOL,
    max_iter: int = GM_MAX_ITER,
    blocks: VitModel | None = None,
) -> PruneReport:
    """Prunes the per-head dimensions of every block's attention, in place
    (see the module docstring).

    ``sparsity`` is ρ: one number for every block (but ``skip``), one per
    block, or ``{block: ρ}`` with 0-based global block indices; each head
    keeps ``floor(d_k (1 − ρ))`` dimensions. ``skip`` lists blocks left
    intact (default block 0; ``"stage_first"``: the first block of every
    Swin stage). Blocks whose ρ keeps every dimension are not touched, so
    ``sparsity=0`` is an exact no-op. ``tol``/``max_iter`` are Weiszfeld's.
    ``blocks``: ``model``'s blocks when found already (:func:`vit_blocks`).
    Returns a :class:`PruneReport`.
    """
    _check_options(center, index_sets, coupling, form)
    vm = vit_blocks(model) if blocks is None else blocks
    rho = per_block_sparsity(sparsity, vm.num_blocks, skip_blocks(skip, vm.stage_firsts))
    params_before = count_params(model)
    done: list[BlockPruning] = []
    plans = _plan(vm, rho)
    # Score every block before changing any (a failure leaves the model as it was).
    scored = [
        (blk, r, keep, *_block_indices(blk, keep, center, index_sets, coupling, tol, max_iter))
        for blk, r, keep in plans
    ]
    for blk, r, keep, idx, iters in scored:
        head_dim = blk.head_dim
        if form == "masked":
            _mask_block(blk, idx, mask_bias)
        else:
            _densify_block(blk, idx, keep, rescale)
        done.append(BlockPruning(blk.index, r, head_dim, keep, idx, iters))
    guard_save(model)  # model.save_pretrained now records the kept widths
    return PruneReport(
        form, center, index_sets, coupling, rescale, done, params_before, count_params(model)
    )


def apply_masks(model: nn.Module) -> int:
    """Re-applies the masks of masked-pruned blocks (after optimiser steps,
    which regrow pruned weights); returns the number of blocks masked."""
    count = 0
    for blk in vit_blocks(model).blocks:
        state = getattr(blk.attention, _MASKS, None)
        if isinstance(state, _MaskState):
            _apply_mask_state(blk.attention, state)
            count += 1
    return count
