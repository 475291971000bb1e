"""The compression methods, one package each over the shared infrastructure,
and :func:`compress`, which dispatches to them by name.

- :mod:`toast.methods.toast`: TOAST / TBA / RBA (error matrix, plan, translators);
- :mod:`toast.methods.replaceme`: ReplaceMe (cuts, a linear transform folded
  into the last kept block);
- :mod:`toast.methods.toast_vit`: ToaSt (ViT head-dimension pruning, Token
  Channel Selection).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

# Importing the method packages registers them.
import toast.methods.replaceme
import toast.methods.toast
import toast.methods.toast_vit  # noqa: F401
from toast.methods.base import Method, Report, get_method, make_config, method_names, register

__all__ = ["Method", "Report", "compress", "get_method", "method_names", "register"]


def compress(
    model: nn.Module,
    data: Iterable | None = None,
    *,
    method: str = "toast",
    config: Any = None,
    **params: Any,
) -> tuple[nn.Module, Report]:
    """Compresses ``model`` in place with ``method``; returns it and the
    method's report (a :class:`toast.methods.base.Report`).

    ``data`` is the calibration data: an iterable of batches (tensors, dicts
    of model inputs such as a tokenizer's output, or ``(inputs, labels)``
    pairs). The method's options come either as ``config`` (its config
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
    """
    chosen = get_method(method)
    if config is None:
        config = make_config(chosen, params)
    elif params:
        raise TypeError("give the options as config=... or as keywords, not both")
    elif not isinstance(config, chosen.config):
        raise TypeError(
            f"method={method!r} takes a {chosen.config.__name__}, got {type(config).__name__}"
        )
    if chosen.needs_data and data is None:
        raise ValueError(f"method={method!r} needs calibration data (a loader of batches)")
    return chosen.run(model, data, config)
