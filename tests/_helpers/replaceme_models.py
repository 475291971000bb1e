"""Tiny random models for the ReplaceMe tests: decoder LLMs with their LM
head (logits) in seven layouts, and two encoders whose MLP output projection
has a bias. Built from configs only; nothing downloads."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

transformers = __import__("pytest").importorskip("transformers")

from tests._helpers.hf_models import IMAGE, VOCAB, images, pad, sentences  # noqa: E402

HIDDEN, LAYERS, FFN = 32, 6, 64
_DEC = {
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "vocab_size": VOCAB,
    "intermediate_size": FFN,
}
_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

DECODERS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "llama": lambda: transformers.LlamaConfig(**_DEC, **_IDS, num_key_value_heads=2),
    "mistral": lambda: transformers.MistralConfig(
        **_DEC, **_IDS, num_key_value_heads=2, sliding_window=4
    ),
    # qkv projections with a bias; per-layer layer_types in the config
    "qwen2": lambda: transformers.Qwen2Config(**_DEC, **_IDS, num_key_value_heads=2),
    # q and k norms inside attention
    "qwen3": lambda: transformers.Qwen3Config(**_DEC, **_IDS, num_key_value_heads=2, head_dim=8),
    # fused qkv_proj and gate_up_proj
    "phi3": lambda: transformers.Phi3Config(**_DEC, **_IDS, num_key_value_heads=2),
    # GeGLU, (1 + w) RMSNorm, scaled and tied embeddings
    "gemma": lambda: transformers.GemmaConfig(**_DEC, **_IDS, num_key_value_heads=2, head_dim=8),
    # Conv1D weights stored (in, out); n_layer instead of num_hidden_layers
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=4, **_IDS
    ),
    # fc2 with a bias, blocks under model.decoder.layers
    "opt": lambda: transformers.OPTConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        vocab_size=VOCAB,
        ffn_dim=FFN,
        word_embed_proj_dim=HIDDEN,
        max_position_embeddings=64,
        **_IDS,
    ),
}

#: Families that normalise the MLP output before adding it to the residual
#: stream (post_feedforward_layernorm): a full T does not fold into the
#: down-projection there, a diagonal one folds into that norm.
POST_NORM_DECODERS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    # (1 + w) RMSNorm
    "gemma2": lambda: transformers.Gemma2Config(
        **_DEC, **_IDS, num_key_value_heads=2, head_dim=8, sliding_window=4
    ),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **_DEC, **_IDS, num_key_value_heads=2, head_dim=8, sliding_window=4
    ),
    # w RMSNorm after attention and after the MLP, none before
    "olmo2": lambda: transformers.Olmo2Config(**_DEC, **_IDS, num_key_value_heads=2),
}

_VISION = {
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "intermediate_size": FFN,
    "image_size": IMAGE,
    "patch_size": 4,
}
ENCODERS: dict[str, Callable[[], nn.Module]] = {
    "vit": lambda: transformers.ViTModel(
        transformers.ViTConfig(**_VISION), add_pooling_layer=False
    ),
    "clip_vision": lambda: transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**_VISION)),
}


def decoder(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = {**DECODERS, **POST_NORM_DECODERS}[name]()
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def encoder(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return ENCODERS[name]().eval()


def text_loader(n: int = 48, batch_size: int = 8, seed: int = 0, **pad_kw) -> list[dict]:
    text = sentences(n, seed, min_len=4, max_len=12)
    return [pad(text[i : i + batch_size], **pad_kw) for i in range(0, n, batch_size)]


def image_loader(n: int = 24, batch_size: int = 8, seed: int = 0) -> list[torch.Tensor]:
    x = images(n, seed)
    return [x[i : i + batch_size] for i in range(0, n, batch_size)]


def outputs(model: nn.Module, batch) -> torch.Tensor:
    """Logits of a causal LM, the last hidden state of an encoder."""
    with torch.no_grad():
        if isinstance(batch, dict):
            return model(**batch, use_cache=False).logits
        return model(pixel_values=batch).last_hidden_state


class _PassThrough(nn.Module):
    """Stands for a removed block in a reference model: returns its input."""

    def __init__(self, like: nn.Module) -> None:
        super().__init__()
        for name, value in vars(like).items():
            if not name.startswith("_") and isinstance(value, (str, int, float, bool)):
                setattr(self, name, value)

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def explicit_reference(
    model: nn.Module,
    block_list: nn.ModuleList,
    cuts: list[tuple[nn.Module, tuple[int, int], object]],
) -> nn.Module:
    """A copy of ``model`` computing ReplaceMe's cuts with explicit transforms.

    ``cuts`` holds ``(down, (start, stop), T)``: the output of ``down`` (the
    MLP output projection of the block before the cut, a module of
    ``model``) is multiplied by T in float64 by a hook, and the blocks
    ``start..stop-1`` of ``block_list`` pass their input through. No toast
    code is involved.
    """
    memo: dict[int, object] = {}
    ref = copy.deepcopy(model, memo)
    ref_blocks = memo[id(block_list)]
    for down, span, transform in cuts:
        t = torch.as_tensor(transform, dtype=torch.float64)

        def hook(module, args, out, t=t):
            return (out.double() @ t).to(out.dtype)

        memo[id(down)].register_forward_hook(hook)
        for b in range(*span):
            ref_blocks[b] = _PassThrough(ref_blocks[b])
    return ref


def interrupt_after(calls: int):
    """A global forward hook raising KeyboardInterrupt at the ``calls``-th
    block forward, as Ctrl-C would in the middle of the sweep."""
    seen = []

    def hook(module, args, output):
        if type(module).__name__ == "LlamaDecoderLayer":
            seen.append(module)
            if len(seen) == calls:
                raise KeyboardInterrupt

    return torch.nn.modules.module.register_module_forward_hook(hook)


def with_sink(scale: float = 100.0) -> nn.Module:
    """A tiny Llama whose block 2 adds a vector ``scale`` times the typical
    hidden-state norm to the first token of every sequence (a planted
    attention sink)."""
    model = decoder("llama")
    sink = torch.zeros(HIDDEN)
    sink[3] = scale

    def add_sink(module, args, output):
        hidden = (output[0] if isinstance(output, tuple) else output).clone()
        hidden[:, 0] += sink  # the first token of every sequence
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    from toast.hf.model.blocks import find_blocks

    find_blocks(model).blocks[2].register_forward_hook(add_sink)
    return model


def logit_distance(model, original, batches) -> float:
    """Relative L2 distance of the logits to the original's, on real tokens."""
    num = den = 0.0
    for batch in batches:
        got, want = outputs(model, batch), outputs(original, batch)
        real = batch["attention_mask"].bool()
        num += float((got - want)[real].pow(2).sum())
        den += float(want[real].pow(2).sum())
    return (num / den) ** 0.5


def next_token_loss(model: nn.Module, batches: list[dict]) -> float:
    """Mean next-token NLL over non-pad targets, computed from the logits in
    float64 (an independent measure of held-out quality)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            logits = model(**batch, use_cache=False).logits[:, :-1].double()
            keep = batch["attention_mask"][:, 1:].bool()
            nll = torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), batch["input_ids"][:, 1:], reduction="none"
            )
            total, count = total + float(nll[keep].sum()), count + int(keep.sum())
    return total / count


def per_sample_states(model: nn.Module, batches: list[dict]) -> list[list]:
    """Per sample (non-pad tokens only), every state before the final norm,
    as float64 NumPy arrays: the hidden states the papers' definitions use."""
    found = []
    with torch.no_grad():
        for batch in batches:
            hidden = model(**batch, output_hidden_states=True, use_cache=False).hidden_states
            states = [h.double().numpy() for h in hidden[:-1]]
            mask = batch["attention_mask"].bool().numpy()
            found.extend([h[s][mask[s]] for h in states] for s in range(mask.shape[0]))
    return found


def window_with_hook(model: nn.Module, window: tuple[int, int], matrix) -> nn.Module:
    """A copy of the decoder with ``window`` dropped and ``h ↦ h M`` applied
    to the output of the block before it by a forward hook (the placement
    LinearPatch and Ghosted Layers describe), for comparing a folded model."""
    model = copy.deepcopy(model)
    layers = model.model.layers
    m = torch.as_tensor(matrix, dtype=torch.float32)

    def hook(module, args, output):
        if isinstance(output, tuple):
            return (output[0] @ m, *output[1:])
        return output @ m

    layers[window[0] - 1].register_forward_hook(hook)
    model.model.layers = nn.ModuleList(
        [b for k, b in enumerate(layers) if not window[0] <= k < window[1]]
    )
    model.config.num_hidden_layers = len(model.model.layers)
    return model


def translator_blocks(report) -> int:
    """The linear blocks a ReplaceMe run kept in place of its cuts: one per
    fitted cut with ``placement="block"`` (a cut removed plainly keeps none)."""
    if report.placement != "block":
        return 0
    return sum(t is not None for t in report.transforms)
