"""Translators as ``nn.Module``s and replacing spans of blocks in place.

A fitted :class:`toast.core.Translator` (float64, ``y = x W + b``) becomes a
module in the model's dtype and device; :func:`replace_spans` removes the
blocks of each span from the model's block list and puts one translator
block in their place, so parameters of removed blocks are freed and
``state_dict``, ``.to()`` and ``.eval()`` reach the translators.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from toast.core import Translator
from toast.hf.model.blocks import BlockStack, find_blocks
from toast.spans import validate_spans
from toast.translators.block import TranslatorBlock, translator_module

__all__ = [
    "prune_config",
    "remove_blocks",
    "replace_spans",
    "translator_like",
]


def _renumber_layers(blocks: nn.ModuleList | nn.Sequential) -> None:
    # Attention modules index the KV cache by layer_idx; keep it equal to
    # the block's new position.
    for position, block in enumerate(blocks):
        for module in block.modules():
            if isinstance(getattr(module, "layer_idx", None), int):
                setattr(module, "layer_idx", position)  # noqa: B010 (nn.Module typing)


def _backbone_outputs(config, kept: Sequence[int | tuple[int, int]], total: int) -> dict | None:
    """New ``stage_names`` / ``out_indices`` / ``out_features`` of a backbone
    config, or None when the config has none. Stage k is state k (stage 0
    the stem); a stage inside a removed span has no equivalent."""
    names = getattr(config, "stage_names", None)
    indices = getattr(config, "out_indices", None)
    if not isinstance(names, list) or len(names) != total + 1 or indices is None:
        return None
    # state reproduced by each new position: block b gives state b + 1, a
    # translator for blocks[a:b] gives state b
    produced = {0: 0}
    for position, k in enumerate(kept):
        produced[(k + 1) if isinstance(k, int) else k[1]] = position + 1
    new_indices = []
    for index in indices:
        state = index % (total + 1)
        if state not in produced:
            raise ValueError(
                f"the backbone outputs stage {names[state]!r}, which lies inside a replaced "
                "span; choose spans that keep it or change config.out_indices first"
            )
        new_indices.append(produced[state])
    new_names = ["stem"] + [f"stage{p}" for p in range(1, len(kept) + 1)]
    return {
        "stage_names": new_names,
        "out_indices": type(indices)(new_indices),
        "out_features": [new_names[p] for p in new_indices],
    }


def _update_config(
    config, kept: Sequence[int | tuple[int, int]], total: int, backbone: dict | None
) -> None:
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(getattr(config, name, None), int) and getattr(config, name) == total:
            setattr(config, name, len(kept))
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, list) and len(layer_types) == total:
        # a translator takes the type of the first block it replaces
        config.layer_types = [layer_types[k if isinstance(k, int) else k[0]] for k in kept]
    if backbone is not None:
        config._out_features = backbone["out_features"]  # set together, bypassing
        config._out_indices = list(backbone["out_indices"])  # the pairwise validation
        config.stage_names = backbone["stage_names"]


def _install_blocks(
    model: nn.Module,
    stack: BlockStack,
    new_blocks: list[nn.Module],
    kept: Sequence[int | tuple[int, int]],
) -> None:
    """Puts ``new_blocks`` in place of the block list, renumbers ``layer_idx``
    and updates the config. ``kept`` says what each new position holds: an
    original block index, or the ``(start, stop)`` span a translator
    replaces. Refuses (before changing anything) a patch that would remove
    a backbone output."""
    total = stack.num_blocks
    config = getattr(model, "config", None)
    backbone = None if config is None else _backbone_outputs(config, kept, total)
    holder_path, _, attr = stack.path.rpartition(".")
    holder = model.get_submodule(holder_path) if holder_path else model
    # the same container: a timm model's forward calls its nn.Sequential of blocks
    if isinstance(stack.blocks, nn.Sequential):
        setattr(holder, attr, nn.Sequential(*new_blocks))
    else:
        setattr(holder, attr, nn.ModuleList(new_blocks))
    _renumber_layers(getattr(holder, attr))
    if config is not None:
        _update_config(config, kept, total, backbone)


def translator_like(fit: Translator | nn.Module, like: nn.Module) -> nn.Module:
    """``fit`` as a module: a fitted :class:`toast.core.Translator` converted in
    the dtype and device of ``like`` (the first block it replaces; float32
    on the CPU when that has no parameters), a module as it is."""
    if not isinstance(fit, Translator):
        return fit
    reference = next(like.parameters(), None)
    return translator_module(
        fit,
        dtype=reference.dtype if reference is not None else torch.float32,
        device=reference.device if reference is not None else "cpu",
    )


def replace_spans(
    model: nn.Module,
    spans: Sequence[tuple[int, int]],
    translators: Sequence[Translator | nn.Module],
    blocks: str | BlockStack | None = None,
) -> nn.Module:
    """Replaces ``blocks[start:stop]`` of each span by its translator, in place.

    ``translators`` are fitted :class:`toast.core.Translator` objects (converted
    to modules in the dtype and device of the first removed block) or ready
    modules. The block list is rebuilt, ``layer_idx`` attributes are
    renumbered and ``config.num_hidden_layers`` (and ``config.layer_types``)
    follow. Returns the model.
    """
    if len(spans) != len(translators):
        raise ValueError(f"got {len(spans)} spans but {len(translators)} translators")
    stack = find_blocks(model, blocks)
    total = stack.num_blocks
    order = sorted(range(len(spans)), key=lambda k: tuple(spans[k]))
    checked = validate_spans(spans, total)
    old = list(stack.blocks)
    new_blocks: list[nn.Module] = []
    kept: list[int | tuple[int, int]] = []
    position = 0
    for (start, stop), k in zip(checked, order, strict=True):
        new_blocks.extend(old[position:start])
        kept.extend(range(position, start))
        module = translator_like(translators[k], old[start])
        new_blocks.append(TranslatorBlock(module, (start, stop), like=old[start]))
        kept.append((start, stop))
        position = stop
    new_blocks.extend(old[position:])
    kept.extend(range(position, total))
    for block in new_blocks:
        if isinstance(block, TranslatorBlock):
            block.train(model.training)  # e.g. no Res-MLP dropout in an eval model
    _install_blocks(model, stack, new_blocks, kept)
    _guard_save(model)
    return model


class _RefusedSave:
    """``save_pretrained`` of a model holding translator blocks while
    :mod:`toast.io` is not loaded: transformers' own would write a checkpoint
    whose translator slots reload as freshly initialised blocks."""

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise TypeError(
            "this model holds toast translator blocks, which transformers' save_pretrained "
            "cannot describe (they would reload as new random blocks); save it with "
            "toast.save_pretrained(model, path), or import toast.io first"
        )


# The guard toast.io installs (a model's save_pretrained writing a toast save);
# shared infrastructure below io cannot import it, so io registers it here.
_SAVE_GUARD: list[Callable[[nn.Module], object]] = []


def set_save_guard(guard: Callable[[nn.Module], object]) -> None:
    """Makes :func:`replace_spans` apply ``guard`` to every patched model."""
    _SAVE_GUARD[:] = [guard]


def _guard_save(model: nn.Module) -> None:
    if _SAVE_GUARD:
        _SAVE_GUARD[0](model)
    elif callable(getattr(type(model), "save_pretrained", None)):
        object.__setattr__(model, "save_pretrained", _RefusedSave())


def remove_blocks(
    model: nn.Module, spans: Sequence[tuple[int, int]], blocks: str | BlockStack | None = None
) -> nn.Module:
    """Deletes ``blocks[start:stop]`` of each span, in place, with nothing in
    their place (depth pruning).

    As in :func:`replace_spans`, the block list is rebuilt, ``layer_idx``
    attributes are renumbered and ``config.num_hidden_layers``,
    ``config.layer_types`` and backbone outputs follow; any other config list
    with one entry per block (a name containing ``layer``, e.g. SmolLM3's
    ``no_rope_layers``) keeps the entries of the kept blocks. At least one
    block must remain. Returns the model.
    """
    stack = find_blocks(model, blocks)
    total = stack.num_blocks
    removed = {b for start, stop in validate_spans(spans, total) for b in range(start, stop)}
    kept = [b for b in range(total) if b not in removed]
    if not kept:
        raise ValueError(f"spans {list(spans)} would remove all {total} blocks")
    _install_blocks(model, stack, [stack.blocks[b] for b in kept], kept)
    config = getattr(model, "config", None)
    if config is not None:
        _keep_per_layer_lists(config, kept, total)
    return model


def _keep_per_layer_lists(config: Any, kept: Sequence[int], total: int) -> None:
    for name, value in list(vars(config).items()):
        per_layer = isinstance(value, list) and len(value) == total
        if per_layer and "layer" in name and name not in ("layer_types", "stage_names"):
            setattr(config, name, [value[b] for b in kept])


def prune_config(config: Any, kept: Sequence[int], total: int) -> None:
    """Updates ``config`` in place for a model of ``total`` blocks that keeps
    only the blocks ``kept``, exactly as :func:`remove_blocks` does (block
    counts, ``layer_types``, backbone outputs, other per-layer lists): for a
    pruned checkpoint written without the model."""
    _update_config(config, kept, total, _backbone_outputs(config, kept, total))
    _keep_per_layer_lists(config, kept, total)
