"""Putting ReplaceMe's transform into the model and removing the cut blocks.

Shopkhoev et al., "ReplaceMe" (arXiv 2505.02819), §3: the transform T of a
cut ``blocks[s:e]`` acts on the MLP output ``M`` of block ``s − 1``
(``M T + Y ≈ L_e``), so it folds into that block's down-projection
(``W ← Tᵀ W``, ``b ← b T``) and the compressed model is a standard
checkpoint with no extra parameters. Appendix A.9's variant keeps T as a
separate block on the residual stream instead.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from toast.core import Translator
from toast.hf.model.blocks import BlockStack, Projection, block_parts, find_blocks, find_projections
from toast.hf.model.surgery import remove_blocks, replace_spans
from toast.spans import Span

__all__ = [
    "NotFoldableError",
    "TransformedProjection",
    "Writer",
    "apply_cuts",
    "check_cuts",
    "check_placement",
    "down_projection",
    "fold_transform",
    "folded",
    "folded_bias",
    "folded_norm",
    "residual_writer",
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


class NotFoldableError(ValueError):
    """A block's MLP output does not enter the residual stream directly, or
    not in a way the transform asked for can be folded into."""


#: Names of the norms some families apply to the MLP output before adding it
#: to the residual stream (Gemma 2/3 and OLMo-2's post_feedforward_layernorm,
#: GLM-4's post_mlp_layernorm). Hooks verify on the first batch that the one
#: found is where the MLP output enters the stream.
_POST_MLP_NORM = re.compile(r"post_?(feed_?forward|ffn|mlp)", re.IGNORECASE)


@dataclass(frozen=True)
class Writer:
    """Where a block's MLP output enters the residual stream: the
    down-projection, or a norm applied after it (``norm_path``, None when
    there is none). ReplaceMe's M is the writer's output; a full T folds
    into the down-projection only when no norm follows it, a diagonal T
    into the norm's weight exactly."""

    down: Projection
    norm_path: str | None = None
    norm: nn.Module | None = None

    @property
    def path(self) -> str:
        return self.norm_path or self.down.path

    @property
    def module(self) -> nn.Module:
        return self.norm if self.norm is not None else self.down.module

    @property
    def width(self) -> int:
        return self.down.out_features


def residual_writer(block: nn.Module) -> Writer:
    """The :class:`Writer` of ``block``: a norm of the MLP's width whose name
    says it follows the MLP, or else the down-projection."""
    down = down_projection(block)
    for name, module in block.named_modules():
        weight = getattr(module, "weight", None)
        if (
            name
            and _POST_MLP_NORM.search(name.rpartition(".")[2])
            and "norm" in type(module).__name__.lower()
            and isinstance(weight, torch.Tensor)
            and tuple(weight.shape) == (down.out_features,)
        ):
            return Writer(down, name, module)
    return Writer(down)


def norm_offset(norm: nn.Module, width: int) -> float:
    """How ``norm`` scales by its weight: 0 for ``w · x̂``, 1 for Gemma's
    ``(1 + w) · x̂``. Found by running a copy (on the CPU, float32) with the
    weight zero, then one."""
    probe = copy.deepcopy(norm)
    if any(t.is_meta for t in probe.parameters()):
        probe = probe.to_empty(device="cpu")
    probe = probe.to("cpu", torch.float32)
    x = torch.linspace(-2.0, 3.0, 2 * width).reshape(2, width)
    with torch.no_grad():
        for t in probe.parameters():
            t.zero_()
        zero = probe(x)
        _weight(probe).fill_(1.0)
        one = probe(x)
    scale = float(one.abs().max()) or 1.0
    if float(zero.abs().max()) <= 1e-6 * scale:
        return 0.0
    if torch.allclose(one, 2 * zero, rtol=1e-5, atol=1e-6 * scale):
        return 1.0
    raise ValueError(
        f"cannot tell how {type(norm).__name__} applies its weight (neither w·x̂ nor "
        "(1 + w)·x̂); use placement='block' for a separate transform"
    )


def folded_norm(
    weight: torch.Tensor, bias: torch.Tensor | None, transform: np.ndarray, offset: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A norm's weight (and bias) with a diagonal ``y ↦ y T`` folded in:
    ``(offset + w) · t − offset`` and ``b · t``, in float64, cast back."""
    t = torch.as_tensor(np.diagonal(np.asarray(transform, dtype=np.float64)).copy())
    w = weight.detach().to("cpu", torch.float64)
    new_w = ((offset + w) * t - offset).to(weight.dtype).to(weight.device)
    if bias is None:
        return new_w, None
    new_b = (bias.detach().to("cpu", torch.float64) * t).to(bias.dtype).to(bias.device)
    return new_w, new_b


def is_diagonal(transform: np.ndarray) -> bool:
    t = np.asarray(transform)
    return bool(np.all(t == np.diag(np.diagonal(t))))


def check_placement(writer: Writer, index: int, structure: str, placement: str) -> None:
    """Refuses a full T folded where a norm follows the MLP."""
    if writer.norm is None or placement != "fold" or structure == "diagonal":
        return
    raise NotFoldableError(
        f"block {index} applies {writer.norm_path} ({type(writer.norm).__name__}) to its MLP "
        f"output: a {structure} T cannot be folded into {writer.down.path}. Use "
        f"structure='diagonal' (folded exactly into {writer.norm_path}'s weight; a standard "
        f"checkpoint), placement='mlp' (T kept as a module after {writer.norm_path}; d² "
        "parameters) or placement='block' (a separate transform on the residual stream)"
    )


def check_cuts(
    stack: BlockStack, spans: Sequence[Span], structure: str, placement: str, objective: str
) -> None:
    """:func:`check_placement` for the block before each cut (before the
    estimation pass)."""
    if objective == "identity" or placement == "block":
        return
    for span in spans:
        index = span.start - 1
        check_placement(residual_writer(stack.blocks[index]), index, structure, placement)


def fold_into_writer(writer: Writer, transform: np.ndarray | torch.Tensor) -> None:
    """Folds ``y ↦ y T`` into the writer, in place: the down-projection
    (:func:`fold_transform`), or a diagonal T into the norm after it."""
    if writer.norm is None:
        fold_transform(writer.down, transform)
        return
    t = np.asarray(transform, dtype=np.float64)
    if not is_diagonal(t):
        raise ValueError(
            f"only a diagonal T folds into {writer.norm_path}; use structure='diagonal'"
        )
    offset = norm_offset(writer.norm, writer.width)
    bias = getattr(writer.norm, "bias", None)
    bias = bias if isinstance(bias, torch.Tensor) else None
    weight = _weight(writer.norm)
    with torch.no_grad():
        new_w, new_b = folded_norm(weight, bias, t, offset)
        weight.copy_(new_w)
        if bias is not None and new_b is not None:
            bias.copy_(new_b)


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
                "place; use toast.compress(folder, ..., method='replaceme', output=...) (or "
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


def _wrap_writer(block: nn.Module, writer: Writer, transform: np.ndarray) -> None:
    parent_path, _, name = writer.path.rpartition(".")
    parent = block.get_submodule(parent_path) if parent_path else block
    setattr(parent, name, TransformedProjection(writer.module, transform))


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
    if placement == "block":
        _apply_blocks(model, stack, where, transforms, structure)
        return
    current = find_blocks(model, stack)
    for span, t in zip(spans, transforms, strict=True):
        if t is None:
            continue
        block = current.blocks[span.start - 1]
        writer = residual_writer(block)
        if placement == "fold":
            fold_into_writer(writer, t)
        else:
            _wrap_writer(block, writer, t)
    remove_blocks(model, where, blocks=stack)


def _apply_blocks(
    model: nn.Module,
    stack: BlockStack,
    where: Sequence[tuple[int, int]],
    transforms: Sequence[np.ndarray | None],
    structure: str,
) -> None:
    """``placement="block"``: each fitted cut replaced by a translator block
    applying T to the residual stream (what the held-out check measured:
    T on the whole output of the block before the cut), each cut without a
    transform removed plainly."""
    kind = "diagonal" if structure == "diagonal" else "linear"
    fitted = [(cut, t) for cut, t in zip(where, transforms, strict=True) if t is not None]
    if fitted:
        translators = [_linear_translator(np.asarray(t), kind) for _, t in fitted]
        replace_spans(model, [cut for cut, _ in fitted], translators, blocks=stack)
    # a translator block stands where its cut's blocks were: later indices move
    plain = [
        (a - shift, b - shift)
        for a, b in (cut for cut, t in zip(where, transforms, strict=True) if t is None)
        for shift in [sum(d - c - 1 for (c, d), _ in fitted if d <= a)]
    ]
    if plain:
        remove_blocks(model, plain, blocks=stack)
