"""A translator as a block: the module that stands in a model's block list
for a replaced span, and the conversion of a fitted closed-form
:class:`toast.core.Translator` into a module."""

from __future__ import annotations

import torch
from torch import nn

from toast.core import Translator
from toast.core.kinds import KINDS
from toast.translators.modules import FITTED_KIND, DiagonalMap

__all__ = ["TranslatorBlock", "translator_module"]


def translator_module(
    translator: Translator, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> nn.Module:
    """The module computing ``x @ weight + bias`` of a fitted translator.

    The module shape is that of its kind in :data:`toast.core.kinds.KINDS`:
    identity ``nn.Identity``, diagonal a per-feature scale, the linear kinds
    an ``nn.Linear`` whose weight is ``weightᵀ`` (torch's ``(out, in)``
    layout), without a bias when the fitted bias is zero. A fitted kind the
    table lacks (``fit_translator``'s ``"ridge"``) is stored as a linear map.
    """
    entry = KINDS.get(translator.kind)
    shape = "linear" if entry is None else entry.module
    if shape == "identity":
        return nn.Identity()
    weight = torch.as_tensor(translator.weight, dtype=torch.float64)
    bias = torch.as_tensor(translator.bias, dtype=torch.float64)
    module: nn.Module
    if shape == "diagonal":
        module = DiagonalMap(torch.diagonal(weight).clone(), bias)
    elif shape == "linear":
        has_bias = bool(torch.any(bias != 0))
        module = nn.Linear(weight.shape[0], weight.shape[1], bias=has_bias, dtype=torch.float64)
        with torch.no_grad():
            module.weight.copy_(weight.T)
            if has_bias:
                module.bias.copy_(bias)
    else:
        raise ValueError(f"a {translator.kind!r} translator is trained, not fitted in closed form")
    # The fitted kind names the translator in the saved plan as it does in the report.
    setattr(module, FITTED_KIND, translator.kind)
    return module.to(dtype=dtype, device=device)


def _active_hidden_states() -> dict | None:
    """The collector of a transformers forward recording ``hidden_states`` by
    hooks on its block class (transformers >= 5), or None."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # older transformers collect hidden states in their layer loop
        return None
    collected = _active_collector.get()
    if not isinstance(collected, dict) or "hidden_states" not in collected:
        return None
    return collected


def _record_hidden_state(block_input: torch.Tensor, block_output: torch.Tensor) -> None:
    # Models that record hidden_states with hooks on their own block class
    # would skip a translator block; record its output the same way (the
    # input too when it stands first, as the hooks do for the first block).
    collected = _active_hidden_states()
    if collected is None:
        return
    states = collected["hidden_states"]
    selection = collected.get("_hidden_states_layers")
    for state in ((block_input,) if not states else ()) + (block_output,):
        states.append(state if selection is None or len(states) in selection else None)


class TranslatorBlock(nn.Module):
    """Stands in the block list for a removed span of blocks.

    Takes the block call signature (hidden states first, positionally or as
    ``hidden_states=``; everything else is ignored) and returns the
    translated hidden states, as a block does.
    """

    _toast_stand_in = True  # find_blocks skips stand-ins when it recognises a block list

    def __init__(
        self, translator: nn.Module, span: tuple[int, int], like: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.translator = translator
        self.span = tuple(span)
        if like is not None:
            # Models read plain per-layer attributes of their blocks (e.g.
            # ModernBERT's attention_type); keep those of the first block.
            for name, value in vars(like).items():
                if not name.startswith("_") and isinstance(value, (str, int, float, bool)):
                    setattr(self, name, value)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        out = self.translator(hidden_states)
        _record_hidden_state(hidden_states, out)
        return out

    def extra_repr(self) -> str:
        return f"replaces blocks[{self.span[0]}:{self.span[1]}]"
