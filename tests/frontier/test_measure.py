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
