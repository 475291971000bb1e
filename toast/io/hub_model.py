"""Rebuilding a toast save with ``transformers`` alone.

This file imports nothing from toast: :func:`toast.save_pretrained` copies it
verbatim into every save whose structure a plain ``transformers`` layout
cannot express, as ``toast_modeling.py``, and points ``config.json``'s
``auto_map`` at it. Then::

    AutoModel.from_pretrained(folder, trust_remote_code=True)

rebuilds the saved model (the ``transformers`` class recorded in the plan,
not a wrapper) where toast is not installed: translator blocks and narrowed
linears are rebuilt from the plan, the weights are checked against their
SHA-256 and loaded strictly. A save whose outputs depend on toast at run
time (Token Channel Selection) is handed to ``toast.load_pretrained``, and
refused with an ``ImportError`` where toast is missing.

toast registers :class:`ToastConfig` / :class:`ToastModel` with the Auto
classes when :mod:`toast.io` is imported (``import toast.io``, or any toast
save or load), so that in such a process ``AutoModel.from_pretrained(folder)``
and ``SentenceTransformer(folder)`` need no ``trust_remote_code``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

MODEL_TYPE = "toast"
PLAN_NAME = "toast_plan.json"
FORMAT = "toast.patched_model"
READS_FORMAT_VERSIONS = (1, 2)
_MODULE_RE = re.compile(r"transformers(\.[A-Za-z_][A-Za-z0-9_]*)*")
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PATH_RE = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")
#: The module shape each translator kind is saved as. This file runs where
#: toast is not installed, so it cannot import toast.core.kinds.KINDS, the
#: table every other reader uses: this is the one copy of it (names and
#: shapes), kept equal to the table by a test (tests/io/test_roundtrip_matrix.py).
TRANSLATOR_MODULES = {
    "identity": "identity",
    "linear": "linear",
    "affine": "linear",
    "diagonal": "diagonal",
    "orthogonal": "linear",
    "linearpatch": "linear",
    "rotated_diagonal": "linear",
    "patch_ridge": "linear",
    "mlp": "mlp",
    "resmlp": "resmlp",
}
#: Translator kinds stored as one ``nn.Linear`` (derived, for its importers).
LINEAR_KINDS = tuple(k for k, shape in TRANSLATOR_MODULES.items() if shape == "linear")


class ToastConfig(PretrainedConfig):
    """The ``config.json`` of a toast save: the saved model's own config
    fields, under the model type ``"toast"`` (the rebuild reads the plan)."""

    model_type = MODEL_TYPE


class ToastModel(PreTrainedModel):
    """Never instantiated: ``from_pretrained`` returns the rebuilt model,
    an instance of the ``transformers`` class the plan records."""

    config_class = ToastConfig

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
        directory = Path(pretrained_model_name_or_path)
        if not (directory / PLAN_NAME).is_file():
            raise OSError(f"{directory} holds no {PLAN_NAME}: it is not a toast save")
        plan = json.loads((directory / PLAN_NAME).read_text(encoding="utf-8"))
        if any(p.get("needs_toast") for p in plan.get("patches", [])):
            return _with_toast(directory, kwargs.get("dtype"))
        model = rebuild(directory, plan)
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        if isinstance(dtype, torch.dtype):
            model.to(dtype)
        return model


def _with_toast(directory: Path, dtype: Any) -> Any:
    try:  # transformers' import check skips imports inside try blocks
        from toast import load_pretrained
    except ImportError:
        raise ImportError(
            f"{directory} uses a change only toast rebuilds (Token Channel Selection, "
            "token merging, removed sub-layers) that needs toast: "
            "pip install toast, then load it with toast.load_pretrained or this call"
        ) from None
    return load_pretrained(directory, dtype=dtype if isinstance(dtype, torch.dtype) else None)


# -- translator modules (state-dict names as toast's own) ----------------------


class _Diagonal(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.bias


class _MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class _ResMLP(nn.Module):
    def __init__(self, dim: int, dropout: float) -> None:
        super().__init__()
        self.norm_in = nn.LayerNorm(dim)
        self.ff = nn.Sequential(
            nn.Linear(dim, dim), nn.SiLU(), nn.Dropout(dropout), nn.Linear(dim, dim)
        )
        self.norm_out = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm_in(x)
        return self.norm_out(h + self.ff(h))


def _translator(spec: dict[str, Any]) -> nn.Module:
    kind = spec.get("kind")
    shape = TRANSLATOR_MODULES.get(kind) if isinstance(kind, str) else None
    if shape == "identity":
        return nn.Identity()
    if shape == "diagonal":
        return _Diagonal(int(spec["dim"]))
    if shape == "mlp":
        return _MLP(int(spec["dim"]), int(spec["hidden"]))
    if shape == "resmlp":
        return _ResMLP(int(spec["dim"]), float(spec["dropout"]))
    if shape == "linear":
        return nn.Linear(int(spec["in_features"]), int(spec["out_features"]), bool(spec["bias"]))
    raise ValueError(f"unknown translator kind {kind!r}")


class TranslatorBlock(nn.Module):
    """Stands in the block list for a removed span: ``translator(hidden_states)``."""

    def __init__(self, translator: nn.Module, span: list[int]) -> None:
        super().__init__()
        self.translator = translator
        self.span = tuple(span)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self.translator(hidden_states)
        _record_hidden_state(hidden_states, out)
        return out


def _record_hidden_state(block_input: torch.Tensor, block_output: torch.Tensor) -> None:
    # transformers >= 5 records hidden_states by hooks on its own block class,
    # which a stand-in is not: record its output (and input when first) alike.
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return
    collected = _active_collector.get()
    if not isinstance(collected, dict) or "hidden_states" not in collected:
        return
    states = collected["hidden_states"]
    selection = collected.get("_hidden_states_layers")
    for state in ((block_input,) if not states else ()) + (block_output,):
        states.append(state if selection is None or len(states) in selection else None)


# -- the rebuild ---------------------------------------------------------------


def _model_class(spec: dict[str, str]) -> Any:
    module, name = spec["module"], spec["name"]
    if not (_MODULE_RE.fullmatch(module) and _NAME_RE.fullmatch(name)):
        raise ValueError(f"refusing to build {module}.{name}: not a transformers class")
    cls = getattr(importlib.import_module(module), name, None)
    if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)):
        raise ValueError(f"{module}.{name} is not a transformers model class")
    return cls


def _build(plan: dict[str, Any]) -> nn.Module:
    cls = _model_class(plan["model_class"])
    kwargs: dict[str, Any] = {"dtype": getattr(torch, plan["dtype"])}
    if isinstance(plan.get("attn_implementation"), str):
        kwargs["attn_implementation"] = plan["attn_implementation"]
    config = cls.config_class.from_dict(dict(plan["config"]))
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers < 5
        no_init_weights = contextlib.nullcontext  # type: ignore[assignment]
    with no_init_weights():
        return cls._from_config(config, **kwargs)


def _apply_structure(model: nn.Module, plan: dict[str, Any]) -> None:
    """Translator blocks into the block list, narrowed linears and their
    attributes, modules the saved model lacked dropped."""
    dtype = getattr(torch, plan["dtype"])
    blocks: Any = model.get_submodule(plan["blocks_path"])
    for position, entry in enumerate(plan["layout"]):
        if entry["type"] == "translator":
            translator = _translator(entry["translator"]).to(dtype)
            blocks[position] = TranslatorBlock(translator, entry["span"])
            for name, value in entry.get("attributes", {}).items():
                setattr(blocks[position], name, value)
        elif entry["type"] != "block":
            raise ValueError(f"block type {entry['type']!r} needs toast to load")
    for patch in plan.get("patches", []):
        for lin in patch.get("linears", []):
            owner, _, attr = lin["module"].rpartition(".")
            new = nn.Linear(lin["in_features"], lin["out_features"], lin["bias"], dtype=dtype)
            setattr(model.get_submodule(owner), attr, new)
        for item in patch.get("attributes", []):
            setattr(model.get_submodule(item["module"]), item["name"], item["value"])
    _drop_absent(model, plan)


def _drop_absent(model: nn.Module, plan: dict[str, Any]) -> None:
    saved, block_path = set(plan["modules"]), plan["blocks_path"]
    for name, _ in list(model.named_modules()):
        if not name or name == block_path or name.startswith(block_path + "."):
            continue
        parent, _, attr = name.rpartition(".")
        if name not in saved and (not parent or parent in saved):
            holder = model.get_submodule(parent) if parent else model
            if getattr(holder, attr, None) is not None:
                setattr(holder, attr, None)


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _load_weights(model: nn.Module, directory: Path, plan: dict[str, Any]) -> None:
    from safetensors.torch import load_file

    weights = plan["weights"]
    file = directory / weights.get("file", "model.safetensors")
    expected = weights.get("sha256")
    if expected is not None and _sha256(file) != expected:
        raise OSError(f"{file} does not match the SHA-256 its plan records (damaged)")
    state = load_file(str(file))
    for alias, source in weights.get("aliases", {}).items():
        state[alias] = state[source]
    for name, dtype_name in plan.get("buffer_dtypes", {}).items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        value = module._buffers.get(attr)
        if value is not None:
            module._buffers[attr] = value.to(getattr(torch, dtype_name))
    model.load_state_dict(state, strict=True)


def rebuild(directory: str | os.PathLike[str], plan: dict[str, Any] | None = None) -> nn.Module:
    """The model saved in ``directory`` by toast, in eval mode, built with
    ``transformers`` alone (see the module docstring)."""
    directory = Path(directory)
    if plan is None:
        plan = json.loads((directory / PLAN_NAME).read_text(encoding="utf-8"))
    if plan.get("format") != FORMAT or plan.get("format_version") not in READS_FORMAT_VERSIONS:
        raise ValueError(
            f"{directory / PLAN_NAME} is format {plan.get('format')!r} version "
            f"{plan.get('format_version')!r}; this toast_modeling.py reads {FORMAT!r} "
            f"versions {list(READS_FORMAT_VERSIONS)}"
        )
    if not _PATH_RE.fullmatch(plan["blocks_path"]):
        raise ValueError(f"'blocks_path' {plan['blocks_path']!r} is not a dotted path")
    model = _build(plan)
    _apply_structure(model, plan)
    _load_weights(model, directory, plan)
    return model.eval()
