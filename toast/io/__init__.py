"""Saving and loading patched Hugging Face models: safetensors + a JSON plan.

:func:`save_pretrained` writes a directory holding:

- ``model.safetensors``: the model's state dict (tensors shared by several
  names, such as tied input/output embeddings, are stored once);
- ``toast_plan.json``: how to rebuild the module tree: the ``transformers``
  model class, the (patched) config, the dtype, the path of the block list
  and, for each position of the block list, either ``{"type": "block"}`` or
  the entry of the registered serializer of the block standing there (a
  translator: the span it replaces, its JSON spec, its plain attributes);
  ``patches``, the entries of registered model patches (changes a method
  made inside blocks: ToaSt's narrowed attentions and TCS); the SHA-256 of
  the weights; the toast and transformers versions. A small human-readable
  ``summary`` heads the plan;
- ``config.json`` (:mod:`toast.io.remote`): the model's own where plain
  ``transformers`` rebuilds the model, else one pointing transformers' Auto
  classes at ``toast_modeling.py`` (a copy of :mod:`toast.io.hub_model`);
- ``README.md``, a model card; the generation config of generative models;
  the tokenizer and other companions of the source folder
  (:mod:`toast.io.folder`).

:func:`load_pretrained` rebuilds the model from the config (without random
initialisation), puts translator blocks at their positions, applies the
patches and loads the tensors strictly: every tensor must be present with
its shape, none may be left over, the checksum must match. Nothing on that
path unpickles: the weights are safetensors, the plan is JSON, and the model
class must be one that ``transformers`` itself defines. A plain
``transformers`` folder loads as such.

Writes are atomic: everything goes into a hidden temporary directory next to
the target (files fsynced, the plan written last), which is then renamed to
the target. A directory without a complete plan is never taken for a model.
"""

from toast.hf.model.surgery import set_save_guard
from toast.io.format import FORMAT, FORMAT_VERSION, PLAN_NAME, WEIGHTS_NAME, CorruptedSaveError
from toast.io.guard import guard_save, replace_spans
from toast.io.load import load_pretrained
from toast.io.remote import register_auto_classes
from toast.io.save import save_pretrained

# A process that imported toast loads custom saves with plain Auto classes,
# and a model patched by toast.io.replace_spans saves as a toast save.
register_auto_classes()
set_save_guard(guard_save)

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "PLAN_NAME",
    "WEIGHTS_NAME",
    "CorruptedSaveError",
    "load_pretrained",
    "replace_spans",
    "save_pretrained",
]
