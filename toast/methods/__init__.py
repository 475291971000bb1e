"""The compression methods, one package each over the shared infrastructure,
and :func:`compress`, which dispatches to them by name.

- :mod:`toast.methods.translate`: TOAST / TBA / RBA (error matrix, plan, translators);
- :mod:`toast.methods.replaceme`: ReplaceMe (cuts, a linear transform folded
  into the last kept block);
- :mod:`toast.methods.heads`: ToaSt (ViT head-dimension pruning, Token
  Channel Selection);
- :mod:`toast.methods.remove`: plain block removal, the baseline.

Every method registers its stages (:class:`toast.methods.base.Stages`),
which ``toast.search`` runs through the registry alone.
:func:`compress` takes a model in memory (:mod:`toast.methods.runner`) or a
checkpoint folder (:mod:`toast.methods.pipeline`: in memory or block by
block from disk, chosen once).
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any, overload

if TYPE_CHECKING:  # torch stays unimported until a method runs
    from torch import nn

    from toast.methods.base import Method, Report

__all__ = ["available_methods", "compress", "get_method", "method_config"]


def available_methods() -> list[str]:
    """Names ``compress(method=...)`` accepts (imports no method)."""
    from toast.methods.base import METHODS

    return sorted(METHODS)


def get_method(name: str) -> Method:
    """The registered method ``name`` (every method's module imported first)."""
    from toast.methods import base

    return base.get_method(name)


def method_config(name: str) -> type:
    """The config dataclass of the method ``name``, imported alone (the
    method's orchestrator, and with it torch, stays unimported)."""
    from toast.methods.base import METHODS

    if name not in METHODS:
        raise ValueError(f"method must be one of {available_methods()}; got {name!r}")
    module, cls = METHODS[name][1].split(":")
    return getattr(importlib.import_module(module), cls)


@overload
def compress(
    model: nn.Module,
    data: Any = None,
    *,
    method: str = ...,
    output: None = None,
    max_memory: None = None,
    sequential: None = None,
    heldout: Any = None,
    config: Any = None,
    device: None = None,
    dtype: None = None,
    **params: Any,
) -> tuple[nn.Module, Report]: ...


@overload
def compress(
    model: str | os.PathLike,
    data: Any = None,
    *,
    method: str = ...,
    output: str | os.PathLike | None = None,
    max_memory: int | str | None = None,
    sequential: bool | None = None,
    heldout: Any = None,
    config: Any = None,
    device: Any = None,
    dtype: Any = None,
    **params: Any,
) -> Report: ...


def compress(
    model: nn.Module | str | os.PathLike,
    data: Any = None,
    *,
    method: str = "toast",
    output: str | os.PathLike | None = None,
    max_memory: int | str | None = None,
    sequential: bool | None = None,
    heldout: Any = None,
    config: Any = None,
    device: Any = None,
    dtype: Any = None,
    **params: Any,
) -> Any:
    """Compresses ``model`` with ``method``, the one entry for every method.

    - ``model`` an ``nn.Module``: compressed in place; returns it and the
      method's report (a :class:`toast.methods.base.Report`).
    - ``model`` a Hugging Face checkpoint folder (or a ``.gguf`` file):
      the result is written to the new folder ``output`` (required) and the
      report is returned. The model is loaded and compressed in memory when
      it fits ``max_memory`` bytes (``"64GiB"``; default: the memory
      available now, on ``device`` in ``dtype`` when given), and compressed
      block by block from disk otherwise, without ever being loaded, for a
      method that has that path (``"toast"``: closed-form translators,
      ``fit="independent"``; ``"replaceme"``: cuts chosen by distance);
      ``sequential=True``/``False`` forces a path. The log says which path
      and why. In memory, the output is a toast save where plain
      ``transformers`` could not rebuild the model (load it with
      :func:`toast.load_pretrained`), else a standard checkpoint; either way
      with the folder's tokenizer files. Both paths give the same tensors.

    ``data`` is the calibration data: an iterable of batches (tensors, dicts
    of model inputs, or ``(inputs, labels)`` pairs), or raw text with
    ``tokenizer=``: a ``.txt``/``.jsonl``/``.json`` file, a list of strings,
    a ``datasets``-style dataset, chat ``"messages"`` rows, read with
    ``max_length``, ``batch_size``, ``num_samples``, ``pack``, ``field``
    (see :class:`toast.hf.data.text.TextData`).

    ``heldout`` (batches, or raw text read the same way, or a fraction of
    raw ``data`` held out) makes the report state measured quality for the
    original model, plain removal of the same blocks and the compressed
    model: perplexity for causal LMs, accuracy when the batches carry
    labels, else the mean cosine of outputs to the original's
    (:mod:`toast.hf.evaluate.quality`; ``report.quality``).

    The method's options come either as ``config`` (its config
    dataclass, e.g. :class:`toast.ToastConfig`) or as keywords, from which
    that config is built: its own fields plus the calibration options
    (``max_samples``, ``max_batches``, ``sample``, ``seed``, ``blocks``,
    ``progress``, ``distributed``, ``group``; see :class:`toast.Calibration`).

    ``num_blocks=n``: blocks to remove, for every method that removes blocks
    (``"toast"``, also as ``budget=n``, the TOAST paper's name; ``"replaceme"``,
    ``"remove"``, ``"linearpatch"``); ``"sublayer"``: ``num_sublayers``;
    ``"toast-vit"``: ``head_sparsity``... (``data`` only for its fine-tune).
    A compressed model's own ``save_pretrained`` writes a toast save where
    plain ``transformers`` could not rebuild it (:mod:`toast.io.guard`).
    """
    from toast.methods.runner import split_text_options

    chosen = get_method(method)
    text, params = split_text_options(params)
    config = _config(chosen, config, params)
    if isinstance(model, (str, os.PathLike)):
        from toast.methods.pipeline import compress_folder

        if output is None:
            raise TypeError(f"toast.compress({str(model)!r}, ...): pass output=<new folder>")
        return compress_folder(
            chosen, model, data, output, config, max_memory=max_memory, sequential=sequential,
            heldout=heldout, text=text, device=device, dtype=dtype,
        )  # fmt: skip
    _only_for_folders(output=output, max_memory=max_memory, sequential=sequential,
                      device=device, dtype=dtype)  # fmt: skip
    from toast.io.guard import guard_save
    from toast.methods.runner import run_method

    model, report = run_method(chosen, model, data, config, heldout=heldout, text=text)
    return guard_save(model), report


def _config(method: Any, config: Any, params: dict[str, Any]) -> Any:
    """``config``, or the method's config built from keyword ``params``."""
    from toast.methods.base import make_config

    if config is None:
        return make_config(method, params)
    if params:
        raise TypeError("give the options as config=... or as keywords, not both")
    if not isinstance(config, method.config):
        raise TypeError(
            f"method={method.name!r} takes a {method.config.__name__}, got {type(config).__name__}"
        )
    return config


def _only_for_folders(**given: Any) -> None:
    """A model in memory is compressed in place: the folder options are errors."""
    named = sorted(k for k, v in given.items() if v is not None)
    if named:
        raise TypeError(
            f"{', '.join(named)} apply to a checkpoint folder; a model in memory is compressed "
            "in place (save it with toast.save_pretrained)"
        )
