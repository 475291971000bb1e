"""ReplaceMe: remove a contiguous span of blocks and replace it by a linear
transform folded into the down-projection of the last kept block.

Shopkhoev et al., "ReplaceMe: Network Simplification via Depth Pruning and
Transformer Block Linearization" (arXiv 2505.02819). For a pre-norm block
``Y = X + Attn(X)``, ``M = MLP(Y)``, ``L = Y + M``. To remove ``n`` blocks
after block ``k``, ReplaceMe fits a ``d × d`` matrix T with
``M_k T + Y_k ≈ L_{k+n}`` (§3.2) and folds it into block ``k``'s MLP
output projection, so the compressed model is a standard, smaller
checkpoint of the same architecture with no extra parameters.

Steps, each its own module: the distance profile and the cut
(:mod:`~toast.methods.replaceme.profile`, :mod:`~toast.methods.replaceme.cuts`;
§3.1, Eq. 4), one pass estimating every transform
(:mod:`~toast.methods.replaceme.estimate`, least squares Eq. 6, or the
cosine objective of :mod:`~toast.methods.replaceme.cosine`, Eqs. 7-8),
then folding and removal (:mod:`~toast.methods.replaceme.fold`). Held-out
calibration batches (:mod:`~toast.methods.replaceme.check`) choose the
cut among the closest windows and check every fit against plain removal.
:func:`replaceme` runs them all, finding the model's blocks once: through
the one driver (:mod:`toast.methods.driver`), which runs the stages a
:class:`ReplaceMeConfig` configures
(:class:`~toast.methods.replaceme.configured.ConfiguredReplaceMe`), in memory
and, for ``toast.compress`` on a checkpoint folder, block by block from disk.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from toast.methods.base import Method, register
from toast.methods.replaceme.config import ReplaceMeConfig
from toast.methods.replaceme.report import ReplaceMeReport
from toast.methods.replaceme.stages import STAGES
from toast.methods.runner import run_method, split_text_options

__all__ = ["replaceme"]


def replaceme(
    model: nn.Module,
    data: Any,
    config: ReplaceMeConfig | None = None,
    *,
    heldout: Any = None,
    **params: Any,
) -> tuple[nn.Module, ReplaceMeReport]:
    """Removes blocks of ``model`` by ReplaceMe, in place.

    ``config`` (a :class:`~toast.methods.replaceme.ReplaceMeConfig`, which
    documents every option) and/or its fields as keywords
    (``num_blocks=2, objective="cosine"``), with the calibration options
    (``max_samples``, ``seed``, ``progress``...; see
    :class:`toast.Calibration`) routed into its ``calibration``. ``data``
    is a loader of batches or raw text with ``tokenizer=`` (and
    ``max_length``, ``batch_size``, ``num_samples``, ``pack``, ``field``: see
    :func:`toast.compress`); ``heldout`` data adds measured perplexity of
    the original, plain removal and the pruned model to the report. A
    profile pass over ``data`` chooses the cut(s) unless ``spans`` are
    given, one more pass per fit estimates the transforms, and the blocks
    are folded and removed. Raises
    :class:`~toast.methods.replaceme.NotFoldableError` when a fold target's
    output does not move with its MLP output. Returns the model and a
    :class:`~toast.methods.replaceme.ReplaceMeReport`.
    """
    text, params = split_text_options(params)
    config = ReplaceMeConfig.from_options(config, params)
    if data is None:
        raise ValueError("ReplaceMe needs calibration data (a loader of batches, or raw text)")
    _, report = run_method(METHOD, model, data, config, heldout=heldout, text=text)
    assert isinstance(report, ReplaceMeReport)
    return model, report


METHOD = register(
    Method(
        name="replaceme",
        config=ReplaceMeConfig,
        summary="remove blocks, fold a least-squares or cosine transform into the last kept one",
        stages=STAGES,
    )
)
