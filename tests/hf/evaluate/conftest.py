"""A tiny random Llama, a character-level tokenizer built offline, and a
small multiple-choice task written from local text (the standard library's
docstrings), for the lm-evaluation-harness tests."""

import pytest

from tests._helpers.tokenizers import char_tokenizer as char_tokenizer_of

CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,'()-:;"


@pytest.fixture(autouse=True)
def _datasets_cache(private_datasets_cache):
    """Every test here reads local tasks: their Arrow files go to the session."""
    return private_datasets_cache


def by_hand(model, tokenizer, rows) -> tuple[float, float]:
    """acc and acc_norm as the harness defines them for multiple choice:
    the choice with the highest summed log-likelihood of its tokens after the
    context and a space (acc), or per character of the choice (acc_norm)."""
    torch = pytest.importorskip("torch")
    acc = norm = 0
    for row in rows:
        context = tokenizer(row["context"])["input_ids"]
        scores = []
        for choice in row["choices"]:
            whole = tokenizer(row["context"] + " " + choice)["input_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([whole[:-1]])).logits[0].double()
            logp = torch.log_softmax(logits, -1)
            positions = range(len(context) - 1, len(whole) - 1)
            scores.append(sum(float(logp[p, whole[p + 1]]) for p in positions))
        lengths = [len(choice) for choice in row["choices"]]
        acc += max(range(len(scores)), key=scores.__getitem__) == row["label"]
        normed = [s / n for s, n in zip(scores, lengths, strict=True)]
        norm += max(range(len(scores)), key=normed.__getitem__) == row["label"]
    return acc / len(rows), norm / len(rows)


def char_tokenizer():
    return char_tokenizer_of(CHARS)


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
