"""``model.save_pretrained`` on a compressed model: a toast save, never a
checkpoint that reloads different weights.

``transformers``' own ``save_pretrained`` writes the state dict and the
config: a translator block or a narrowed attention is rebuilt from the config
as a fresh block on reload (the outputs change silently). Compressed models
get an instance attribute ``save_pretrained`` (:func:`guard_save`) that
writes a complete toast save instead, which reloads with
:func:`toast.load_pretrained` and, through ``toast_modeling.py``, with
``AutoModel.from_pretrained(..., trust_remote_code=True)``. A model that
plain ``transformers`` can rebuild (a ReplaceMe result) keeps the class's
own ``save_pretrained``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

from toast.hf.model.surgery import replace_spans
from toast.io.format import PLAN_NAME
from toast.io.save import needs_toast_layout, save_pretrained

# toast.io.replace_spans is imported from here: loading toast.io registers the
# guard with toast.hf.model.surgery before the first patched model exists.
__all__ = ["guard_save", "replace_spans"]

# transformers' keywords a toast save honours (the rest would be ignored silently).
_IGNORABLE = frozenset({"safe_serialization", "is_main_process"})


class _GuardedSave:
    """The ``save_pretrained`` of one compressed model. A class (not a
    closure) so that ``copy.deepcopy(model)`` gets its own."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, save_directory: str | os.PathLike[str], *args: Any, **kwargs: Any) -> Any:
        model = self.model
        if not needs_toast_layout(model):
            cls: Any = type(model)  # a transformers class: its own save is right
            return cls.save_pretrained(model, save_directory, *args, **kwargs)
        unsupported = sorted(set(kwargs) - _IGNORABLE)
        if args or unsupported:
            raise ValueError(
                f"this compressed model is saved by toast.save_pretrained, which does not take "
                f"{unsupported or 'positional options'}; call toast.save_pretrained(model, path)"
            )
        target = Path(save_directory)
        existing = target.is_dir() and any(target.iterdir())
        if existing and not (target / PLAN_NAME).is_file():
            raise FileExistsError(
                f"{target} holds files that are not a toast save; a compressed model is written "
                "by toast.save_pretrained(model, path) into a new or empty folder"
            )
        return save_pretrained(model, target, overwrite=target.exists())


def guard_save(model: nn.Module) -> nn.Module:
    """Makes ``model.save_pretrained`` write a toast save when needed (see
    the module docstring); returns ``model``. Models without a
    ``save_pretrained`` method of their class are returned unchanged."""
    own = getattr(type(model), "save_pretrained", None)
    if not (isinstance(model, nn.Module) and callable(own)):
        return model
    if not isinstance(getattr(model, "save_pretrained", None), _GuardedSave):
        object.__setattr__(model, "save_pretrained", _GuardedSave(model))
    return model
