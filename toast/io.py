"""Saving and loading patched Hugging Face models: safetensors + a JSON plan.

:func:`save_pretrained` writes a directory holding two files:

- ``model.safetensors``: the model's state dict (tensors shared by several
  names, such as tied input/output embeddings, are stored once);
- ``toast_plan.json``: how to rebuild the module tree: the ``transformers``
  model class, the (patched) config, the dtype, the path of the block list
  and, for each position of the block list, either ``{"type": "block"}`` or
  the translator that stands there (the span it replaces, its JSON spec and
  the plain attributes of its :class:`toast.TranslatorBlock`). A small
  human-readable ``summary`` heads the plan.

:func:`load_pretrained` rebuilds the model from the config (without random
initialisation), puts translator blocks at their positions and loads the
tensors strictly: every tensor must be present with its shape, none may be
left over. Nothing on that path unpickles: the weights are safetensors, the
plan is JSON, and the model class must be one that ``transformers`` itself
defines.

Writes are atomic: everything goes into a hidden temporary directory next to
the target (files fsynced, the plan written last), which is then renamed to
the target. A directory without a complete plan is never taken for a model.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import importlib
import json
import os
import re
import secrets
import shutil
import stat
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from toast.hf import find_blocks
from toast.patch import TranslatorBlock
from toast.translators import build_translator, translator_spec

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "PLAN_NAME",
    "WEIGHTS_NAME",
    "CorruptedSaveError",
    "load_pretrained",
    "save_pretrained",
]

FORMAT = "toast.patched_model"
FORMAT_VERSION = 1
PLAN_NAME = "toast_plan.json"
WEIGHTS_NAME = "model.safetensors"

_PLAN_KEYS = (
    "model_class",
    "config",
    "dtype",
    "blocks_path",
    "layout",
    "modules",
    "buffer_dtypes",
    "weights",
)
_MODULE_RE = re.compile(r"transformers(\.[A-Za-z_][A-Za-z0-9_]*)*")
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PATH_RE = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")


class CorruptedSaveError(ValueError):
    """A saved model cannot be loaded: a file is missing, truncated, not
    valid JSON/safetensors, or does not match the plan. The message names
    the file."""


# --------------------------------------------------------------------------
# saving


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
    if _MODULE_RE.fullmatch(module) and _NAME_RE.fullmatch(name):
        found = getattr(importlib.import_module(module), name, None)
    if found is not cls:
        raise TypeError(
            f"{module}.{name} is not a class defined by the transformers package; "
            "toast saves only models whose class it can rebuild from transformers"
        )
    return {"module": module, "name": name}


def _plain_attributes(block: TranslatorBlock) -> dict[str, Any]:
    # What TranslatorBlock copied from the block it replaced (attention_type,
    # layer_idx, ...); `training` follows model.eval() and `span` is saved apart.
    return {
        name: value
        for name, value in vars(block).items()
        if not name.startswith("_")
        and name not in ("training", "span")
        and isinstance(value, (str, int, float, bool))
    }


def _aliases(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Splits ``state`` into the tensors to store and ``{alias: stored name}``
    for names that are the very same tensor view as an earlier name (tied
    weights)."""
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    views: dict[tuple, str] = {}
    storages: set[tuple] = set()
    for name, tensor in state.items():
        tensor = tensor.detach()
        storage = (tensor.device, tensor.untyped_storage().data_ptr())
        view = (*storage, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))
        view += (tensor.dtype,)
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


def _plan(model: nn.Module, blocks: str | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The plan of ``model`` (without the weights' byte count) and the tensors
    to store. Raises before anything is written when the model cannot be
    described."""
    import transformers

    from toast import __version__

    model_class = _model_class(model)
    stack = find_blocks(model, blocks)
    block_ids = {id(b) for b in stack.blocks}
    for name, module in model.named_modules():
        if isinstance(module, TranslatorBlock) and id(module) not in block_ids:
            raise ValueError(
                f"translator block {name!r} is not in the block list {stack.path!r}; "
                "toast saves translators that replace_spans put into the block list"
            )
    config = model.config
    num_layers = getattr(config, "num_hidden_layers", None)
    if isinstance(num_layers, int) and num_layers != stack.num_blocks:
        raise ValueError(
            f"config.num_hidden_layers is {num_layers} but {stack.path!r} holds "
            f"{stack.num_blocks} blocks; the model could not be rebuilt from its config"
        )
    layout: list[dict[str, Any]] = []
    for block in stack.blocks:
        if isinstance(block, TranslatorBlock):
            layout.append(
                {
                    "type": "translator",
                    "span": [int(block.span[0]), int(block.span[1])],
                    "translator": translator_spec(block.translator),
                    "attributes": _plain_attributes(block),
                }
            )
        else:
            layout.append({"type": "block"})
    # Modules outside the block list: a module the class builds but this model
    # lacks (ViTModel(add_pooling_layer=False)) is dropped again on load.
    prefix = stack.path + "."
    modules = [
        name
        for name, _ in model.named_modules()
        if name and name != stack.path and not name.startswith(prefix)
    ]
    buffer_dtypes = {}
    for name, module in model.named_modules():
        for buffer in module._non_persistent_buffers_set:
            value = module._buffers.get(buffer)
            if value is not None and value.is_floating_point():
                buffer_dtypes[f"{name}.{buffer}" if name else buffer] = _dtype_name(value.dtype)
    stored, aliases = _aliases(model.state_dict())
    translators = [entry for entry in layout if entry["type"] == "translator"]
    original = sum(1 for e in layout if e["type"] == "block") + sum(
        e["span"][1] - e["span"][0] for e in translators
    )
    plan = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "summary": {
            "toast_version": __version__,
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "model_class": model_class["name"],
            "blocks": len(layout),
            "original_blocks": original,
            "spans": [e["span"] for e in translators],
            "translator_kinds": dict(Counter(e["translator"]["kind"] for e in translators)),
            "parameters": sum(p.numel() for p in model.parameters()),
        },
        "model_class": model_class,
        "config": _config_dict(config, stack.num_blocks),
        "attn_implementation": getattr(config, "_attn_implementation", None),
        "dtype": _dtype_name(model.dtype),
        "blocks_path": stack.path,
        "layout": layout,
        "modules": modules,
        "buffer_dtypes": buffer_dtypes,
        "weights": {"file": WEIGHTS_NAME, "tensors": len(stored), "aliases": aliases},
    }
    return plan, stored


def _fsync_path(path: Path) -> None:
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


def _write_weights(tensors: dict[str, torch.Tensor], file: Path) -> None:
    """Writes ``tensors`` to the safetensors ``file`` and fsyncs it."""
    from safetensors.torch import save_file

    save_file(tensors, str(file), metadata={"format": "pt", "toast_format": FORMAT})
    _fsync_path(file)


def _write_plan(plan: dict[str, Any], file: Path) -> None:
    """Writes the plan JSON to ``file`` and fsyncs it."""
    text = json.dumps(plan, indent=2)
    with open(file, "w", encoding="utf-8") as handle:
        handle.write(text + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def _hidden_sibling(target: Path, tag: str) -> Path:
    # Created with os.mkdir so the final directory gets the usual permissions.
    while True:
        candidate = target.parent / f".{target.name}.{tag}-{secrets.token_hex(4)}"
        try:
            os.mkdir(candidate)
            return candidate
        except FileExistsError:  # pragma: no cover - 32 random bits collided
            continue


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
) -> Path:
    """Saves a (patched or not) ``transformers`` model to the directory ``path``.

    Writes ``model.safetensors`` and ``toast_plan.json`` (see the module
    docstring) into a hidden temporary directory next to ``path`` and renames
    it to ``path`` once complete, so an interrupted save leaves nothing at
    ``path``. An existing ``path`` raises ``FileExistsError`` unless
    ``overwrite`` is true; then a previous save (or an empty directory) is
    replaced, and the old save stays in place until the new one is complete.
    ``blocks`` names the block list when discovery fails (as in
    :func:`toast.find_blocks`). Returns the path.
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
    plan, tensors = _plan(model, blocks)  # raises before anything is written
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _hidden_sibling(target, "tmp")
    old: Path | None = None  # where the previous save sits while being swapped out
    try:
        _write_weights(tensors, tmp / WEIGHTS_NAME)
        plan["weights"]["bytes"] = (tmp / WEIGHTS_NAME).stat().st_size
        _write_plan(plan, tmp / PLAN_NAME)  # last: its presence marks a complete save
        # safetensors creates its file private (0600); give it the plan's
        # permissions, which follow the umask like any file open() creates.
        os.chmod(tmp / WEIGHTS_NAME, stat.S_IMODE((tmp / PLAN_NAME).stat().st_mode))
        _fsync_path(tmp)
        if overwrite and target.exists():
            if _exchange(tmp, target):
                old = tmp  # tmp now holds the previous save
            else:
                old = target.parent / f".{target.name}.old-{secrets.token_hex(4)}"
                os.rename(target, old)
                os.rename(tmp, target)
        else:
            os.rename(tmp, target)  # fails if a non-empty directory appeared meanwhile
        _fsync_path(target.parent)
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


# --------------------------------------------------------------------------
# loading


def _read_plan(directory: Path) -> dict[str, Any]:
    file = directory / PLAN_NAME
    if not file.is_file():
        raise CorruptedSaveError(
            f"{file} is missing: {directory} is not a complete toast save "
            "(not saved by toast.save_pretrained, or the save was interrupted)"
        )
    try:
        plan = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptedSaveError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(plan, dict):
        raise CorruptedSaveError(f"{file} holds a {type(plan).__name__}, not a JSON object")
    if plan.get("format") != FORMAT:
        raise CorruptedSaveError(
            f"{file} is not a toast plan (format {plan.get('format')!r}, expected {FORMAT!r})"
        )
    version = plan.get("format_version")
    if version != FORMAT_VERSION:
        raise CorruptedSaveError(
            f"{file} has format version {version!r}; this toast reads version {FORMAT_VERSION}"
        )
    missing = [key for key in _PLAN_KEYS if key not in plan]
    if missing:
        raise CorruptedSaveError(f"{file} lacks the keys {missing}")
    _check_plan(plan, file)
    return plan


def _check_plan(plan: dict[str, Any], file: Path) -> None:
    def bad(what: str) -> CorruptedSaveError:
        return CorruptedSaveError(f"{file}: {what}")

    cls = plan["model_class"]
    if not (isinstance(cls, dict) and isinstance(cls.get("module"), str)):
        raise bad("'model_class' must be an object with 'module' and 'name' strings")
    if not isinstance(cls.get("name"), str):
        raise bad("'model_class' must be an object with 'module' and 'name' strings")
    if not isinstance(plan["config"], dict):
        raise bad("'config' must be an object")
    if not isinstance(plan["dtype"], str) or not isinstance(
        getattr(torch, plan["dtype"], None), torch.dtype
    ):
        raise bad(f"'dtype' {plan['dtype']!r} is not a torch dtype")
    if not isinstance(plan["blocks_path"], str) or not _PATH_RE.fullmatch(plan["blocks_path"]):
        raise bad(f"'blocks_path' {plan['blocks_path']!r} is not a dotted attribute path")
    if not isinstance(plan["modules"], list) or not all(
        isinstance(m, str) for m in plan["modules"]
    ):
        raise bad("'modules' must be a list of strings")
    buffers = plan["buffer_dtypes"]
    if not isinstance(buffers, dict) or not all(
        isinstance(v, str) and isinstance(getattr(torch, v, None), torch.dtype)
        for v in buffers.values()
    ):
        raise bad("'buffer_dtypes' must map buffer names to torch dtype names")
    weights = plan["weights"]
    if not (
        isinstance(weights, dict)
        and isinstance(weights.get("bytes"), int)
        and isinstance(weights.get("aliases"), dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in weights["aliases"].items())
    ):
        raise bad("'weights' must hold 'bytes' (an integer) and 'aliases' (names to names)")
    layout = plan["layout"]
    if not isinstance(layout, list) or not layout:
        raise bad("'layout' must be a non-empty list")
    for position, entry in enumerate(layout):
        where = f"layout[{position}]"
        if not isinstance(entry, dict) or entry.get("type") not in ("block", "translator"):
            raise bad(f"{where} must be an object of type 'block' or 'translator'")
        if entry["type"] == "block":
            continue
        span = entry.get("span")
        if not (
            isinstance(span, list)
            and len(span) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in span)
            and 0 <= span[0] < span[1]
        ):
            raise bad(f"{where}: 'span' must be [start, stop] with 0 <= start < stop")
        if not isinstance(entry.get("translator"), dict):
            raise bad(f"{where}: 'translator' must be a translator spec object")
        attributes = entry.get("attributes", {})
        if not isinstance(attributes, dict) or not all(
            isinstance(v, (str, int, float, bool)) for v in attributes.values()
        ):
            raise bad(f"{where}: 'attributes' must map names to plain values")


def _import_model_class(spec: dict[str, str], file: Path) -> type:
    """The ``transformers`` class named in the plan; anything outside the
    ``transformers`` package is refused, never imported."""
    from transformers import PreTrainedModel

    module, name = spec["module"], spec["name"]
    if not _MODULE_RE.fullmatch(module) or not _NAME_RE.fullmatch(name):
        raise ValueError(
            f"{file}: refusing to load model class {module}.{name}: toast only builds "
            "model classes defined by the transformers package"
        )
    try:
        cls = getattr(importlib.import_module(module), name, None)
    except ImportError as exc:
        raise CorruptedSaveError(f"{file}: cannot import {module}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)):
        raise ValueError(
            f"{file}: {module}.{name} is not a transformers model class; refusing to load it"
        )
    return cls


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """Skips random weight initialisation while a model is built (the
    weights are loaded right after). Non-persistent buffers such as rotary
    frequencies are still computed, on the CPU."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - older transformers
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:
            no_init_weights = contextlib.nullcontext
    with no_init_weights():
        yield


def _build(plan: dict[str, Any], file: Path) -> nn.Module:
    cls = _import_model_class(plan["model_class"], file)
    dtype = getattr(torch, plan["dtype"])
    kwargs: dict[str, Any] = {"dtype": dtype}
    if isinstance(plan.get("attn_implementation"), str):
        kwargs["attn_implementation"] = plan["attn_implementation"]
    try:
        config = cls.config_class.from_dict(dict(plan["config"]))
        with _no_init():
            model = cls._from_config(config, **kwargs)
    except Exception as exc:
        raise CorruptedSaveError(
            f"{file}: cannot build {cls.__name__} from the saved config: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return model


def _install_translators(model: nn.Module, plan: dict[str, Any], file: Path) -> None:
    path, layout = plan["blocks_path"], plan["layout"]
    try:
        blocks = model.get_submodule(path)
    except AttributeError:
        raise CorruptedSaveError(
            f"{file}: the rebuilt {type(model).__name__} has no block list {path!r}"
        ) from None
    if not isinstance(blocks, nn.ModuleList) or len(blocks) != len(layout):
        found = len(blocks) if isinstance(blocks, nn.ModuleList) else type(blocks).__name__
        raise CorruptedSaveError(
            f"{file}: the rebuilt model has {found} blocks at {path!r} but the plan "
            f"lists {len(layout)}"
        )
    for position, entry in enumerate(layout):
        if entry["type"] != "translator":
            continue
        try:
            translator = build_translator(entry["translator"])
        except (ValueError, TypeError) as exc:
            raise CorruptedSaveError(f"{file}: layout[{position}]: {exc}") from None
        block = TranslatorBlock(translator, tuple(entry["span"]))
        for name, value in entry.get("attributes", {}).items():
            if (
                hasattr(TranslatorBlock, name)
                or name in ("training", "span", "translator")
                or (not _NAME_RE.fullmatch(name))
            ):
                raise CorruptedSaveError(
                    f"{file}: layout[{position}]: attribute {name!r} cannot be set"
                )
            setattr(block, name, value)
        blocks[position] = block


def _drop_absent_modules(model: nn.Module, plan: dict[str, Any]) -> None:
    """Removes modules that the class builds but the saved model did not have
    (e.g. the pooler of ``ViTModel(config, add_pooling_layer=False)``)."""
    saved = set(plan["modules"])
    block_path = plan["blocks_path"]
    for name, _ in list(model.named_modules()):
        if not name or name == block_path or name.startswith(block_path + "."):
            continue
        parent, _, attr = name.rpartition(".")
        if name not in saved and (not parent or parent in saved):
            holder = model.get_submodule(parent) if parent else model
            if getattr(holder, attr, None) is not None:
                setattr(holder, attr, None)


def _cast_buffers(model: nn.Module, plan: dict[str, Any]) -> None:
    for name, dtype_name in plan["buffer_dtypes"].items():
        owner, _, attr = name.rpartition(".")
        try:
            module = model.get_submodule(owner) if owner else model
        except AttributeError:
            continue
        value = module._buffers.get(attr)
        dtype = getattr(torch, dtype_name)
        if value is not None and value.dtype != dtype:
            module._buffers[attr] = value.to(dtype)


def _state_slots(model: nn.Module) -> dict[str, tuple[nn.Module, str, bool]]:
    """Every state-dict name of ``model`` → (owning module, attribute, is a
    parameter), tied names included."""
    slots = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        head = f"{prefix}." if prefix else ""
        for name, value in module._parameters.items():
            if value is not None:
                slots[head + name] = (module, name, True)
        for name, value in module._buffers.items():
            if value is not None and name not in module._non_persistent_buffers_set:
                slots[head + name] = (module, name, False)
    return slots


def _load_weights(model: nn.Module, plan: dict[str, Any], file: Path) -> None:
    from safetensors import safe_open

    expected_bytes = plan["weights"]["bytes"]
    if not file.is_file():
        raise CorruptedSaveError(f"{file} is missing")
    size = file.stat().st_size
    if size != expected_bytes:
        raise CorruptedSaveError(
            f"{file} has {size} bytes but the plan records {expected_bytes} (truncated or replaced)"
        )
    slots = _state_slots(model)
    aliases: dict[str, str] = plan["weights"]["aliases"]
    loaded: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            names = set(handle.keys())
            unexpected = sorted(names - slots.keys())
            if unexpected:
                raise CorruptedSaveError(
                    f"{file} holds tensors the rebuilt model does not have: {_preview(unexpected)}"
                )
            missing = sorted(slots.keys() - names - aliases.keys())
            if missing:
                raise CorruptedSaveError(f"{file} lacks the tensors {_preview(missing)}")
            for alias, source in aliases.items():
                if alias not in slots or source not in names:
                    raise CorruptedSaveError(
                        f"{file}: tied tensor {alias!r} → {source!r} does not match the model"
                    )
            for name in sorted(names):
                module, attr, _ = slots[name]
                want = tuple(getattr(module, attr).shape)
                have = tuple(handle.get_slice(name).get_shape())
                if have != want:
                    raise CorruptedSaveError(
                        f"{file}: tensor {name!r} has shape {list(have)}, the model "
                        f"expects {list(want)}"
                    )
            for name in sorted(names):
                loaded[name] = handle.get_tensor(name)
    except CorruptedSaveError:
        raise
    except Exception as exc:
        raise CorruptedSaveError(
            f"{file} is not a readable safetensors file: {type(exc).__name__}: {exc}"
        ) from None
    made: dict[str, torch.Tensor] = {}
    for name, (module, attr, is_param) in slots.items():
        source = aliases.get(name, name)
        if source not in made:
            tensor = loaded[source]
            if is_param:
                old = module._parameters[attr]
                tensor = nn.Parameter(tensor, requires_grad=old.requires_grad)
            made[source] = tensor
        if is_param:
            module._parameters[attr] = made[source]
        else:
            module._buffers[attr] = made[source]


def _preview(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def load_pretrained(
    path: str | os.PathLike[str],
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
) -> nn.Module:
    """Loads a model saved by :func:`save_pretrained`, in eval mode.

    The model is rebuilt in the saved dtype, its translators put back and its
    tensors loaded strictly; then it moves to ``device`` and is cast to
    ``dtype`` when those are given. Raises ``FileNotFoundError`` when
    ``path`` does not exist and :class:`CorruptedSaveError` (a
    ``ValueError``) naming the file when a file is missing, damaged or
    inconsistent; a model class outside ``transformers`` is refused with a
    ``ValueError``.
    """
    directory = Path(path)
    if not directory.exists():
        raise FileNotFoundError(errno.ENOENT, f"no saved model at {directory}", str(directory))
    if not directory.is_dir():
        raise CorruptedSaveError(f"{directory} is not a directory saved by toast.save_pretrained")
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"dtype {dtype!r} is not a torch dtype")
        dtype = resolved
    plan_file = directory / PLAN_NAME
    plan = _read_plan(directory)
    model = _build(plan, plan_file)
    _install_translators(model, plan, plan_file)
    _drop_absent_modules(model, plan)
    _cast_buffers(model, plan)
    _load_weights(model, plan, directory / WEIGHTS_NAME)
    if device is not None:
        model.to(device)
    if dtype is not None:
        model.to(dtype)
    return model.eval()
