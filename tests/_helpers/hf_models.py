"""Tiny randomly initialised Hugging Face models, one per supported family.

Built from configs only (nothing downloads); small enough that a forward pass
takes milliseconds. ``kind`` says what the model eats: "image" models take
``pixel_values``, "text" models take ``input_ids`` + ``attention_mask``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

transformers = __import__("pytest").importorskip("transformers")

HIDDEN = 32
LAYERS = 4
IMAGE = 16
VOCAB = 97


@dataclass(frozen=True)
class Family:
    name: str
    kind: str  # "image" or "text"
    build: Any
    # Whether hidden_states[-1] of output_hidden_states is normalised (so it
    # is not the last block's raw output).
    normalised_last: bool = False
    # Post-LN families (BERT) have no norm after the last block.
    final_norm: bool = True


# Shared sizes: every family gets the same width, depth and head count.
_COMMON = {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": 4}
_VISION = {**_COMMON, "image_size": IMAGE, "patch_size": 4}
_TEXT = {**_COMMON, "vocab_size": VOCAB, "intermediate_size": 64}
_DECODER = {**_TEXT, "num_key_value_heads": 2}


_SPECIAL_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# Config class and family-specific defaults, at the shared sizes above.
_CONFIGS = {
    "vit": ("ViTConfig", {**_VISION, "intermediate_size": 64}),
    "deit": ("DeiTConfig", {**_VISION, "intermediate_size": 64}),
    "dinov2": ("Dinov2Config", {**_VISION, "mlp_ratio": 2}),
    "clip_vision": ("CLIPVisionConfig", {**_VISION, "intermediate_size": 64}),
    "bert": ("BertConfig", _TEXT),
    "modernbert": (
        "ModernBertConfig",
        {**_TEXT, **_SPECIAL_TOKENS, "cls_token_id": 1, "sep_token_id": 2},
    ),
    "llama": ("LlamaConfig", _DECODER),
    "qwen2": ("Qwen2Config", _DECODER),
    "phi3": ("Phi3Config", {**_DECODER, **_SPECIAL_TOKENS}),
    "gpt2": ("GPT2Config", {"vocab_size": VOCAB, "n_embd": HIDDEN, "n_layer": LAYERS, "n_head": 4}),
}


def config(name: str, **overrides: Any):
    """The config of family ``name`` at the shared sizes; ``overrides``
    change or add fields (e.g. ``num_labels=5``, ``num_hidden_layers=2``)."""
    cls, defaults = _CONFIGS[name]
    return getattr(transformers, cls)(**{**defaults, **overrides})


def _vit():
    return transformers.ViTModel(config("vit"), add_pooling_layer=False)


def _deit():
    return transformers.DeiTModel(config("deit"), add_pooling_layer=False)


def _dinov2():
    return transformers.Dinov2Model(config("dinov2"))


def _clip_vision():
    return transformers.CLIPVisionModel(config("clip_vision"))


def _bert():
    return transformers.BertModel(config("bert"), add_pooling_layer=False)


def _modernbert():
    return transformers.ModernBertModel(config("modernbert"))


def _llama():
    return transformers.LlamaModel(config("llama"))


def _qwen2():
    return transformers.Qwen2Model(config("qwen2"))


def _gpt2():
    return transformers.GPT2Model(config("gpt2"))


FAMILIES = [
    Family("vit", "image", _vit),
    Family("deit", "image", _deit),
    Family("dinov2", "image", _dinov2),
    Family("clip_vision", "image", _clip_vision),
    Family("bert", "text", _bert, final_norm=False),
    Family("modernbert", "text", _modernbert, normalised_last=True),
    Family("llama", "text", _llama, normalised_last=True),
    Family("qwen2", "text", _qwen2, normalised_last=True),
    Family("gpt2", "text", _gpt2, normalised_last=True),
]


def build(family: Family, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = family.build()
    model.eval()
    return model


def images(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(seed))


def sentences(n: int, seed: int = 0, min_len: int = 3, max_len: int = 9) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=gen)
    return [torch.randint(3, VOCAB, (int(k),), generator=gen).tolist() for k in lengths]


def pad(batch: list[list[int]], length: int | None = None, left: bool = False) -> dict:
    """A tokenizer-like batch: input_ids and attention_mask, padded with 0."""
    length = length or max(len(s) for s in batch)
    ids = torch.zeros(len(batch), length, dtype=torch.long)
    mask = torch.zeros(len(batch), length, dtype=torch.long)
    for row, seq in enumerate(batch):
        if left:
            ids[row, length - len(seq) :] = torch.tensor(seq)
            mask[row, length - len(seq) :] = 1
        else:
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def loader(family: Family, n: int, batch_size: int, seed: int = 0, **pad_kw) -> list:
    """A list of batches (any iterable works as a loader)."""
    if family.kind == "image":
        x = images(n, seed)
        return [x[i : i + batch_size] for i in range(0, n, batch_size)]
    text = sentences(n, seed)
    return [pad(text[i : i + batch_size], **pad_kw) for i in range(0, n, batch_size)]
