"""``config.json`` of a toast save, so that ``transformers`` loads it too.

A save whose plan holds only the model's own blocks and no patches (a
ReplaceMe result, an unpatched model) is a standard checkpoint: its
``config.json`` is the model's config and ``AutoModel.from_pretrained``
loads it. Any other save gets a ``config.json`` of model type ``"toast"``
whose ``auto_map`` points every Auto class at ``toast_modeling.py`` (a copy
of :mod:`toast.io.hub_model`): ``transformers`` alone rebuilds it with
``trust_remote_code=True``, and refuses it without, since the plain class
would silently load different weights. :func:`register_auto_classes` (run
when :mod:`toast.io` is imported) lets a process that imported toast load
such a folder with no ``trust_remote_code``.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

__all__ = ["AUTO_CLASSES", "CONFIG_NAME", "MODELING_NAME", "register_auto_classes", "write_config"]

CONFIG_NAME = "config.json"
MODELING_NAME = "toast_modeling.py"
#: The Auto classes a custom save answers to (each returns the saved class).
AUTO_CLASSES = (
    "AutoModel",
    "AutoModelForCausalLM",
    "AutoModelForMaskedLM",
    "AutoModelForSequenceClassification",
    "AutoModelForTokenClassification",
    "AutoModelForQuestionAnswering",
    "AutoModelForImageClassification",
    "AutoModelForPreTraining",
)


def is_custom(plan: dict[str, Any]) -> bool:
    """Whether the plan needs more than the model class to rebuild."""
    return bool(plan.get("patches")) or any(e["type"] != "block" for e in plan["layout"])


def write_config(plan: dict[str, Any], folder: Path) -> bool:
    """Writes ``config.json`` (and ``toast_modeling.py`` for a custom save)
    into ``folder``; returns whether the save is custom."""
    config = dict(plan["config"])
    config.setdefault("architectures", [plan["model_class"]["name"]])
    custom = is_custom(plan)
    if custom:
        from toast.io import hub_model  # transformers: a custom save is of a transformers model

        module = Path(MODELING_NAME).stem
        config["toast_model_type"] = config.get("model_type")
        config["model_type"] = hub_model.MODEL_TYPE
        config["auto_map"] = {
            "AutoConfig": f"{module}.ToastConfig",
            **{name: f"{module}.ToastModel" for name in AUTO_CLASSES},
        }
        shutil.copyfile(hub_model.__file__, folder / MODELING_NAME)
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return custom


_REGISTERED: list[bool] = []


def register_auto_classes() -> None:
    """Registers model type ``"toast"`` with ``transformers``' Auto classes
    (once per process)."""
    if _REGISTERED or importlib.util.find_spec("transformers") is None:
        return  # without transformers there are no Auto classes to register with
    import transformers

    from toast.io import hub_model

    transformers.AutoConfig.register(hub_model.MODEL_TYPE, hub_model.ToastConfig, exist_ok=True)
    for name in AUTO_CLASSES:
        auto = getattr(transformers, name, None)
        if auto is not None:
            auto.register(hub_model.ToastConfig, hub_model.ToastModel, exist_ok=True)
    _REGISTERED.append(True)
