"""Prune&Comp (arXiv 2507.18212) against references written from its
definition: the removed block is the one of lowest Block Influence, the
scale ``α = mean_c mean_s (mean_t |x_{b+1}| / mean_t |x_b|)`` computed by
hand from the hidden states, and the folded model equals the pruned model
with ``α`` applied to the state entering the next kept block by a hook."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests._helpers.replaceme_models import (  # noqa: E402
    decoder,
    outputs,
    per_sample_states,
    text_loader,
)
from toast.hf.data.calibration import Calibration  # noqa: E402
from toast.hf.model.blocks import find_blocks  # noqa: E402
from toast.hf.model.surgery import remove_blocks  # noqa: E402
from toast.methods.prunecomp import fold_scale, prune_and_comp, resolve_fold  # noqa: E402

QUIET = Calibration(progress=False)


def _llama(tied: bool = False, seed: int = 0):
    """A tiny Llama whose RMSNorm ε is negligible: a fold is exact up to it."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=decoder("llama").config.vocab_size,
        rms_norm_eps=1e-12,
        tie_word_embeddings=tied,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.LlamaForCausalLM(config).eval()


def _by_hand(model, batches):
    """Block Influence of every block, the block of lowest BI, and its α."""
    samples = per_sample_states(model, batches)

    def cos(a, b):
        return np.sum(a * b, 1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))

    blocks = len(samples[0]) - 1
    bi = [1 - np.concatenate([cos(x[b], x[b + 1]) for x in samples]).mean() for b in range(blocks)]
    b = int(np.argmin(bi))
    ratios = [np.abs(x[b + 1]).mean(0) / np.abs(x[b]).mean(0) for x in samples]
    return np.array(bi), b, float(np.mean(np.mean(ratios, axis=0)))


def _scaled_reference(model, block, alpha):
    """``model`` without ``block``, the state entering the next kept block
    (or the final norm) multiplied by ``alpha`` by a pre-hook: unfolded."""
    model = copy.deepcopy(model)
    remove_blocks(model, [(block, block + 1)])
    layers = model.model.layers
    target = layers[block] if block < len(layers) else model.model.norm

    def pre(module, args, kwargs):
        if args:
            return (args[0] * alpha, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"] * alpha}

    target.register_forward_pre_hook(pre, with_kwargs=True)
    return model


def test_first_round_removes_the_lowest_block_influence_with_alpha_by_hand():
    model, batches = _llama(), text_loader()
    bi, block, alpha = _by_hand(model, batches)
    _, result = prune_and_comp(copy.deepcopy(model), batches, 1, QUIET)
    assert result.removed == [block]
    assert result.scales[0] == pytest.approx(alpha, rel=1e-9)
    assert result.influence[0] == pytest.approx(bi[block], rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("tied", [False, True])
def test_one_round_folded_equals_the_hooked_reference(tied):
    model, batches = _llama(tied), text_loader()
    _, block, alpha = _by_hand(model, batches)
    pruned, result = prune_and_comp(copy.deepcopy(model), batches, 1, QUIET)
    assert result.fold == ("after" if tied else "before")
    reference = _scaled_reference(model, block, alpha)
    assert sum(p.numel() for p in pruned.parameters()) == sum(
        p.numel() for p in reference.parameters()
    )
    for batch in batches[:2]:
        torch.testing.assert_close(
            outputs(pruned, batch), outputs(reference, batch), atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("fold", ["before", "after"])
@pytest.mark.parametrize("cut", [0, 2, 5])
def test_fold_scale_equals_a_scale_hook(fold, cut):
    """Any cut (first block, middle, last), either side, a large α."""
    model, batches = _llama(), text_loader()
    alpha = 1.7
    reference = _scaled_reference(model, cut, alpha)
    folded = copy.deepcopy(model)
    remove_blocks(folded, [(cut, cut + 1)])
    fold_scale(folded, find_blocks(folded), cut, alpha, fold)
    for batch in batches[:2]:
        torch.testing.assert_close(
            outputs(folded, batch), outputs(reference, batch), atol=1e-5, rtol=1e-5
        )


def test_rounds_run_on_the_compensated_model():
    """Round two equals round one on the model round one left."""
    model, batches = _llama(), text_loader(24)
    twice, result = prune_and_comp(copy.deepcopy(model), batches, 2, QUIET)
    once, first = prune_and_comp(copy.deepcopy(model), batches, 1, QUIET)
    again, second = prune_and_comp(once, batches, 1, QUIET)
    assert result.scales == pytest.approx(first.scales + second.scales, rel=1e-9)
    alive = [b for b in range(6) if b != first.removed[0]]
    assert result.removed == first.removed + [alive[second.removed[0]]]
    assert len(twice.model.layers) == 4
    for batch in batches[:1]:
        torch.testing.assert_close(outputs(twice, batch), outputs(again, batch))


def test_auto_fold_follows_tied_embeddings_and_bad_counts_are_refused():
    assert resolve_fold(_llama(tied=False), "auto") == "before"
    assert resolve_fold(_llama(tied=True), "auto") == "after"
    with pytest.raises(ValueError, match="at least one block stays"):
        prune_and_comp(_llama(), text_loader(), 6, QUIET)
