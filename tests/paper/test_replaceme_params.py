"""ReplaceMe parameter counts and Eq. 10 compression ratios from configs
alone (meta device, no weights), against the numbers of Shopkhoev et al.,
"ReplaceMe" (arXiv 2505.02819) that need no pretrained weights:

- Table 14: full-model healing of the pruned Llama-3-8B trains "6.3B"
  parameters = Llama-3-8B minus 8 blocks = 6,285,365,248; LT-only healing
  trains "16.8M" = d² = 4096².
- Eq. 10, ``(1 − N_pruned / N_original) × 100``: the paper's "25%" is a
  fraction of blocks; by parameters it is 21.73% (Llama-3-8B − 8 blocks),
  24.03% (Llama-2-7B − 8), 24.26% (Llama-3-70B − 20; Table 8), and 36.38% at
  37.5% (− 30).

Configs are the public ones of the checkpoints named in the paper.
"""

import pytest

transformers = pytest.importorskip("transformers")

from toast.methods.replaceme import compression_ratio, params_from_config  # noqa: E402

pytestmark = pytest.mark.hf


def _llama(vocab, d, ff, layers, heads, kv, tied=False):
    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=ff,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        tie_word_embeddings=tied,
    )


CONFIGS = {
    "Llama-2-7B": lambda: _llama(32000, 4096, 11008, 32, 32, 32),
    "Llama-3-8B": lambda: _llama(128256, 4096, 14336, 32, 32, 8),
    "Llama-3.2-1B": lambda: _llama(128256, 2048, 8192, 16, 32, 8, tied=True),
    "Llama-3-70B": lambda: _llama(128256, 8192, 28672, 80, 64, 8),
    "Mistral-7B-v0.3": lambda: transformers.MistralConfig(
        vocab_size=32768,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    "Qwen2.5-7B": lambda: transformers.Qwen2Config(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
}

# model: (total parameters, {blocks removed: Eq. 10 ratio in % as printed to 2 decimals})
EXPECTED = {
    "Llama-2-7B": (6_738_415_616, {8: 24.03, 4: 12.01, 12: 36.04}),
    "Llama-3-8B": (8_030_261_248, {8: 21.73, 4: 10.86}),
    "Llama-3.2-1B": (1_235_814_400, {4: 19.69}),
    "Llama-3-70B": (70_553_706_496, {20: 24.26, 30: 36.38}),
    "Mistral-7B-v0.3": (7_248_023_552, {8: 24.07}),
    "Qwen2.5-7B": (7_615_616_512, {7: 21.42}),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_total_parameters_from_the_config(name, paper_record):
    total = params_from_config(CONFIGS[name]())
    paper_record(
        "ReplaceMe (configs)", f"{name} parameters", f"{EXPECTED[name][0]:,}", f"{total:,}"
    )
    assert total == EXPECTED[name][0]


@pytest.mark.parametrize(
    ("name", "removed"), [(n, k) for n, (_, ratios) in EXPECTED.items() for k in ratios]
)
def test_eq10_compression_ratio_after_removing_blocks(name, removed, paper_record):
    before, ratios = EXPECTED[name]
    after = params_from_config(CONFIGS[name](), remove=removed)
    ratio = round(compression_ratio(before, after), 2)
    paper_record("ReplaceMe Eq. 10", f"{name} minus {removed} blocks (%)", ratios[removed], ratio)
    assert ratio == ratios[removed]


def test_table14_full_model_healing_trains_the_pruned_llama3_8b(paper_record):
    # "6.3B" trainable parameters: Llama-3-8B without 8 of its 32 blocks
    pruned = params_from_config(CONFIGS["Llama-3-8B"](), remove=8)
    paper_record("ReplaceMe Tab. 14", "Llama-3-8B minus 8 blocks", "6.3B", f"{pruned:,}")
    assert pruned == 6_285_365_248
    # "16.8M" for LT-only healing: one d x d transform
    assert CONFIGS["Llama-3-8B"]().hidden_size ** 2 == 16_777_216


def test_the_paper_25_percent_is_a_fraction_of_blocks_not_of_parameters():
    before, _ = EXPECTED["Llama-3-8B"]
    after = params_from_config(CONFIGS["Llama-3-8B"](), remove=8)
    assert 8 / 32 == 0.25
    assert compression_ratio(before, after) < 25.0
