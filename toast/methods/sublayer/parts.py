"""The two sub-layers of a pre-norm transformer block, and their removal.

A pre-norm block computes ``h = x + f_attn(norm_1(x))`` and then
``y = h + f_mlp(norm_2(h))``. Removing a sub-layer sets its ``f`` to zero
so the residual passes through. It is done by module replacement, not by a
hook, so the model keeps working with every ``transformers`` call
(``generate``, saving) and its parameter count drops by exactly what went:
the sub-layer's main module (the attention or the MLP), its pre-norm and,
where the family scales the branch (DINOv2's ``layer_scale``), that scale.

Discovery reads a block's direct children by name (the names differ per
family and per ``transformers`` release, not per checkpoint) and refuses a
block whose parameterised children it cannot all place in one of the two
sub-layers: cross-attention, sandwich norms (Gemma 2) or a post-norm block
(BERT) would make "its output set to zero" mean something else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from toast.hf.model.blocks import BlockStack

__all__ = [
    "ATTENTION",
    "KINDS",
    "MLP",
    "RemovedPart",
    "SubLayer",
    "ZeroBranch",
    "branch_output",
    "find_sublayers",
    "removed_parts",
    "remove_sublayer",
    "replacement",
    "sublayer_params",
    "zero_branch",
    "zeroed",
]

ATTENTION = "attention"
MLP = "mlp"
KINDS = (ATTENTION, MLP)

# Direct children of a block, by role and sub-layer: the main module (Llama,
# Qwen2, Mistral, Phi-3: self_attn/mlp; GPT-2: attn/mlp; ViT, DeiT, DINOv2:
# attention/mlp; CLIP: self_attn/mlp), its pre-norm, and a per-channel
# scale of the branch (DINOv2).
_MAIN = {ATTENTION: ("self_attn", "attn", "attention"), MLP: ("mlp",)}
_NORM = {
    ATTENTION: ("input_layernorm", "ln_1", "layernorm_before", "norm1", "layer_norm1"),
    MLP: ("post_attention_layernorm", "ln_2", "layernorm_after", "norm2", "layer_norm2"),
}
_SCALE = {ATTENTION: ("layer_scale1",), MLP: ("layer_scale2",)}


@dataclass(frozen=True)
class SubLayer:
    """One removable sub-layer: block ``block`` (index in the stack, at
    ``path``), ``kind`` (:data:`ATTENTION` or :data:`MLP`) and the names of
    the block's children it consists of: the main module first, then its
    pre-norm, then any branch scale."""

    block: int
    kind: str
    path: str
    children: tuple[str, ...]

    @property
    def main(self) -> str:
        return self.children[0]

    @property
    def norm(self) -> str:
        return self.children[1]

    @property
    def last(self) -> str:
        """The child whose output is the branch's contribution to the
        residual stream (the scale where there is one, else the main module)."""
        return self.children[-1] if len(self.children) > 2 else self.children[0]


class ZeroBranch(nn.Module):
    """A removed sub-layer's main module: no parameters, and an output of
    zeros shaped as the residual stream, in the form the block unpacks
    (attention: ``(output, None)``, the ``(output, weights)`` pair of
    every supported family; MLP: the tensor). A removed attention that
    knows its ``layer_idx`` still appends an empty (zero-width) entry to a
    KV cache, so the cache's length, which ``generate`` reads from layer 0
    for the positions, stays right."""

    def __init__(self, kind: str, layer_idx: int | None = None) -> None:
        super().__init__()
        self.kind = kind
        self.layer_idx = layer_idx

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args else kwargs["hidden_states"]
        zeros = torch.zeros_like(hidden)
        if self.kind == MLP:
            return zeros
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None and hasattr(cache, "update") and self.layer_idx is not None:
            empty = hidden.new_zeros(hidden.shape[0], 1, hidden.shape[1], 0)
            cache.update(empty, empty, self.layer_idx)
        return zeros, None

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, layer_idx={self.layer_idx}"


class RemovedPart(nn.Module):
    """A removed sub-layer's pre-norm or branch scale: the identity, with no
    parameters (its output only fed the removed branch, or scaled zeros)."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return x


def _child(block: nn.Module, names: Sequence[str]) -> str | None:
    found = [n for n in names if isinstance(getattr(block, n, None), nn.Module)]
    return found[0] if len(found) == 1 else None


def _owns_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _block_sublayers(index: int, path: str, block: nn.Module) -> list[SubLayer]:
    """The sub-layers of one block still present (a removed one is gone),
    or a ``ValueError`` naming what the block's layout lacks."""
    found: list[SubLayer] = []
    claimed: set[str] = set()
    for kind in KINDS:
        main, norm = _child(block, _MAIN[kind]), _child(block, _NORM[kind])
        if main is None or norm is None:
            raise ValueError(
                f"{type(block).__name__} at {path!r} has no {kind} sub-layer toast can name "
                f"(a main module among {list(_MAIN[kind])} with a pre-norm among "
                f"{list(_NORM[kind])}); sub-layer pruning supports pre-norm blocks such as "
                "Llama's, Qwen2's, GPT-2's, ViT's and DINOv2's"
            )
        scale = _child(block, _SCALE[kind])
        children = (main, norm) if scale is None else (main, norm, scale)
        claimed.update(children)
        if not isinstance(getattr(block, main), ZeroBranch):
            found.append(SubLayer(index, kind, path, children))
    stray = [n for n, m in block.named_children() if n not in claimed and _owns_parameters(m)]
    if stray:
        raise ValueError(
            f"{type(block).__name__} at {path!r} has parameterised parts outside its "
            f"attention and MLP sub-layers ({stray}); sub-layer pruning supports plain "
            "pre-norm blocks only"
        )
    return found


def find_sublayers(stack: BlockStack) -> list[SubLayer]:
    """Every sub-layer still present in the blocks of ``stack``, block by
    block, attention before MLP. Raises ``ValueError`` for a block layout
    toast cannot split (see the module docstring)."""
    found: list[SubLayer] = []
    for index, block in enumerate(stack.blocks):
        found += _block_sublayers(index, f"{stack.path}.{index}", block)
    return found


def sublayer_params(block: nn.Module, sub: SubLayer) -> int:
    """Parameters the sub-layer holds (what its removal takes away; a
    tensor shared with the rest of the model would not go, and counts 0)."""
    mine = {id(p): p for name in sub.children for p in getattr(block, name).parameters()}
    others = {
        id(p) for n, m in block.named_children() if n not in sub.children for p in m.parameters()
    }
    return sum(p.numel() for k, p in mine.items() if k not in others)


def branch_output(output: Any) -> torch.Tensor:
    """The residual-stream tensor of a sub-layer child's output (the first
    element of an attention's tuple)."""
    return output[0] if isinstance(output, tuple) else output


def remove_sublayer(block: nn.Module, sub: SubLayer) -> None:
    """Replaces ``sub``'s modules in ``block``, in place: the main module by
    a :class:`ZeroBranch`, its pre-norm and scale by :class:`RemovedPart`."""
    main = getattr(block, sub.main)
    layer_idx = getattr(main, "layer_idx", None)
    setattr(
        block, sub.main, ZeroBranch(sub.kind, layer_idx if isinstance(layer_idx, int) else None)
    )
    for name in sub.children[1:]:
        setattr(block, name, RemovedPart())


def zero_branch(block: nn.Module, sub: SubLayer) -> None:
    """``sub``'s contribution to the residual stream set to exactly zero by
    its weights, the block's modules kept: every parameter of its main
    module (and of its branch scale) replaced by zeros, so the branch ends
    in a product with zeros. For a block loaded from a checkpoint on disk,
    whose module objects load again for the next sweep: a replacement of
    modules (:func:`remove_sublayer`) would outlive this load, new weights
    do not. The sum ``h + 0`` is ``h``, as with :class:`ZeroBranch`."""
    for name in (sub.main, *sub.children[2:]):
        for module in getattr(block, name).modules():
            for key, param in list(module._parameters.items()):
                if param is not None:
                    module._parameters[key] = nn.Parameter(
                        torch.zeros_like(param), requires_grad=False
                    )


def removed_parts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module of ``model`` a removal put in, with its path."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (ZeroBranch, RemovedPart))]


def replacement(kind: str, layer_idx: int | None) -> nn.Module:
    """The module a saved removal names: ``"attention"`` / ``"mlp"`` give a
    :class:`ZeroBranch`, ``"identity"`` a :class:`RemovedPart`."""
    if kind == "identity":
        return RemovedPart()
    if kind not in KINDS:
        raise ValueError(
            f"a removed sub-layer part is 'attention', 'mlp' or 'identity'; got {kind!r}"
        )
    return ZeroBranch(kind, layer_idx)


@contextlib.contextmanager
def zeroed(stack: BlockStack, subs: Sequence[SubLayer]) -> Iterator[None]:
    """``subs``' contributions to the residual stream set to zero while the
    context lasts (forward hooks on the branch's last module; the model is
    not changed): the removal measured without building a copy."""

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, tuple):
            return (torch.zeros_like(output[0]), *output[1:])
        return torch.zeros_like(output)

    handles = [getattr(stack.blocks[s.block], s.last).register_forward_hook(hook) for s in subs]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
