"""Tiny models and data for the search tests: a Llama (perplexity) and a
ViT (output cosine), with calibration batches 16 tokens / 16 pixels wide
and held-out batches of another width, so a hook can tell the passes
apart."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CALIBRATION_LENGTH = 16
HELDOUT_LENGTH = 12


def tiny_llama(layers: int = 6) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=97,
    )
    return transformers.LlamaForCausalLM(config).eval()


def token_batches(count: int, length: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(3, 97, (4, length), generator=g),
            "attention_mask": torch.ones(4, length, dtype=torch.long),
        }
        for _ in range(count)
    ]


def tiny_vit(layers: int = 6, classifier: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=16,
        patch_size=4,
    )
    if classifier:
        return transformers.ViTForImageClassification(config).eval()
    return transformers.ViTModel(config, add_pooling_layer=False).eval()


def image_batches(count: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 3, 16, 16, generator=g) for _ in range(count)]


@pytest.fixture
def llama():
    return tiny_llama()


@pytest.fixture
def llama_data():
    return token_batches(6, CALIBRATION_LENGTH, 1), token_batches(2, HELDOUT_LENGTH, 2)
