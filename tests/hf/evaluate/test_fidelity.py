"""Fidelity to the original measured in the perplexity pass
(toast.hf.evaluate.fidelity through Evaluator.last) against a direct torch
computation over the full vocabulary: KL by ``F.kl_div`` on float64
``log_softmax``, its 99th percentile by ``torch.quantile``, agreement by
comparing argmaxes; the coarse-grained KL by summing probabilities."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402

from tests._helpers.hf_models import VOCAB  # noqa: E402
from tests._helpers.replaceme_models import decoder, encoder, image_loader, text_loader  # noqa: E402
from toast.hf.evaluate.fidelity import quantile  # noqa: E402
from toast.hf.evaluate.quality import HIGHER_IS_BETTER, METRICS, Evaluator, skipped_blocks  # noqa: E402
from toast.hf.model.blocks import find_blocks  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

SPANS = [(2, 4)]  # plain removal of these blocks is the "compressed" model


def _log_probs(model, batches) -> torch.Tensor:
    """float64 next-token log-probabilities at every predicted position
    (labels, else the inputs, -100 and padding excluded), in pass order."""
    rows = []
    for batch in batches:
        ids = batch["input_ids"]
        targets = batch.get("labels", ids.masked_fill(batch["attention_mask"] == 0, -100))
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=batch["attention_mask"]).logits
        valid = targets[:, 1:] != -100
        rows.append(torch.log_softmax(logits[:, :-1][valid].double(), dim=-1))
    return torch.cat(rows)


def _direct(model, batches) -> tuple[torch.Tensor, torch.Tensor]:
    """(original's, plain removal's) log-probabilities, computed directly."""
    lp = _log_probs(model, batches)
    with skipped_blocks(find_blocks(model), SPANS):
        lq = _log_probs(model, batches)
    return lp, lq


def _measured(model, batches, top_k) -> dict[str, float]:
    evaluator = Evaluator(batches, progress=False, top_k=top_k)
    evaluator.measure(model, "original")
    with skipped_blocks(find_blocks(model), SPANS):
        evaluator.measure(model, "plain removal")
    return evaluator.last


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_an_unmodified_model_has_kl_zero_and_agreement_one(name):
    model = decoder(name)
    evaluator = Evaluator(text_loader(16), progress=False, top_k=8)
    evaluator.measure(model, "original")
    first = evaluator.last
    evaluator.measure(copy.deepcopy(model), "copy")
    for last in (first, evaluator.last):
        assert (last["kl"], last["kl_p99"], last["agreement"]) == (0.0, 0.0, 1.0)


def test_the_pass_reports_every_metric_of_a_causal_lm():
    evaluator = Evaluator(text_loader(8), progress=False)
    perplexity = evaluator.measure(decoder("llama"))
    assert tuple(evaluator.last) == METRICS["perplexity"]
    assert evaluator.last["perplexity"] == perplexity
    assert set(evaluator.last) <= set(HIGHER_IS_BETTER)


@pytest.mark.parametrize("top_k", [VOCAB, 1000])
def test_kl_and_agreement_equal_a_direct_torch_computation_over_the_vocabulary(top_k):
    model, batches = decoder("llama"), text_loader(16)
    lp, lq = _direct(model, batches)
    kl = F.kl_div(lq, lp, log_target=True, reduction="none").sum(dim=-1)
    agreement = float((lp.argmax(-1) == lq.argmax(-1)).double().mean())
    last = _measured(model, batches, top_k)
    assert last["kl"] == pytest.approx(float(kl.mean()), abs=1e-6)
    assert last["kl_p99"] == pytest.approx(float(torch.quantile(kl, 0.99)), abs=1e-6)
    assert last["agreement"] == pytest.approx(agreement, abs=1e-12)
    assert last["tail_mass"] == 0.0 and last["kl"] > 1e-3


def test_with_fewer_tokens_kept_the_kl_is_the_coarse_grained_one_and_a_lower_bound():
    model, batches, k = decoder("llama"), text_loader(16), 5
    lp, lq = _direct(model, batches)
    ids = lp.topk(k, dim=-1).indices
    p, q = lp.exp().gather(-1, ids), lq.exp().gather(-1, ids)
    p = torch.cat([p, 1 - p.sum(-1, keepdim=True)], dim=-1)
    q = torch.cat([q, 1 - q.sum(-1, keepdim=True)], dim=-1)
    coarse = (p * (p.log() - q.log())).sum(dim=-1)
    exact = F.kl_div(lq, lp, log_target=True, reduction="none").sum(dim=-1)
    last = _measured(model, batches, k)
    assert last["kl"] == pytest.approx(float(coarse.mean()), abs=1e-6)
    assert last["kl_p99"] == pytest.approx(float(torch.quantile(coarse, 0.99)), abs=1e-6)
    assert last["tail_mass"] == pytest.approx(float(p[:, -1].mean()), abs=1e-6)
    assert last["kl"] <= float(exact.mean())


def test_padding_and_ignored_labels_are_left_out_of_the_fidelity():
    model = decoder("llama")
    batches = text_loader(16, batch_size=4)
    labelled = []
    for batch in batches:
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        labels[:, :3] = -100
        labelled.append({**batch, "labels": labels})
    lp, lq = _direct(model, labelled)
    kl = F.kl_div(lq, lp, log_target=True, reduction="none").sum(dim=-1)
    evaluator = Evaluator(labelled, progress=False, top_k=VOCAB)
    evaluator.measure(model)
    with skipped_blocks(find_blocks(model), SPANS):
        evaluator.measure(model)
    assert evaluator.count == kl.numel() < sum(int(b["attention_mask"].sum()) for b in batches)
    assert evaluator.last["kl"] == pytest.approx(float(kl.mean()), abs=1e-6)


def test_other_held_out_data_than_the_references_is_refused():
    model = decoder("llama")
    evaluator = Evaluator(text_loader(8, seed=0), progress=False)
    evaluator.measure(model)
    evaluator.heldout = text_loader(8, seed=1)
    with pytest.raises(ValueError, match="same samples in the same order"):
        evaluator.measure(model)


@pytest.mark.parametrize("top_k", [0, 2.5, True])
def test_top_k_must_be_a_positive_int(top_k):
    with pytest.raises(ValueError, match="top_k"):
        Evaluator(text_loader(8), top_k=top_k)


def _classifier():
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
        image_size=16, patch_size=4, num_labels=5,
    )  # fmt: skip
    return transformers.ViTForImageClassification(config).eval()


def _classes(model, images) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(pixel_values=x).logits.argmax(-1) for x in images])


@pytest.mark.parametrize("labelled", [True, False], ids=["accuracy", "cosine"])
def test_a_classifiers_agreement_is_the_share_of_samples_whose_class_is_the_originals(labelled):
    model, images = _classifier(), image_loader(n=24, batch_size=8)
    batches = [(x, torch.arange(8) % 5) for x in images] if labelled else images
    original = _classes(model, images)
    evaluator = Evaluator(batches, progress=False)
    evaluator.measure(model)
    assert evaluator.last["agreement"] == 1.0
    with skipped_blocks(find_blocks(model), [(1, 3)]):
        evaluator.measure(model)
        expected = float((_classes(model, images) == original).double().mean())
    assert evaluator.last["agreement"] == pytest.approx(expected, abs=1e-12)
    assert tuple(evaluator.last) == METRICS[evaluator.metric]


def test_hidden_states_compared_by_cosine_have_no_agreement():
    evaluator = Evaluator(image_loader(n=8), progress=False)
    evaluator.measure(encoder("vit"))
    assert tuple(evaluator.last) == ("cosine",)


@pytest.mark.parametrize("n", [1, 2, 7, 1000])
def test_quantile_equals_torchs(n):
    values = torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    for q in (0.0, 0.5, 0.99, 1.0):
        assert quantile(values, q) == pytest.approx(float(torch.quantile(values, q)), abs=1e-12)
