"""Putting ReplaceMe's transform into the model and removing the cut blocks.

Shopkhoev et al., "ReplaceMe" (arXiv 2505.02819), §3: the transform T of a
cut ``blocks[s:e]`` acts on the MLP output ``M`` of block ``s − 1``
(``M T + Y ≈ L_e``), so it folds into that block's down-projection
(``W ← Tᵀ W``, ``b ← b T``) and the compressed model is a standard
checkpoint with no extra parameters. Appendix A.9's variant keeps T as a
separate block on the residual stream instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from toast.core import Translator
from toast.hf.blocks import BlockStack, Projection, block_parts, find_blocks, find_projections
from toast.hf.surgery import remove_blocks, replace_spans
from toast.spans import Span

__all__ = [
    "TransformedProjection",
    "apply_cuts",
    "down_projection",
    "fold_transform",
    "folded",
    "folded_bias",
]


def down_projection(block: nn.Module) -> Projection:
    """The projection that writes a block's MLP output into the residual stream."""
    try:
        return block_parts(block).down
    except ValueError:
        # Layouts block_parts does not fully know (no recognisable
        # attention, say) may still have a recognisable down projection.
        found = find_projections(block).get("down")
        if found is None:
            raise ValueError(
                f"cannot find the MLP down-projection of {type(block).__name__} (looked for "
                "down_proj, fc2, mlp.c_proj, output.dense, mlp.Wo)"
            ) from None
        return found


def _weight(module: nn.Module) -> torch.Tensor:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(module).__name__} has no weight tensor to transform")
    return weight


_FOLD_CHUNK = 16 * 2**20


def fold_transform(projection: Projection, transform: np.ndarray | torch.Tensor) -> None:
    """Folds ``y ↦ y T`` into a projection, in place: ``W ← Tᵀ W`` for
    torch's ``(out, in)`` layout, ``W ← W T`` for GPT-2's ``Conv1D``
    ``(in, out)`` layout, and ``b ← b T`` when it has a bias (ReplaceMe §3,
    the transform merged into the down-projection). Computed in float64 on
    the CPU and cast back to the weight's dtype and device."""
    module = projection.module
    d = projection.out_features
    if np.shape(transform) != (d, d):
        raise ValueError(
            f"the transform has shape {tuple(np.shape(transform))} but {projection.path} "
            f"writes {d} features"
        )
    with torch.no_grad():
        w = _weight(module)
        if w.is_meta:
            raise ValueError(
                f"the weight of {projection.path} is on the meta device (offloaded by "
                "device_map with disk or CPU offload), so T cannot be folded into it in "
                "place; use toast.replaceme_checkpoint(folder, ...) (or "
                "toast.methods.replaceme.disk.write_replaceme with this report's spans and "
                "transforms) to write the pruned checkpoint from the files on disk"
            )
        bias = getattr(module, "bias", None)
        bias = bias if isinstance(bias, torch.Tensor) else None
        new_w, new_b = folded(w, bias, transform, projection.layout)
        w.copy_(new_w)
        if bias is not None and new_b is not None:
            bias.copy_(new_b)


def folded(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    transform: np.ndarray | torch.Tensor,
    layout: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A down-projection's weight (and bias) with ``y ↦ y T`` folded in:
    ``Tᵀ W`` for the ``"linear"`` ``(out, in)`` layout, ``W T`` for
    ``"conv1d"`` ``(in, out)``, ``b T``; in float64 on the CPU, cast back to
    each tensor's dtype and device. The one arithmetic of the in-memory fold
    and of a pruned checkpoint written from disk.

    The product runs over slices of the weight's inputs (columns of the
    ``(out, in)`` layout, rows of ``(in, out)``) of about 16 MiB in float64,
    so its memory is T and the result, not two float64 copies of the
    weight (4.3 GiB for a Llama-3-70B down-projection)."""
    t = torch.as_tensor(np.asarray(transform, dtype=np.float64))
    source = weight.detach().cpu()
    out = torch.empty(source.shape, dtype=weight.dtype)
    linear = layout == "linear"
    inputs = source.shape[1] if linear else source.shape[0]
    step = max(1, _FOLD_CHUNK // (8 * t.shape[0]))
    for lo in range(0, inputs, step):
        part = slice(lo, lo + step)
        if linear:
            out[:, part] = t.T @ source[:, part].to(torch.float64)
        else:
            out[part] = source[part].to(torch.float64) @ t
    return out.to(weight.device), None if bias is None else folded_bias(bias, transform)


def folded_bias(bias: torch.Tensor, transform: np.ndarray | torch.Tensor) -> torch.Tensor:
    """``b T`` in float64, cast back to the bias's dtype and device."""
    t = torch.as_tensor(np.asarray(transform, dtype=np.float64))
    return (bias.detach().to("cpu", torch.float64) @ t).to(bias.dtype).to(bias.device)


class TransformedProjection(nn.Module):
    """A projection followed by an explicit ``d × d`` transform,
    ``y = inner(x) @ T`` (ReplaceMe's transform before folding; ``d²`` extra
    parameters). ``transform`` is an ``nn.Linear`` without bias holding ``Tᵀ``."""

    def __init__(self, inner: nn.Module, transform: np.ndarray) -> None:
        super().__init__()
        t = torch.as_tensor(np.asarray(transform, dtype=np.float64))
        reference = _weight(inner)
        self.inner = inner
        self.transform = nn.Linear(t.shape[0], t.shape[1], bias=False, dtype=torch.float64)
        with torch.no_grad():
            self.transform.weight.copy_(t.T)
        self.transform.to(dtype=reference.dtype, device=reference.device)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.transform(self.inner(*args, **kwargs))


def _wrap_projection(block: nn.Module, projection: Projection, transform: np.ndarray) -> None:
    parent_path, _, name = projection.path.rpartition(".")
    parent = block.get_submodule(parent_path) if parent_path else block
    setattr(parent, name, TransformedProjection(projection.module, transform))


def _linear_translator(transform: np.ndarray, kind: str) -> Translator:
    d = transform.shape[0]
    return Translator(kind, transform, np.zeros(d), float("nan"), d, "replaceme")


def apply_cuts(
    model: nn.Module,
    stack: BlockStack,
    spans: Sequence[Span],
    transforms: Sequence[np.ndarray | None],
    placement: str,
    structure: str,
) -> None:
    """Applies the cuts ``spans`` with their ``transforms`` to ``model``, in place.

    ``placement="fold"`` folds each T into the down-projection of the block
    before its cut, ``"mlp"`` keeps it as a :class:`TransformedProjection`
    there, ``"block"`` replaces the cut by a translator block on the
    residual stream (ReplaceMe A.9); a None transform (UIDL) just removes
    the blocks. ``stack`` is looked up again by path, never searched for.
    """
    where = [(s.start, s.stop) for s in spans]
    if placement == "block" and all(t is not None for t in transforms):
        kind = "diagonal" if structure == "diagonal" else "linear"
        translators = [_linear_translator(np.asarray(t), kind) for t in transforms]
        replace_spans(model, where, translators, blocks=stack)
        return
    current = find_blocks(model, stack)
    for span, t in zip(spans, transforms, strict=True):
        if t is None:
            continue
        block = current.blocks[span.start - 1]
        projection = down_projection(block)
        if placement == "fold":
            fold_transform(projection, t)
        else:
            _wrap_projection(block, projection, t)
    remove_blocks(model, where, blocks=stack)
