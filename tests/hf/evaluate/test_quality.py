"""Measured quality (toast.hf.evaluate.quality) against independent references:
Hugging Face's own language-modelling loss, a hand-computed accuracy and
cosine, and plain removal done by surgery instead of hooks."""

from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests._helpers.hf_models import pad, sentences  # noqa: E402
from tests._helpers.replaceme_models import decoder, encoder, image_loader  # noqa: E402
from toast.hf.evaluate.quality import Evaluator, Quality, quality_metric, skipped_blocks  # noqa: E402
from toast.hf.model.blocks import find_blocks  # noqa: E402
from toast.hf.model.surgery import replace_spans  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


def _equal_length_batches(n: int = 12, length: int = 10, batch: int = 4) -> list[dict]:
    text = sentences(n, seed=3, min_len=length, max_len=length)
    return [pad(text[i : i + batch]) for i in range(0, n, batch)]


def test_perplexity_equals_the_models_own_language_modelling_loss():
    model = decoder("llama")
    batches = _equal_length_batches()
    with torch.no_grad():
        losses = [model(input_ids=b["input_ids"], labels=b["input_ids"]).loss for b in batches]
    expected = math.exp(float(torch.stack(losses).double().mean()))
    evaluator = Evaluator(batches, progress=False)
    assert evaluator.measure(model) == pytest.approx(expected, rel=1e-6)
    assert evaluator.metric == "perplexity" and evaluator.count == 12 * 9


def test_perplexity_alone_equals_the_perplexity_measured_with_fidelity():
    model, other = decoder("llama"), decoder("llama", seed=1)
    batches = _equal_length_batches()
    full = Evaluator(batches, progress=False)
    alone = Evaluator(batches, progress=False, fidelity=False)
    for m in (model, other):  # the second pass is compared with a reference, or not
        assert alone.measure(m) == full.measure(m)
        assert set(alone.last) == {"perplexity"} and alone.count == full.count
    assert "kl" in full.last


def test_padding_does_not_change_perplexity():
    model = decoder("llama")
    text = sentences(8, seed=5, min_len=3, max_len=11)
    padded = [pad(text[i : i + 4]) for i in range(0, 8, 4)]
    alone = [pad([t]) for t in text]
    one = Evaluator(padded, progress=False).measure(model)
    other = Evaluator(alone, progress=False).measure(model)
    assert one == pytest.approx(other, rel=1e-5)


def test_labels_with_ignored_positions_replace_the_inputs_as_targets():
    model = decoder("llama")
    batch = _equal_length_batches(n=4)[0]
    labels = batch["input_ids"].clone()
    labels[:, :5] = -100
    with torch.no_grad():
        expected = math.exp(float(model(input_ids=batch["input_ids"], labels=labels).loss))
    got = Evaluator([{**batch, "labels": labels}], progress=False).measure(model)
    assert got == pytest.approx(expected, rel=1e-6)


def test_skipped_blocks_equal_removing_the_blocks_by_surgery():
    model = decoder("llama")
    batches = _equal_length_batches()
    removed = copy.deepcopy(model)
    replace_spans(removed, [(2, 4)], [torch.nn.Identity()])
    evaluator = Evaluator(batches, progress=False)
    before = evaluator.measure(model)
    with skipped_blocks(find_blocks(model), [(2, 4)]):
        hooked = evaluator.measure(model)
    assert hooked == pytest.approx(evaluator.measure(removed), rel=1e-6)
    assert hooked != before
    assert evaluator.measure(model) == before  # the hooks are gone


def test_accuracy_is_the_fraction_of_argmax_predictions_equal_to_the_labels():
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        image_size=16, patch_size=4, num_labels=3,
    )  # fmt: skip
    model = transformers.ViTForImageClassification(config).eval()
    images = image_loader(n=24, batch_size=8)
    labels = [torch.arange(8) % 3 for _ in images]
    with torch.no_grad():
        hits = sum(
            int((model(pixel_values=x).logits.argmax(-1) == y).sum())
            for x, y in zip(images, labels, strict=True)
        )
    evaluator = Evaluator(list(zip(images, labels, strict=True)), progress=False)
    assert evaluator.measure(model) == pytest.approx(hits / 24)
    assert evaluator.metric == "accuracy"


def test_cosine_compares_each_samples_output_with_the_first_models():
    model = encoder("vit")
    images = image_loader(n=16, batch_size=8)
    other = copy.deepcopy(model)
    replace_spans(other, [(1, 3)], [torch.nn.Identity()])
    evaluator = Evaluator(images, progress=False)
    assert evaluator.measure(model) == pytest.approx(1.0, abs=1e-6)
    with torch.no_grad():
        a = torch.cat([model(pixel_values=x).last_hidden_state.mean(1) for x in images])
        b = torch.cat([other(pixel_values=x).last_hidden_state.mean(1) for x in images])
    expected = float(torch.nn.functional.cosine_similarity(a.double(), b.double()).mean())
    assert evaluator.measure(other) == pytest.approx(expected, rel=1e-6)
    assert evaluator.metric == "cosine" and evaluator.count == 16


def test_the_metric_follows_the_model_and_the_batches():
    assert quality_metric(decoder("llama"), {"input_ids": None}) == "perplexity"
    assert quality_metric(encoder("vit"), torch.zeros(1)) == "cosine"
    assert quality_metric(encoder("vit"), (torch.zeros(1), torch.zeros(1))) == "accuracy"


def test_a_shuffled_loader_is_refused_as_held_out_data():
    dataset = torch.utils.data.TensorDataset(torch.zeros(4, 3, 16, 16))
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, shuffle=True)
    with pytest.raises(ValueError, match="shuffle=False"):
        Evaluator(loader)


def test_measuring_restores_the_training_mode():
    model = decoder("llama").train()
    Evaluator(_equal_length_batches(n=4), progress=False).measure(model)
    assert model.training


def test_quality_markdown_lists_the_three_models():
    text = Quality("perplexity", 23.6, 163.7, 382.8, samples=24, count=12_264).to_markdown()
    assert "| original | 23.60 |" in text and "| compressed | 163.70 |" in text
    assert "| plain removal of the same blocks | 382.80 |" in text and "12,264" in text
    without = Quality("cosine", 1.0, 0.98, None, samples=8, count=8).to_markdown()
    assert "plain removal" not in without


def test_quality_markdown_shows_kl_and_agreement_for_a_causal_lm():
    def row(ppl, kl, p99, agree):
        return {"perplexity": ppl, "kl": kl, "kl_p99": p99, "agreement": agree, "tail_mass": 0.03}

    metrics = {
        "original": row(23.6, 0.0, 0.0, 1.0),
        "plain_removal": row(382.8, 2.5, 9.25, 0.41),
        "compressed": row(163.7, 1.25, 6.5, 0.5625),
    }
    quality = Quality("perplexity", 23.6, 163.7, 382.8, 24, 12_264, metrics, top_k=256)
    text = quality.to_markdown()
    assert "| model | perplexity | KL | KL p99 | top-1 agreement |" in text
    assert "| compressed | 163.70 | 1.2500 | 6.5000 | 56.25% |" in text
    assert "| original | 23.60 | 0.0000 | 0.0000 | 100.00% |" in text
    assert "256 most likely tokens" in text and "3.00%" in text
    assert "perplexity and KL: lower is better, top-1 agreement: higher" in text


def test_quality_markdown_shows_agreement_for_a_classifier():
    metrics = {k: {"accuracy": v, "agreement": a} for k, v, a in [
        ("original", 0.8, 1.0), ("compressed", 0.75, 0.875)
    ]}  # fmt: skip
    text = Quality("accuracy", 0.8, 0.75, None, 8, 8, metrics).to_markdown()
    assert "| model | accuracy | top-1 agreement |" in text
    assert "| compressed | 0.7500 | 87.50% |" in text and "KL" not in text
