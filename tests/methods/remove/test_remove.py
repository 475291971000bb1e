"""Plain block removal as a method: the identity-span errors against a
brute-force count, the blocks it chooses, the model it leaves."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import toast
from toast.methods.base import Layout, capture_shared, find_layout
from toast.methods.remove.config import RemoveConfig
from toast.methods.remove.stages import STAGES

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

LAYERS = 6


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=97,
    )
    return transformers.LlamaForCausalLM(config).eval()


def _batches(count=3, length=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, 97, (4, length), generator=g) for _ in range(count)]
    return [{"input_ids": i, "attention_mask": torch.ones_like(i)} for i in ids]


def _states(model, batches):
    """Every block's input, then every block's output, stacked over all
    tokens (``states[0]`` the first block's input)."""
    blocks = model.model.layers
    seen: list[list[torch.Tensor]] = [[] for _ in range(len(blocks) + 1)]

    def keep(k):
        def hook(module, args, kwargs, output):
            if k == 0:
                x = args[0] if args else kwargs["hidden_states"]
                seen[0].append(x.reshape(-1, x.shape[-1]).double())
            y = output[0] if isinstance(output, tuple) else output
            seen[k + 1].append(y.reshape(-1, y.shape[-1]).double())

        return hook

    handles = [b.register_forward_hook(keep(k), with_kwargs=True) for k, b in enumerate(blocks)]
    with torch.no_grad():
        for batch in batches:
            model(**batch)
    for h in handles:
        h.remove()
    return [torch.cat(s) for s in seen]


def test_identity_errors_equal_a_brute_force_count():
    model, data = _llama(), _batches()
    layout = find_layout(model)
    shared = capture_shared(model, data, layout, toast.Calibration(progress=False), "auto")
    errors = STAGES.calibrate(model, data, layout, shared, toast.Calibration(), 3).errors
    states = _states(model, data)
    for i in range(LAYERS + 1):
        for j in range(i + 1, LAYERS + 1):
            expected = (states[j] - states[i]).norm() / states[j].norm()
            assert errors[i, j] == pytest.approx(float(expected), rel=1e-6), (i, j)


def test_one_block_removed_is_the_one_nearest_identity_after_block_zero():
    model, data = _llama(), _batches()
    states = _states(model, data)
    brute = [
        float((states[a + 1] - states[a]).norm() / states[a + 1].norm()) for a in range(LAYERS)
    ]
    expected = 1 + int(np.argmin(brute[1:]))  # the papers keep block 0
    _, report = toast.compress(model, data, method="remove", num_blocks=1, progress=False)
    assert [(s.start, s.stop) for s in report.spans] == [(expected, expected + 1)]
    assert len(model.model.layers) == LAYERS - 1


def test_two_blocks_removed_are_the_cheapest_plan_by_brute_force():
    model, data = _llama(), _batches()
    states = _states(model, data)

    def err(a, b):
        return float((states[b] - states[a]).norm() / states[b].norm())

    plans = [((a, a + 2),) for a in range(1, LAYERS - 1)]
    plans += [((a, a + 1), (b, b + 1)) for a in range(1, LAYERS) for b in range(a + 2, LAYERS)]
    best = min(plans, key=lambda p: sum(err(a, b) for a, b in p))
    _, report = toast.compress(model, data, method="remove", num_blocks=2, progress=False)
    assert tuple((s.start, s.stop) for s in report.spans) == best
    for s in report.spans:
        assert s.error == pytest.approx(err(s.start, s.stop), rel=1e-6)


def test_given_spans_leave_the_model_the_kept_blocks_would_compute():
    model, data = _llama(), _batches(1)
    by_hand = copy.deepcopy(model)
    kept = [b for k, b in enumerate(by_hand.model.layers) if k not in (2, 3)]
    by_hand.model.layers = torch.nn.ModuleList(kept)
    for k, block in enumerate(kept):
        block.self_attn.layer_idx = k
    by_hand.config.num_hidden_layers = len(kept)
    compressed, report = toast.compress(model, None, method="remove", spans=[(2, 4)])
    with torch.no_grad():
        got = compressed(**data[0], use_cache=False).logits
        expected = by_hand(**data[0], use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert report.params_after == toast.count_params(compressed)
    assert (report.blocks_before, report.blocks_after) == (LAYERS, LAYERS - 2)
    assert "2 of 6 blocks removed" in report.to_markdown()


def test_measured_plain_removal_is_the_compressed_model():
    model, data = _llama(), _batches()
    _, report = toast.compress(
        model, data, method="remove", num_blocks=2, heldout=_batches(1, 12, 5), progress=False
    )
    assert report.quality is not None
    assert report.quality.plain_removal == report.quality.compressed


def test_a_layout_copied_with_its_model_describes_the_copy():
    model = _llama()
    layout = find_layout(model)
    copied, copied_layout = copy.deepcopy((model, layout))
    assert isinstance(copied_layout, Layout)
    assert copied_layout.stack.blocks is copied.model.layers
    assert copied_layout.stack.blocks is not model.model.layers


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({}, "num_blocks=<blocks to remove> or spans="),
        ({"num_blocks": 2, "spans": [(1, 2)]}, "one of them"),
        ({"num_blocks": 0}, "num_blocks"),
    ],
)
def test_bad_options_say_what_to_give(options, said):
    with pytest.raises(ValueError, match=said):
        RemoveConfig(**options)


def test_choosing_blocks_needs_data():
    with pytest.raises(ValueError, match="needs calibration data"):
        toast.compress(_llama(), None, method="remove", num_blocks=2)


def test_removing_every_block_is_refused():
    with pytest.raises(ValueError, match="leaves no block"):
        toast.compress(_llama(), _batches(), method="remove", num_blocks=LAYERS, progress=False)
