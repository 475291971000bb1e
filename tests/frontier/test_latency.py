"""Tests of toast.frontier.latency: shapes, units and settings of the measurement,
never a timing value beyond "finite and positive" (machines differ)."""

import json
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.frontier import conftest as frontier_models  # noqa: E402
from toast.frontier.latency import (  # noqa: E402
    Throughput,
    _decode_once,
    _prompt,
    _token_count,
    measure_throughput,
)

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

FAST = {"rounds": 2, "warmup": 0}


def tiny_llama():
    return frontier_models.tiny_llama(layers=2).train()


def tiny_vit():
    return frontier_models.tiny_vit(layers=2, classifier=True).train()


def text_batch(rows=2, width=8):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (rows, width), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def images(rows=2):
    generator = torch.Generator().manual_seed(2)
    return torch.randn(rows, 3, 16, 16, generator=generator)


def positive(x):
    return x is not None and math.isfinite(x) and x > 0


def test_causal_lm_reports_prefill_and_decode_with_their_settings():
    result = measure_throughput(tiny_llama(), text_batch(2, 8), new_tokens=5, **FAST)
    assert result.kind == "causal-lm"
    assert result.unit == "tokens/s"
    assert (result.batch_size, result.seq_len, result.new_tokens) == (2, 8, 5)
    assert result.rounds == 2
    assert result.device == "cpu"
    assert positive(result.forward_per_s)
    assert positive(result.decode_tokens_per_s)


def test_vit_reports_images_per_second_and_no_decode():
    result = measure_throughput(tiny_vit(), {"pixel_values": images(3)}, **FAST)
    assert result.kind == "forward"
    assert result.unit == "images/s"
    assert (result.batch_size, result.seq_len) == (3, None)
    assert result.decode_tokens_per_s is None and result.new_tokens is None
    assert positive(result.forward_per_s)


def test_bare_image_tensor_and_inputs_labels_pair():
    model = tiny_vit()
    bare = measure_throughput(model, images(2), **FAST)
    pair = measure_throughput(model, (images(2), torch.tensor([0, 1])), **FAST)
    assert bare.unit == pair.unit == "images/s"
    assert bare.batch_size == pair.batch_size == 2


def test_other_tensors_are_counted_in_samples():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    result = measure_throughput(model, torch.randn(6, 4), **FAST)
    assert (result.unit, result.kind, result.batch_size) == ("samples/s", "forward", 6)
    assert positive(result.forward_per_s)


def test_batch_size_repeats_rows_cyclically():
    seen = []

    class Recorder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)

        def forward(self, x):
            seen.append(x.clone())
            return self.linear(x)

    batch = torch.arange(8.0).reshape(2, 4)
    result = measure_throughput(Recorder(), batch, batch_size=5, rounds=1, warmup=0)
    assert result.batch_size == 5
    assert torch.equal(seen[0], batch[[0, 1, 0, 1, 0]])


def test_batch_size_on_a_text_batch():
    result = measure_throughput(tiny_llama(), text_batch(2, 8), batch_size=5, new_tokens=2, **FAST)
    assert (result.batch_size, result.seq_len) == (5, 8)


def test_batch_size_smaller_than_the_batch_takes_the_first_rows():
    result = measure_throughput(tiny_vit(), images(4), batch_size=1, **FAST)
    assert result.batch_size == 1


def test_training_flag_is_restored():
    model = tiny_llama()
    model.train()
    model.model.layers[0].eval()  # a mixed state must come back as it was
    measure_throughput(model, text_batch(), new_tokens=2, rounds=1, warmup=0)
    assert model.training
    assert not model.model.layers[0].training
    assert model.model.layers[1].training


def test_training_flag_is_restored_on_error():
    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)

        def forward(self, x):
            assert not self.training
            raise RuntimeError("boom")

    model = Broken().train()
    with pytest.raises(RuntimeError, match="boom"):
        measure_throughput(model, torch.zeros(2, 4), rounds=1, warmup=0)
    assert model.training


def test_token_count_keeps_only_attention_mask_tokens():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    assert _token_count({"input_ids": ids, "attention_mask": mask}) == 3 + 2 + 4
    assert _token_count({"input_ids": ids}) == 12


def test_prompt_drops_padding_on_either_side_and_is_capped():
    ids = torch.tensor([[0, 0, 7, 8], [1, 2, 3, 4]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert _prompt({"input_ids": ids, "attention_mask": mask}).tolist() == [[7, 8]]
    long = torch.arange(100).reshape(1, 100)
    assert _prompt({"input_ids": long}).shape == (1, 64)


def test_padded_tokens_do_not_count_as_throughput():
    batch = text_batch(2, 8)
    batch["attention_mask"][1, 4:] = 0
    result = measure_throughput(tiny_llama(), batch, new_tokens=2, **FAST)
    assert result.seq_len == 8 and positive(result.forward_per_s)


@pytest.mark.parametrize("new_tokens", [1, 7])
def test_generate_produces_exactly_new_tokens(new_tokens):
    model = tiny_llama().eval()
    # Every token but one is an EOS, so a plain greedy generate stops at once;
    # the measured generate must still run all new_tokens steps.
    model.generation_config.eos_token_id = [t for t in range(97) if t != 50]
    prompt = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():
        plain = model.generate(prompt, max_new_tokens=7, do_sample=False, pad_token_id=0)
        seconds, generated = _decode_once(model, prompt, new_tokens)
    assert plain.shape[1] - prompt.shape[1] < 7  # the setup would shorten a naive run
    assert generated == new_tokens
    assert positive(seconds)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("rounds", 0),
        ("rounds", 1.5),
        ("warmup", -1),
        ("new_tokens", 0),
        ("batch_size", 0),
        ("max_seconds", 0.0),
    ],
)
def test_bad_arguments_name_the_argument(name, value):
    with pytest.raises(ValueError, match=name):
        measure_throughput(tiny_vit(), images(), **{name: value})


@pytest.mark.parametrize("example", [None, {"labels": [1, 2]}, ("x", "y"), [], "text"])
def test_example_without_a_tensor_says_what_was_expected(example):
    with pytest.raises(ValueError, match="tensor"):
        measure_throughput(tiny_vit(), example)


def test_untensorised_input_ids_are_refused_clearly():
    with pytest.raises(ValueError, match="return_tensors"):
        measure_throughput(
            tiny_llama(), {"input_ids": [[1, 2]], "attention_mask": torch.ones(1, 2)}
        )


def test_max_seconds_stops_adding_rounds_but_keeps_one():
    result = measure_throughput(tiny_vit(), images(), rounds=50, warmup=0, max_seconds=1e-9)
    assert result.rounds == 1


def test_describe_states_batch_unit_device_and_rounds():
    lm = measure_throughput(tiny_llama(), text_batch(2, 8), new_tokens=3, **FAST).describe()
    assert "tokens/s prefill (batch 2 \u00d7 8, no KV cache)" in lm
    assert "tokens/s decode (batch 1, 3 new tokens, KV cache)" in lm
    assert lm.endswith("cpu, median of 2")
    vit = measure_throughput(tiny_vit(), images(3), **FAST).describe()
    assert "images/s (batch 3)" in vit and "decode" not in vit


def test_describe_formats_rates_readably():
    result = Throughput("causal-lm", "cpu", 4, 128, 1234.4, 56.71, 32, 5, "tokens/s")
    assert result.describe() == (
        "1,234 tokens/s prefill (batch 4 \u00d7 128, no KV cache); "
        "56.7 tokens/s decode (batch 1, 32 new tokens, KV cache); cpu, median of 5"
    )


def test_to_dict_is_json_ready():
    result = measure_throughput(tiny_vit(), images(), **FAST)
    data = json.loads(json.dumps(result.to_dict()))
    assert data["unit"] == "images/s" and data["batch_size"] == 2
    assert Throughput(**data) == result
