"""Parameter counts for ReplaceMe: the paper's compression ratio (Eq. 10)
and a model's size after removing blocks, from its config alone.

Shopkhoev et al., "ReplaceMe" (arXiv 2505.02819), §4, Eq. 10: compression
is ``(1 − N_pruned / N_original) × 100`` percent of the parameters; a
folded transform adds none, so removing ``n`` blocks of a model costs
exactly their parameters.
"""

from __future__ import annotations

from typing import Any

import torch

from toast._validation import Interval, check
from toast.hf.model.blocks import find_blocks
from toast.hf.model.params import count_params
from toast.hf.model.surgery import remove_blocks

__all__ = ["compression_ratio", "params_from_config"]


def compression_ratio(params_before: int, params_after: int) -> float:
    """The paper's Eq. 10: ``(1 − N_pruned / N_original) × 100`` (percent)."""
    check("params_before", params_before, Interval(int, 1, None))
    return 100.0 * (1.0 - params_after / params_before)


def params_from_config(config: Any, remove: int = 0) -> int:
    """Parameters of the model ``config`` describes, after removing ``remove``
    blocks, counted on the meta device (no weights are allocated).

    The model is built with ``AutoModelForCausalLM`` (``AutoModel`` for
    configs without a causal-LM head) and the blocks are removed with the
    same :func:`toast.hf.model.surgery.remove_blocks` that
    :func:`toast.methods.replaceme.replaceme` uses (the last ones; blocks are identical, so
    which ones does not matter).
    """
    import transformers

    remove = check("remove", remove, Interval(int, 0, None))
    with torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:
            model = transformers.AutoModel.from_config(config)
    if remove:
        stack = find_blocks(model)
        total = stack.num_blocks
        check("remove", remove, Interval(int, 0, total - 1))
        remove_blocks(model, [(total - remove, total)], blocks=stack)
    return count_params(model)
