"""A tiny random Llama, a character-level tokenizer built offline, and a
small multiple-choice task written from local text (the standard library's
docstrings), for the lm-evaluation-harness tests."""

import pytest

CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,'()-:;"


@pytest.fixture(autouse=True)
def private_datasets_cache(tmp_path_factory, monkeypatch):
    """datasets writes the Arrow files of every local task it reads into its
    cache: a folder of the test session, not the user's home."""
    config = pytest.importorskip("datasets.config")
    folder = tmp_path_factory.getbasetemp() / "hf-datasets"
    monkeypatch.setattr(config, "HF_DATASETS_CACHE", folder)
    return folder


def char_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({c: 4 + i for i, c in enumerate(sorted(set(CHARS)))})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>",
    )  # fmt: skip


def tiny_llama(seed: int = 0, layers: int = 4):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=4 + len(set(CHARS)), hidden_size=32, intermediate_size=64,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


@pytest.fixture(scope="module")
def local_task(tmp_path_factory):
    """``continuation.yaml`` over ``continuation.jsonl``: 24 sentence starts,
    4 endings each."""
    from toast.data import stdlib_sentences
    from toast.hf.evaluate.tasks import write_continuation_task

    folder = tmp_path_factory.mktemp("task")
    return write_continuation_task(folder, stdlib_sentences(24, max_words=14), choices=4)
