"""Saving a patched Hugging Face model atomically (see :mod:`toast.io`)."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import importlib
import json
import os
import shutil
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from toast._scratch import hidden_sibling, owned_name
from toast.hf.model.blocks import BlockStack, find_blocks
from toast.hf.model.params import count_params
from toast.io.folder import apply_umask, copy_companions, write_card
from toast.io.format import FORMAT, FORMAT_VERSION, MODULE_RE, NAME_RE, PLAN_NAME, WEIGHTS_NAME
from toast.io.registry import model_patches, serializer_for
from toast.io.remote import write_config

__all__ = ["needs_toast_layout", "save_pretrained", "sha256"]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _model_class(model: nn.Module) -> dict[str, str]:
    """The importable location of ``model``'s class, checked to be a
    ``transformers`` model class (the only kind the loader will import)."""
    try:
        from transformers import PreTrainedModel
    except ImportError as exc:  # pragma: no cover - transformers is a dependency of toast.hf
        raise TypeError("saving a model needs transformers") from exc
    cls = type(model)
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"save_pretrained saves Hugging Face transformers models, got {cls.__name__}"
        )
    module, name = cls.__module__, cls.__qualname__
    found = None
    if MODULE_RE.fullmatch(module) and NAME_RE.fullmatch(name):
        found = getattr(importlib.import_module(module), name, None)
    if found is not cls:
        raise TypeError(
            f"{module}.{name} is not a class defined by the transformers package; "
            "toast saves only models whose class it can rebuild from transformers"
        )
    return {"module": module, "name": name}


def _aliases(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Splits ``state`` into the tensors to store and ``{alias: stored name}``
    for names that are the very same tensor view as an earlier name (tied
    weights)."""
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    views: dict[tuple, str] = {}
    storages: set[tuple] = set()
    metas: dict[int, str] = {}
    for name, tensor in state.items():
        if tensor.is_meta:
            # a model planned on the meta device (written from files on disk):
            # no storage to compare, but tied weights are one Parameter object
            if id(tensor) in metas:
                aliases[name] = metas[id(tensor)]
            else:
                metas[id(tensor)] = name
                stored[name] = tensor.detach()
            continue
        tensor = tensor.detach()
        storage = (tensor.device, tensor.untyped_storage().data_ptr())
        view = (
            *storage,
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
        )
        if tensor.numel() == 0 or storage[1] == 0:
            stored[name] = tensor.contiguous().cpu()
        elif view in views:
            aliases[name] = views[view]
        elif storage in storages:
            # another view of a stored tensor's memory: store a copy
            stored[name] = tensor.cpu().clone(memory_format=torch.contiguous_format)
        else:
            views[view] = name
            storages.add(storage)
            stored[name] = tensor.contiguous().cpu()
    return stored, aliases


def _config_dict(config: Any, num_blocks: int) -> dict[str, Any]:
    """The JSON form of ``config``, made consistent with ``num_blocks``.

    Backbone-capable configs (DINOv2, ...) derive ``stage_names`` from the
    layer count when built, so ones left from the unpatched model fail
    validation. When the outputs are the default (the last stage only) the
    three derived keys are dropped and rebuilt; other outputs would need
    remapping through the spans, which is refused.
    """
    data = json.loads(config.to_json_string(use_diff=False))
    stages = data.get("stage_names")
    if isinstance(stages, list) and len(stages) != num_blocks + 1:
        indices, features = data.get("out_indices"), data.get("out_features")
        if indices not in (None, [len(stages) - 1]) or features not in (None, stages[-1:]):
            raise ValueError(
                f"the config's backbone outputs {features} refer to the blocks before "
                "patching; toast can save a patched backbone only with the default "
                "(last stage) output"
            )
        for key in ("stage_names", "out_indices", "out_features"):
            data.pop(key, None)
    return data


def _check_savable(model: nn.Module, stack: BlockStack) -> None:
    """Raises before anything is written when ``model`` cannot be rebuilt
    from what the plan would record."""
    block_ids = {id(b) for b in stack.blocks}
    for name, module in model.named_modules():
        if serializer_for(module) is not None and id(module) not in block_ids:
            raise ValueError(
                f"{type(module).__name__} {name!r} is not in the block list {stack.path!r}; "
                "toast saves the blocks that surgery put into the block list"
            )
    num_layers = getattr(model.config, "num_hidden_layers", None)
    if isinstance(num_layers, int) and num_layers != stack.num_blocks:
        raise ValueError(
            f"config.num_hidden_layers is {num_layers} but {stack.path!r} holds "
            f"{stack.num_blocks} blocks; the model could not be rebuilt from its config"
        )


def _block_stack(model: nn.Module, blocks: str | None) -> BlockStack:
    """The block list the plan's layout describes. A model with several
    equally long lists (Swin's stages) and no stand-in block in any of them
    is described by the first: the others rebuild from the config alike."""
    try:
        return find_blocks(model, blocks)
    except ValueError:
        if blocks is not None or any(serializer_for(m) is not None for m in model.modules()):
            raise
        for name, module in model.named_modules():
            if isinstance(module, nn.ModuleList) and len(module) > 0:
                try:
                    return find_blocks(model, name)
                except ValueError:
                    continue
        raise


def _layout(stack: BlockStack) -> list[dict[str, Any]]:
    """One entry per block: ``{"type": "block"}`` or a registered serializer's."""
    layout: list[dict[str, Any]] = []
    for block in stack.blocks:
        serializer = serializer_for(block)
        if serializer is None:
            layout.append({"type": "block"})
        else:
            layout.append({"type": serializer.type, **serializer.describe(block)})
    return layout


def _outer_modules(model: nn.Module, stack: BlockStack) -> list[str]:
    # Modules outside the block list: a module the class builds but this model
    # lacks (ViTModel(add_pooling_layer=False)) is dropped again on load.
    prefix = stack.path + "."
    return [
        name
        for name, _ in model.named_modules()
        if name and name != stack.path and not name.startswith(prefix)
    ]


def _buffer_dtypes(model: nn.Module) -> dict[str, str]:
    dtypes = {}
    for name, module in model.named_modules():
        for buffer in module._non_persistent_buffers_set:
            value = module._buffers.get(buffer)
            if value is not None and value.is_floating_point():
                dtypes[f"{name}.{buffer}" if name else buffer] = _dtype_name(value.dtype)
    return dtypes


def _summary(model: nn.Module, layout: list[dict[str, Any]], model_class: str) -> dict[str, Any]:
    """The human-readable head of the plan (never read back)."""
    import transformers

    from toast import __version__

    replaced = [e for e in layout if "span" in e]
    original = sum(1 for e in layout if e["type"] == "block") + sum(
        e["span"][1] - e["span"][0] for e in replaced
    )
    return {
        "toast_version": __version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "model_class": model_class,
        "blocks": len(layout),
        "original_blocks": original,
        "spans": [e["span"] for e in replaced],
        "translator_kinds": dict(
            Counter(e["translator"]["kind"] for e in layout if e["type"] == "translator")
        ),
        "parameters": count_params(model),
    }


def _patches(model: nn.Module) -> list[dict[str, Any]]:
    """One entry per registered :class:`~toast.io.registry.ModelPatch` that
    finds its changes in ``model``."""
    entries = []
    for patch in model_patches():
        entry = patch.describe(model)
        if entry is not None:
            entries.append({"type": patch.type, **entry})
    return entries


def needs_toast_layout(model: nn.Module) -> bool:
    """Whether ``model`` holds blocks or changes that its ``transformers``
    class cannot rebuild from the config (so its own ``save_pretrained``
    would write a checkpoint that reloads different weights)."""
    return any(serializer_for(m) is not None for m in model.modules()) or bool(_patches(model))


def _versions() -> dict[str, str]:
    import transformers

    from toast import __version__

    return {"toast": __version__, "transformers": transformers.__version__}


def save_plan(
    model: nn.Module, blocks: str | None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The plan of ``model`` (without the weights' byte count) and the tensors
    to store. Raises before anything is written when the model cannot be
    described."""
    model_class = _model_class(model)  # raises for a class the loader would not rebuild
    stack = _block_stack(model, blocks)
    _check_savable(model, stack)
    layout = _layout(stack)
    stored, aliases = _aliases(model.state_dict(keep_vars=True))
    plan = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "versions": _versions(),
        "summary": _summary(model, layout, model_class["name"]),
        "model_class": model_class,
        "config": _config_dict(model.config, stack.num_blocks),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "dtype": _dtype_name(getattr(model, "dtype", torch.float32)),
        "blocks_path": stack.path,
        "layout": layout,
        "patches": _patches(model),
        "modules": _outer_modules(model, stack),
        "buffer_dtypes": _buffer_dtypes(model),
        "weights": {"file": WEIGHTS_NAME, "tensors": len(stored), "aliases": aliases},
    }
    return plan, stored


def fsync_path(path: Path) -> None:
    """Flushes ``path`` (a file or a directory's entries) to the disk."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - directories cannot be opened on Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def sha256(file: Path) -> str:
    """The hex SHA-256 of ``file``'s bytes."""
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_weights(tensors: dict[str, torch.Tensor], file: Path) -> None:
    """Writes ``tensors`` to the safetensors ``file`` and fsyncs it."""
    from safetensors.torch import save_file

    save_file(tensors, str(file), metadata={"format": "pt", "toast_format": FORMAT})
    fsync_path(file)


def _source_folder(model: nn.Module) -> Path | None:
    """The local folder ``from_pretrained`` read ``model`` from (transformers
    records it as ``config._name_or_path``), or None."""
    name = getattr(getattr(model, "config", None), "_name_or_path", None)
    if isinstance(name, str) and name and Path(name).is_dir():
        return Path(name)
    return None


def _write_folder(
    model: nn.Module,
    plan: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    tmp: Path,
    companions: dict[str, Any],
) -> None:
    """Everything of a save into the empty folder ``tmp``, the plan last."""
    _write_weights(tensors, tmp / WEIGHTS_NAME)
    finish_folder(model, plan, tmp, companions)


def finish_folder(
    model: nn.Module, plan: dict[str, Any], tmp: Path, companions: dict[str, Any]
) -> None:
    """Everything of a save but the weights, which ``tmp`` already holds:
    their size and checksum in the plan, the config, generation config,
    companions and card (``companions["name"]``: the folder ``tmp`` is
    renamed to, which the card's loading lines name), then the plan (its
    presence marks a complete save), one file mode and fsync."""
    plan["weights"]["bytes"] = (tmp / WEIGHTS_NAME).stat().st_size
    plan["weights"]["sha256"] = sha256(tmp / WEIGHTS_NAME)
    custom = write_config(plan, tmp)
    generation = getattr(model, "generation_config", None)
    if generation is not None and getattr(model, "can_generate", lambda: False)():
        generation.save_pretrained(tmp)
    tokenizer = companions.get("tokenizer")
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    copy_companions(companions.get("source") or _source_folder(model), tmp)
    name = companions.get("name") or ""  # the folder tmp becomes
    write_card(tmp, plan["summary"], companions.get("report"), custom, name)
    _write_plan(plan, tmp / PLAN_NAME)  # last: its presence marks a complete save
    # safetensors creates its file private (0600), transformers others 0644:
    # every file gets the mode the umask gives a new file.
    apply_umask(tmp)
    for file in tmp.rglob("*"):
        if file.is_file():
            fsync_path(file)


def _write_plan(plan: dict[str, Any], file: Path) -> None:
    """Writes the plan JSON to ``file`` and fsyncs it."""
    text = json.dumps(plan, indent=2)
    with open(file, "w", encoding="utf-8") as handle:
        handle.write(text + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two paths (Linux ``renameat2(RENAME_EXCHANGE)``);
    False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    return rc == 0


def _is_replaceable(path: Path) -> bool:
    # overwrite=True replaces a toast save or an empty directory, never an
    # arbitrary file or folder.
    if not path.is_dir() or path.is_symlink():
        return False
    names = {p.name for p in path.iterdir()}
    return not names or PLAN_NAME in names


def save_pretrained(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    blocks: str | None = None,
    source: str | os.PathLike[str] | None = None,
    tokenizer: Any = None,
    report: str | None = None,
) -> Path:
    """Saves a (patched or not) ``transformers`` model to the directory ``path``.

    Writes ``model.safetensors``, ``toast_plan.json``, ``config.json`` (and
    ``toast_modeling.py`` where plain ``transformers`` cannot rebuild the
    model; see :mod:`toast.io`), the generation config of a generative model
    and a model card ``README.md`` (with ``report``, a markdown compression
    report, when given). ``tokenizer`` (a tokenizer or image processor) is
    saved alongside; ``source``, the model folder the model was read from
    (default: the local folder ``from_pretrained`` read it from, if any),
    gives its tokenizer, processor and sentence-transformers files. All of it
    goes into a hidden temporary directory next to ``path``, renamed to
    ``path`` once complete, so an interrupted save leaves nothing at
    ``path``. An existing ``path`` raises ``FileExistsError`` unless
    ``overwrite`` is true; then a previous save (or an empty directory) is
    replaced, and the old save stays in place until the new one is complete.
    ``blocks`` names the block list when discovery fails (as in
    :func:`toast.hf.find_blocks`). Returns the path.
    """
    target = Path(path)
    if target.exists() or target.is_symlink():
        if not overwrite:
            raise FileExistsError(
                errno.EEXIST, f"{target} exists; pass overwrite=True to replace it", str(target)
            )
        if not _is_replaceable(target):
            raise FileExistsError(
                errno.EEXIST,
                f"{target} exists and is not a toast save; refusing to overwrite it",
                str(target),
            )
    plan, tensors = save_plan(model, blocks)  # raises before anything is written
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = hidden_sibling(target, "tmp")
    old: Path | None = None  # where the previous save sits while being swapped out
    try:
        companions = {"source": source, "tokenizer": tokenizer, "report": report}
        companions["name"] = target.name
        _write_folder(model, plan, tensors, tmp, companions)
        fsync_path(tmp)
        if overwrite and target.exists():
            if _exchange(tmp, target):
                old = tmp  # tmp now holds the previous save
            else:
                old = owned_name(target, "old")
                os.rename(target, old)
                os.rename(tmp, target)
        else:
            os.rename(tmp, target)  # fails if a non-empty directory appeared meanwhile
        fsync_path(target.parent)
    except BaseException:
        if old is not None and old != tmp and not target.exists():
            os.rename(old, target)  # put the previous save back
            old = None
        if old != tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return target
