"""A local tiny Llama with a character-level tokenizer (built offline) and
local text, for the commands that take a model folder."""

import json

import pytest

from tests._helpers.tokenizers import char_tokenizer

CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,'"
TEXTS = [
    "Return the number of items in the container.",
    "Raise a ValueError when the argument is negative.",
    "The default is to read the whole file at once.",
    "Open the file and return a stream, or raise an error.",
    "Split the string at the first occurrence of sep.",
    "Return a copy of the list, sorted in ascending order.",
] * 4


def _tokenizer():
    return char_tokenizer(CHARS)


@pytest.fixture(scope="module")
def local_llama(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("local_llama")
    tokenizer = _tokenizer()
    cfg = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    (root / "calib.txt").write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    with open(root / "calib.jsonl", "w", encoding="utf-8") as f:
        for text in TEXTS:
            f.write(json.dumps({"text": text}) + "\n")
    return root
