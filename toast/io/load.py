"""Loading a saved model strictly, never unpickling (see :mod:`toast.io`)."""

from __future__ import annotations

import contextlib
import errno
import importlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from toast.io.format import (
    FORMAT,
    MODULE_RE,
    NAME_RE,
    PATH_RE,
    PLAN_KEYS,
    PLAN_NAME,
    READ_VERSIONS,
    WEIGHTS_NAME,
    CorruptedSaveError,
)
from toast.io.registry import patch_named, serializer_named
from toast.io.save import sha256

__all__ = ["load_pretrained"]


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
    _check_versions(plan, file)
    missing = [key for key in PLAN_KEYS if key not in plan]
    if missing:
        raise CorruptedSaveError(f"{file} lacks the keys {missing}")
    _check_plan(plan, file)
    return plan


def _check_versions(plan: dict[str, Any], file: Path) -> None:
    """Refuses a plan this toast cannot read, or a save from another major
    version of transformers, naming the versions on both sides."""
    import transformers

    from toast import __version__

    versions = plan.get("versions")
    saved: dict[str, Any] = versions if isinstance(versions, dict) else {}
    version = plan.get("format_version")
    if version not in READ_VERSIONS:
        raise CorruptedSaveError(
            f"{file} has format version {version!r} (written by toast "
            f"{saved.get('toast', '(unknown)')}); this is toast {__version__}, which reads "
            f"format versions {list(READ_VERSIONS)}: load it with the toast that saved it"
        )
    theirs, ours = saved.get("transformers"), transformers.__version__
    if isinstance(theirs, str) and theirs.split(".")[0] != ours.split(".")[0]:
        raise ValueError(
            f"{file} was saved with transformers {theirs} (toast {saved.get('toast')}); "
            f"this is transformers {ours} (toast {__version__}), whose model classes may "
            f"differ: install transformers {theirs.split('.')[0]}.x to load it"
        )


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
    if not isinstance(plan["blocks_path"], str) or not PATH_RE.fullmatch(plan["blocks_path"]):
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
    _check_layout(plan["layout"], file)
    _check_patches(plan.get("patches", []), file)


def _check_layout(layout: Any, file: Path) -> None:
    if not isinstance(layout, list) or not layout:
        raise CorruptedSaveError(f"{file}: 'layout' must be a non-empty list")
    for position, entry in enumerate(layout):
        where = f"{file}: layout[{position}]"
        kind = entry.get("type") if isinstance(entry, dict) else None
        if kind == "block":
            continue
        serializer = serializer_named(kind)
        if serializer is None:
            raise CorruptedSaveError(f"{where} has no known block type: {kind!r}")
        try:
            serializer.check(entry)
        except ValueError as exc:
            raise CorruptedSaveError(f"{where}: {exc}") from None


def _check_patch_items(entry: dict[str, Any]) -> None:
    for lin in entry.get("linears", []):
        if not (
            isinstance(lin, dict)
            and isinstance(lin.get("module"), str)
            and PATH_RE.fullmatch(lin["module"])
            and all(
                isinstance(lin.get(k), int) and lin[k] > 0 for k in ("in_features", "out_features")
            )
            and isinstance(lin.get("bias"), bool)
        ):
            raise ValueError(f"malformed linear {lin!r}")
    for item in entry.get("attributes", []):
        if not (
            isinstance(item, dict)
            and isinstance(item.get("module"), str)
            and PATH_RE.fullmatch(item["module"])
            and isinstance(item.get("name"), str)
            and NAME_RE.fullmatch(item["name"])
            and not item["name"].startswith("_")
            and item["name"] != "training"
            and isinstance(item.get("value"), (str, int, float, bool))
        ):
            raise ValueError(f"malformed attribute {item!r}")


def _check_patches(patches: Any, file: Path) -> None:
    if not isinstance(patches, list):
        raise CorruptedSaveError(f"{file}: 'patches' must be a list")
    for position, entry in enumerate(patches):
        where = f"{file}: patches[{position}]"
        kind = entry.get("type") if isinstance(entry, dict) else None
        patch = patch_named(kind)
        if patch is None:
            raise CorruptedSaveError(
                f"{where} has the patch type {kind!r}, which no installed toast method provides"
            )
        try:
            _check_patch_items(entry)
            patch.check(entry.get("state"))
        except ValueError as exc:
            raise CorruptedSaveError(f"{where}: {exc}") from None


def _apply_patches(model: nn.Module, plan: dict[str, Any], file: Path) -> None:
    """Rebuilds the linears, sets the attributes and runs the ``prepare``
    step the patches list (the weights load afterwards)."""
    dtype = getattr(torch, plan["dtype"])
    for position, entry in enumerate(plan.get("patches", [])):
        try:
            for lin in entry.get("linears", []):
                owner, _, attr = lin["module"].rpartition(".")
                holder = model.get_submodule(owner)
                if not isinstance(getattr(holder, attr, None), nn.Linear):
                    raise ValueError(f"{lin['module']!r} is not a linear of the rebuilt model")
                new = nn.Linear(lin["in_features"], lin["out_features"], lin["bias"], dtype=dtype)
                setattr(holder, attr, new)
            for item in entry.get("attributes", []):
                setattr(model.get_submodule(item["module"]), item["name"], item["value"])
            patch = patch_named(entry["type"])
            if patch is not None and patch.prepare is not None:
                patch.prepare(model, entry.get("state"))
        except (AttributeError, ValueError) as exc:
            raise CorruptedSaveError(f"{file}: patches[{position}]: {exc}") from None


def _finish_patches(model: nn.Module, plan: dict[str, Any]) -> None:
    for entry in plan.get("patches", []):
        patch = patch_named(entry["type"])
        assert patch is not None  # checked with the plan
        patch.finish(model, entry.get("state"))


def _import_model_class(spec: dict[str, str], file: Path) -> type:
    """The ``transformers`` class named in the plan; anything outside the
    ``transformers`` package is refused, never imported."""
    from transformers import PreTrainedModel

    module, name = spec["module"], spec["name"]
    if not MODULE_RE.fullmatch(module) or not NAME_RE.fullmatch(name):
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
    except ImportError:  # pragma: no cover - transformers < 5
        no_init_weights = contextlib.nullcontext  # type: ignore[assignment]
    with no_init_weights():
        yield


def _build(plan: dict[str, Any], file: Path) -> nn.Module:
    cls: Any = _import_model_class(plan["model_class"], file)
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


def _install_blocks(model: nn.Module, plan: dict[str, Any], file: Path) -> None:
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
        serializer = serializer_named(entry["type"])
        if serializer is None:
            continue  # a block the model class built from the config
        try:
            blocks[position] = serializer.build(entry)
        except (ValueError, TypeError) as exc:
            raise CorruptedSaveError(f"{file}: layout[{position}]: {exc}") from None


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


def _check_names(
    file: Path, names: set[str], slots: dict[str, Any], aliases: dict[str, str]
) -> None:
    """The stored tensor names match the rebuilt model's slots exactly."""
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


def _read_tensors(file: Path, slots: dict[str, Any], aliases: dict[str, str]):
    """Every stored tensor, after checking names and shapes against the model."""
    from safetensors import safe_open

    loaded: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            names = set(handle.keys())
            _check_names(file, names, slots, aliases)
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
    return loaded


def _load_weights(model: nn.Module, plan: dict[str, Any], file: Path) -> None:
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
    loaded = _read_tensors(file, slots, aliases)
    # After the structural checks, whose messages say more; this catches the rest.
    expected_sha = plan["weights"].get("sha256")
    if expected_sha is not None and sha256(file) != expected_sha:
        raise CorruptedSaveError(
            f"{file} does not match the SHA-256 checksum its plan records (damaged or replaced)"
        )
    made: dict[str, torch.Tensor] = {}
    for name, (module, attr, is_param) in slots.items():
        source = aliases.get(name, name)
        if source not in made:
            tensor = loaded[source]
            if is_param:
                old = module._parameters[attr]
                grad = old.requires_grad if old is not None else True
                tensor = nn.Parameter(tensor, requires_grad=grad)
            made[source] = tensor
        if is_param:
            module._parameters[attr] = made[source]  # type: ignore[assignment]
        else:
            module._buffers[attr] = made[source]


def _is_plain_checkpoint(directory: Path) -> bool:
    """Whether ``directory`` has a ``config.json`` that is not a toast
    save's (a toast save without its plan is incomplete, not plain)."""
    from toast.io.hub_model import MODEL_TYPE  # needs transformers, as loading one does

    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") != MODEL_TYPE


def _load_plain(directory: Path) -> nn.Module:
    """A ``transformers`` checkpoint, with the class its config's
    ``architectures`` names (else ``AutoModel``), from local files only."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    if cls is None:
        cls = transformers.AutoModel
    return cls.from_pretrained(directory, local_files_only=True)


def _preview(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def load_pretrained(
    path: str | os.PathLike[str],
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
) -> nn.Module:
    """Loads a model saved by :func:`save_pretrained`, or a plain
    ``transformers`` checkpoint folder (``config.json`` and weights, no
    plan: loaded with the class its config names), in eval mode.

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
    if not plan_file.exists() and _is_plain_checkpoint(directory):
        model = _load_plain(directory)
    else:
        plan = _read_plan(directory)
        model = _build(plan, plan_file)
        _install_blocks(model, plan, plan_file)
        _apply_patches(model, plan, plan_file)
        _drop_absent_modules(model, plan)
        _cast_buffers(model, plan)
        _load_weights(model, plan, directory / WEIGHTS_NAME)
        _finish_patches(model, plan)
    if device is not None:
        model.to(device)
    if dtype is not None:
        model.to(dtype)
    return model.eval()
