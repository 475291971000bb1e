"""The compression methods, one package each over the shared infrastructure,
and :func:`compress`, which dispatches to them by name.

- :mod:`toast.methods.toast`: TOAST / TBA / RBA (error matrix, plan, translators);
- :mod:`toast.methods.replaceme`: ReplaceMe (cuts, a linear transform folded
  into the last kept block);
- :mod:`toast.methods.toast_vit`: ToaSt (ViT head-dimension pruning, Token
  Channel Selection);
- :mod:`toast.methods.remove`: plain block removal, the baseline.

Every method registers its stages (:class:`toast.methods.base.Stages`),
which ``toast.search`` runs through the registry alone.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch stays unimported until a method runs
    from torch import nn

    from toast.methods.base import Report

__all__ = ["available_methods", "compress", "compress_checkpoint"]


def _register_all() -> None:
    # Importing a method's orchestrator registers it; done on first use so
    # that importing a config (e.g. for the CLI's --help) needs no torch.
    import toast.methods.remove.method
    import toast.methods.replaceme.method
    import toast.methods.toast.compress
    import toast.methods.toast_vit.compress  # noqa: F401


def available_methods() -> list[str]:
    """Names ``compress(method=...)`` accepts."""
    from toast.methods.base import method_names

    _register_all()
    return method_names()


def compress(
    model: nn.Module,
    data: Any = None,
    *,
    method: str = "toast",
    config: Any = None,
    heldout: Any = None,
    **params: Any,
) -> tuple[nn.Module, Report]:
    """Compresses ``model`` in place with ``method``; returns it and the
    method's report (a :class:`toast.methods.base.Report`).

    ``data`` is the calibration data: an iterable of batches (tensors, dicts
    of model inputs such as a tokenizer's output, or ``(inputs, labels)``
    pairs), or raw text with ``tokenizer=``: a ``.txt``/``.jsonl``/``.json``
    file, a list of strings, a ``datasets``-style dataset, chat
    ``"messages"`` rows (rendered by the tokenizer's chat template), read
    with ``max_length``, ``batch_size``, ``num_samples``, ``pack``, ``field``
    (see :class:`toast.hf.text.TextData`).

    ``heldout`` (batches, or raw text read the same way) makes the report
    state measured quality for the original model, plain removal of the same
    blocks and the compressed model: perplexity for causal LMs, accuracy when
    the batches carry labels, else the mean cosine of outputs to the
    original's (:mod:`toast.hf.quality`; ``report.quality``).

    The method's options come either as ``config`` (its config
    dataclass, e.g. :class:`toast.ToastConfig`) or as keywords, from which
    that config is built: its own fields plus the calibration options
    (``max_samples``, ``max_batches``, ``sample``, ``seed``, ``blocks``,
    ``progress``, ``distributed``, ``group``; see :class:`toast.Calibration`).

    - ``method="toast"`` (:class:`toast.ToastConfig`): ``budget=2`` blocks
      to remove (or ``max_error``, or ``spans``), ``translator="affine"``...
    - ``method="replaceme"`` (:class:`toast.ReplaceMeConfig`): ``num_blocks``,
      ``objective="ls" | "cosine" | "identity"``...
    - ``method="toast-vit"`` (:class:`toast.ToastVitConfig`):
      ``head_sparsity``, ``schedule``...; ``data`` only for its optional
      fine-tune.

    The compressed model's own ``model.save_pretrained(path)`` writes a
    complete toast save where plain ``transformers`` could not rebuild it
    (:mod:`toast.io.guard`).
    """
    from toast.io.guard import guard_save
    from toast.methods.base import get_method, make_config
    from toast.methods.runner import run_method, split_text_options

    _register_all()
    chosen = get_method(method)
    text, params = split_text_options(params)
    if config is None:
        config = make_config(chosen, params)
    elif params:
        raise TypeError("give the options as config=... or as keywords, not both")
    elif not isinstance(config, chosen.config):
        raise TypeError(
            f"method={method!r} takes a {chosen.config.__name__}, got {type(config).__name__}"
        )
    model, report = run_method(chosen, model, data, config, heldout=heldout, text=text)
    return guard_save(model), report


def compress_checkpoint(
    folder: str | os.PathLike,
    data: Any,
    output: str | os.PathLike,
    *,
    method: str = "toast",
    config: Any = None,
    max_memory: int | str | None = None,
    sequential: bool | None = None,
    **params: Any,
) -> Report:
    """:func:`compress` for the Hugging Face checkpoint in ``folder``,
    written to the new folder ``output``; returns the report.

    The model is loaded and compressed in memory when it fits ``max_memory``
    bytes (``"64GiB"``; default: the memory available now); otherwise it is
    calibrated block by block from disk and the result is written without
    ever loading the model (``sequential=True``/``False`` forces a path).
    The log says which path and why, and the peak-memory bound.

    - ``method="toast"``: :func:`toast.methods.toast.checkpoint.compress_checkpoint`
      (a toast save, loaded by :func:`toast.load_pretrained`);
    - ``method="replaceme"``: :func:`toast.replaceme_checkpoint` (a standard
      checkpoint, loaded by ``from_pretrained``).
    """
    from toast.methods.replaceme.checkpoint import replaceme_checkpoint
    from toast.methods.toast.checkpoint import compress_checkpoint as toast_checkpoint

    runs: dict[str, Any] = {"toast": toast_checkpoint, "replaceme": replaceme_checkpoint}
    if method not in runs:
        raise ValueError(
            f"method={method!r} has no checkpoint path (it needs the model in memory): "
            "use method='toast' or 'replaceme', or load the model and call toast.compress"
        )
    return runs[method](
        folder, data, output, config, max_memory=max_memory, sequential=sequential, **params
    )
