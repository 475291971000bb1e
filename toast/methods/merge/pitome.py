"""PiToMe as a token reducer (:class:`PitomeReducer`): protect the
informative tokens, merge among the redundant ones (Tran, Nguyen et al.,
"Accelerating Transformers with Spectrum-Preserving Token Merging",
NeurIPS 2024, arXiv 2405.16148; official code ``hchautran/PiToMe``).

What the paper and its code define:

- **Where**: in every block, after the attention residual and before the
  MLP (ToMe's place), on the keys averaged over heads; the class token is
  left out of the scoring and of the merging.
- **Energy score**: with ``W`` the cosine similarities among the ``N``
  patch tokens, token ``i``'s energy is
  ``E_i = (1/N) Σ_j ELU(W_ij − m; α)`` over all ``N`` tokens, itself
  included (the code's form; the paper writes the linear branch as ``x``
  rather than ``x − m``). A token in a large cluster of similar tokens
  scores high; an isolated one scores low.
- **Protect, then merge**: the ``2k`` highest-energy tokens are the merge
  candidates; ranked by energy, the even ranks are sources and the odd
  ranks destinations, and every source merges into its most similar
  destination (several may share one) by the size-weighted mean. The other
  ``N − 2k`` (low-energy, informative) tokens are carried over untouched.
- **Margin schedule**: ``m_l = m₀ − m₀·l/L`` (``l`` 0-based), so deeper
  blocks count more pairs as similar; the paper gives ``m₀ = 0.9``, the
  code's DeiT/MAE classification patches use ``0.75``
  (:func:`pitome_margins`). ``α = 1``.
- **How many**: the code keeps a ratio ``ρ`` of the patch tokens per block
  (``k = ⌊N − N·ρ⌋`` removed, ``ρ`` from 0.9 to 0.975), so ``N`` shrinks
  geometrically.
- **Order**: the code's output is ``[CLS, protected by descending energy,
  destinations]``. Its DeiT and MAE patches also run ToMe's top-``k`` rule
  on an energy-ordered split (nothing protected) in one half of the blocks;
  the paper does not describe that.

What toast chooses where they differ or are silent:

- **A constant ``r`` per block** instead of a keep ratio, capped as ToMe's
  :func:`~toast.methods.merge.macs.effective_r` (``min(r, (N − prefix)//2)``
  here, so ``2r`` candidates always exist), so token counts and MACs
  compare with ToMe's at the same ``r``.
- **Plain PiToMe in every block** (the paper's description), no
  half-depth hybrid.
- **The whole protected prefix** (CLS, DeiT's distillation token, DINOv2's
  registers), not only the class token, stays out of scoring and merging.
- **Kept tokens in positional order**, as toast's ToMe keeps them, not the
  code's energy order: attention and the MLP treat tokens alike wherever
  they sit, so only ties in energy (broken by position, stably) can differ.
- **Proportional attention stays on** (the installed forward adds
  ``log size`` to the logits, as for toast's other reducers), although the
  PiToMe code's classification path computes attention without the sizes.
- The similarities and energies are computed in at least float32, so
  half-precision keys do not blur the energy ranking.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from toast.methods.merge.macs import effective_r, tokens_per_block
from toast.methods.merge.matching import Matching, matching_from_pairs
from toast.methods.merge.reducers import TokenView, is_int, is_real, register_reducer

__all__ = ["PitomeReducer", "pitome_margins"]


def pitome_margins(num_blocks: int, start: float = 0.9) -> tuple[float, ...]:
    """The energy margin of every block, ``m_l = start − start·l/L`` for
    ``l = 0..L−1``.

    The default ``start = 0.9`` is the paper's schedule (also the code's
    for BLIP and HF CLIP). The code's DeiT/MAE classification patches use
    ``0.75``, a per-model tuning for those checkpoints; toast reduces many
    families (ViT, DeiT, DINOv2, timm), so it defaults to the published
    value. Pass ``start=0.75`` to reproduce the DeiT/MAE code."""
    if not is_int(num_blocks) or num_blocks < 1:
        raise ValueError(f"num_blocks must be an int >= 1; got {num_blocks!r}")
    if not (is_real(start) and -1.0 <= start <= 1.0):
        raise ValueError(f"start must be a cosine margin in [-1, 1]; got {start!r}")
    start = float(start)
    return tuple(start - start * layer / num_blocks for layer in range(num_blocks))


@dataclass(frozen=True)
class PitomeReducer:
    """PiToMe (see the module docstring): ``r[i]`` tokens merged in block
    ``i`` among its ``2·r[i]`` highest-energy free tokens, the energy taken
    with margin ``margins[i]`` and ELU parameter ``alpha``."""

    r: tuple[int, ...]
    margins: tuple[float, ...]
    alpha: float = 1.0

    name: ClassVar[str] = "pitome"
    needs_attention: ClassVar[bool] = False

    def __post_init__(self) -> None:
        r, margins = _sequence("r", self.r), _sequence("margins", self.margins)
        if not all(is_int(v) and v >= 0 for v in r):
            raise ValueError(f"PiToMe's r must hold ints >= 0 (tokens merged per block); got {r!r}")
        if not all(is_real(m) and -1.0 <= m <= 1.0 for m in margins):
            raise ValueError(
                f"PiToMe's margins must be cosine margins in [-1, 1], one per block "
                f"(see pitome_margins); got {margins!r}"
            )
        if len(margins) != len(r):
            raise ValueError(
                f"PiToMe's margins must give one margin per block of r ({len(r)}); "
                f"got {len(margins)}"
            )
        if not (is_real(self.alpha) and self.alpha > 0):
            raise ValueError(f"PiToMe's alpha (the ELU's) must be a number > 0; got {self.alpha!r}")
        object.__setattr__(self, "r", r)
        object.__setattr__(self, "margins", tuple(float(m) for m in margins))
        object.__setattr__(self, "alpha", float(self.alpha))

    @property
    def num_blocks(self) -> int:
        return len(self.r)

    def reduce(self, position: int, view: TokenView) -> Matching | None:
        """Block ``position``'s merge: the ``r`` even-ranked of the ``2r``
        highest-energy free tokens into their most similar odd-ranked ones."""
        batch, n, _ = view.metric.shape
        prefix = view.prefix
        # ToMe's cap is min(r, (N − prefix)//2) here, so 2r free candidates exist
        r = effective_r(self.r[position], n, prefix)
        if r == 0:
            return None
        with torch.no_grad():
            dtype = torch.promote_types(view.metric.dtype, torch.float32)
            free = view.metric[:, prefix:].to(dtype)
            unit = free / free.norm(dim=-1, keepdim=True)
            sims = unit @ unit.transpose(-1, -2)  # (B, F, F), the diagonal included
            margin = self.margins[position]
            energy = torch.nn.functional.elu(sims - margin, alpha=self.alpha).mean(dim=-1)
            ranked = torch.sort(energy, dim=-1, descending=True, stable=True).indices
            src, dst = ranked[:, 0 : 2 * r : 2], ranked[:, 1 : 2 * r : 2]  # (B, r) each
            rows = sims.gather(1, src.unsqueeze(-1).expand(-1, -1, sims.shape[-1]))
            scores = rows.gather(2, dst.unsqueeze(1).expand(-1, r, -1))  # (B, r sources, r dsts)
            best = dst.gather(1, scores.argmax(dim=-1))
            return matching_from_pairs(src + prefix, best + prefix, n)

    def state(self) -> dict[str, Any]:
        return {"r": list(self.r), "margins": list(self.margins), "alpha": self.alpha}

    def tokens(self, tokens: int, prefix: int) -> tuple[tuple[int, int], ...]:
        # the same capped r per block as ToMe
        return tokens_per_block(tokens, self.r, prefix)


def _sequence(field: str, value: Any) -> tuple[Any, ...]:
    """``value`` as a tuple, or a ValueError naming PiToMe's ``field``."""
    if isinstance(value, str | bytes) or not hasattr(value, "__iter__"):
        raise ValueError(
            f"PiToMe's {field} must be a sequence with one entry per block; got {value!r}"
        )
    return tuple(value)


def _pitome_from_state(state: Mapping[str, Any]) -> PitomeReducer:
    missing = [key for key in ("r", "margins", "alpha") if key not in state]
    if missing:
        raise ValueError(f"the pitome state must set {missing}")
    r, margins, alpha = state["r"], state["margins"], state["alpha"]
    if not (isinstance(r, list) and all(is_int(v) and v >= 0 for v in r)):
        raise ValueError(f"the pitome state's 'r' must be a list of ints >= 0; got {r!r}")
    if not (isinstance(margins, list) and all(is_real(m) and -1 <= m <= 1 for m in margins)):
        raise ValueError(
            f"the pitome state's 'margins' must be a list of numbers in [-1, 1]; got {margins!r}"
        )
    if len(margins) != len(r):
        raise ValueError(
            f"the pitome state's 'margins' must give one margin per block of 'r' ({len(r)}); "
            f"got {len(margins)}"
        )
    if not (is_real(alpha) and alpha > 0):
        raise ValueError(f"the pitome state's 'alpha' must be a number > 0; got {alpha!r}")
    return PitomeReducer(tuple(r), tuple(float(m) for m in margins), float(alpha))


register_reducer("pitome", _pitome_from_state)
