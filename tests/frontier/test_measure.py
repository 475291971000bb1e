"""What a search measures of a model: linear MACs against a hand count."""

import pytest

from toast.linear_macs import linear_macs

from .conftest import tiny_llama, token_batches

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.hf


def test_linear_macs_are_every_linear_layer_once_per_token():
    model = tiny_llama()
    (batch,) = token_batches(1, 12, 0)
    per_token = sum(
        m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear)
    )
    assert linear_macs(model, batch) == 12 * per_token


def test_linear_macs_are_per_sample_whatever_the_batch():
    model = tiny_llama()
    (batch,) = token_batches(1, 12, 0)
    one = {k: v[:1] for k, v in batch.items()}
    assert linear_macs(model, batch) == linear_macs(model, one)


def test_a_measurement_keeps_every_metric_of_its_held_out_pass():
    from toast.frontier.measure import measure
    from toast.hf.evaluate.quality import Evaluator

    model, batches = tiny_llama(), token_batches(2, 12, 0)
    evaluator = Evaluator(batches, progress=False, top_k=8)
    measured = measure(model, evaluator, batches[0], "original", latency=False)
    assert measured.metrics == evaluator.last and measured.metrics["kl"] == 0.0
    assert measured.metrics["perplexity"] == measured.quality


def test_a_measurement_cached_before_the_metrics_loads_with_none():
    from toast.frontier.measure import Measurement

    old = {"quality": 2.5, "metric": "perplexity", "params": 10, "macs": None}
    cached = Measurement.from_dict({**old, "throughput": None, "seconds": 1.0})
    assert cached.metrics == {}
    assert Measurement.from_dict(cached.to_dict()) == cached
