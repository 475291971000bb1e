"""Serializers of the non-standard blocks a compressed model may hold.

A saved plan lists, for each position of the block list, either
``{"type": "block"}`` (the model class builds it from the config) or an
entry written by the serializer that claims the block there. A method whose
output holds blocks of its own kind registers a :class:`BlockSerializer`
from its package (``toast.io`` never imports a method); translator blocks
(TOAST's replaced spans) are registered here, since translators are shared
infrastructure.

Such a block class sets ``_toast_stand_in = True`` so that block discovery
still recognises the list it stands in (as translator blocks do).

A serializer's entry is JSON only: it describes structure, never code, so
loading never unpickles. ``check`` validates an entry read from disk (raise
``ValueError`` naming the problem); ``build`` makes an uninitialised module
whose tensors the loader then fills strictly from safetensors.

Methods that change modules *inside* blocks (ToaSt narrows attention
projections and swaps MLPs for Token Channel Selection) register a
:class:`ModelPatch` instead: its entry lists the ``nn.Linear`` modules whose
shapes differ from what the config builds and the plain attributes to set
(both applied by the loader, and by the standalone ``toast_modeling.py``
written into the save), plus method state that ``finish`` re-applies after
the weights are loaded (TCS schedules and seeds).

A plan naming a type that is not registered yet is resolved through the
``toast.serializers`` entry points (a method's package registers itself on
import), so ``toast.io`` never imports a method.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from toast.io.format import NAME_RE
from toast.translators import TranslatorBlock, build_translator, translator_spec

__all__ = [
    "BlockSerializer",
    "ModelPatch",
    "model_patches",
    "patch_named",
    "register_block_serializer",
    "register_model_patch",
    "serializer_for",
    "serializer_named",
]


@dataclass(frozen=True)
class BlockSerializer:
    """How one kind of block is written to and rebuilt from a plan entry.

    ``type``: the entry's ``"type"``; ``claims(block)``: whether this
    serializer writes ``block``; ``describe(block)``: the entry's other keys
    (JSON-able); ``check(entry)``: raises ``ValueError`` if a read entry is
    malformed; ``build(entry)``: the module to put at that position.
    """

    type: str
    claims: Callable[[nn.Module], bool]
    describe: Callable[[nn.Module], dict[str, Any]]
    check: Callable[[dict[str, Any]], None]
    build: Callable[[dict[str, Any]], nn.Module]


_SERIALIZERS: dict[str, BlockSerializer] = {}


def register_block_serializer(serializer: BlockSerializer) -> BlockSerializer:
    """Adds ``serializer``; ``"block"`` is reserved for the model's own blocks."""
    if serializer.type == "block":
        raise ValueError("the entry type 'block' is reserved for the model's own blocks")
    existing = _SERIALIZERS.get(serializer.type)
    if existing is not None and existing is not serializer:
        raise ValueError(f"a serializer of type {serializer.type!r} is registered already")
    _SERIALIZERS[serializer.type] = serializer
    return serializer


def serializer_for(block: nn.Module) -> BlockSerializer | None:
    """The serializer that claims ``block``, or None for a model's own block."""
    return next((s for s in _SERIALIZERS.values() if s.claims(block)), None)


def serializer_named(type_: Any) -> BlockSerializer | None:
    """The serializer writing entries of ``type_``, or None."""
    if not isinstance(type_, str):
        return None
    if type_ not in _SERIALIZERS:
        _discover(type_)
    return _SERIALIZERS.get(type_)


@dataclass(frozen=True)
class ModelPatch:
    """Changes a method makes inside blocks, written to the plan's ``patches``.

    ``describe(model)``: None when ``model`` carries no such change, else an
    entry with ``"linears"`` (``[{"module", "in_features", "out_features",
    "bias"}]``: linears to rebuild at these shapes before the weights load),
    ``"attributes"`` (``[{"module", "name", "value"}]``: plain values to
    set), ``"state"`` (JSON for ``finish``) and ``"needs_toast"`` (whether
    outputs depend on ``finish``, which only toast can run).
    ``check(state)`` raises ``ValueError`` for a malformed state;
    ``finish(model, state)`` re-applies it once the weights are loaded;
    ``prepare(model, state)``, when given, changes the rebuilt model's
    modules before the weights load (a method that removes modules, such as
    sub-layer pruning, so that the strict load finds exactly the saved
    tensors).
    """

    type: str
    describe: Callable[[nn.Module], dict[str, Any] | None]
    check: Callable[[Any], None]
    finish: Callable[[nn.Module, Any], None]
    prepare: Callable[[nn.Module, Any], None] | None = None


_PATCHES: dict[str, ModelPatch] = {}


def register_model_patch(patch: ModelPatch) -> ModelPatch:
    """Adds ``patch`` (one per type)."""
    existing = _PATCHES.get(patch.type)
    if existing is not None and existing is not patch:
        raise ValueError(f"a model patch of type {patch.type!r} is registered already")
    _PATCHES[patch.type] = patch
    return patch


def model_patches() -> list[ModelPatch]:
    """Every registered patch, after loading the installed providers."""
    _discover(None)
    return list(_PATCHES.values())


def patch_named(type_: Any) -> ModelPatch | None:
    """The patch writing entries of ``type_``, or None."""
    if not isinstance(type_, str):
        return None
    if type_ not in _PATCHES:
        _discover(type_)
    return _PATCHES.get(type_)


_DISCOVERED: set[str] = set()


def _discover(type_: str | None) -> None:
    """Imports the ``toast.serializers`` entry point named ``type_`` (every
    one for None); importing the module registers what it provides."""
    for point in importlib.metadata.entry_points(group="toast.serializers"):
        if point.name in _DISCOVERED or (type_ is not None and point.name != type_):
            continue
        _DISCOVERED.add(point.name)
        point.load()


# -- translator blocks ---------------------------------------------------------

# Attributes a saved entry may not set on a rebuilt block: its own machinery.
_RESERVED = frozenset({"training", "span", "translator"})


def _plain_attributes(block: nn.Module) -> dict[str, Any]:
    # Plain per-layer attributes copied from the replaced block (attention_type,
    # layer_idx, ...); `training` follows model.eval() and `span` is saved apart.
    return {
        name: value
        for name, value in vars(block).items()
        if not name.startswith("_")
        and name not in ("training", "span")
        and isinstance(value, (str, int, float, bool))
    }


def _describe_translator(block: nn.Module) -> dict[str, Any]:
    assert isinstance(block, TranslatorBlock)
    return {
        "span": [int(block.span[0]), int(block.span[1])],
        "translator": translator_spec(block.translator),
        "attributes": _plain_attributes(block),
    }


def _check_translator(entry: dict[str, Any]) -> None:
    span = entry.get("span")
    if not (
        isinstance(span, list)
        and len(span) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in span)
        and 0 <= span[0] < span[1]
    ):
        raise ValueError("'span' must be [start, stop] with 0 <= start < stop")
    if not isinstance(entry.get("translator"), dict):
        raise ValueError("'translator' must be a translator spec object")
    attributes = entry.get("attributes", {})
    if not isinstance(attributes, dict) or not all(
        isinstance(v, (str, int, float, bool)) for v in attributes.values()
    ):
        raise ValueError("'attributes' must map names to plain values")
    for name in attributes:
        if hasattr(TranslatorBlock, name) or name in _RESERVED or not NAME_RE.fullmatch(name):
            raise ValueError(f"attribute {name!r} cannot be set")


def _build_translator_block(entry: dict[str, Any]) -> nn.Module:
    block = TranslatorBlock(build_translator(entry["translator"]), tuple(entry["span"]))
    for name, value in entry.get("attributes", {}).items():
        setattr(block, name, value)
    return block


TRANSLATOR = register_block_serializer(
    BlockSerializer(
        type="translator",
        claims=lambda block: isinstance(block, TranslatorBlock),
        describe=_describe_translator,
        check=_check_translator,
        build=_build_translator_block,
    )
)
