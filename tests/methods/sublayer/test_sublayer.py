"""Sub-layer pruning: a removed sub-layer is exactly its output set to zero,
the parameters drop by exactly its modules', saves reload identically, the
score selection takes the lowest independently computed scores, and bad
requests fail with a message naming the fix."""

from __future__ import annotations

import copy

import pytest

import toast
from tests._helpers import hf_models as H

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

FAMILIES = {f.name: f for f in H.FAMILIES}
# (family, block list, attention child, its norm, MLP child, its norm)
LAYOUTS = {
    "llama": ("layers", "self_attn", "input_layernorm", "mlp", "post_attention_layernorm"),
    "qwen2": ("layers", "self_attn", "input_layernorm", "mlp", "post_attention_layernorm"),
    "gpt2": ("h", "attn", "ln_1", "mlp", "ln_2"),
    "vit": ("layers", "attention", "layernorm_before", "mlp", "layernorm_after"),
}


def _model(name):
    return H.build(FAMILIES[name])


def _batches(name, n=8):
    return H.loader(FAMILIES[name], n, 4)


def _call(name, model, batch):
    with torch.no_grad():
        if FAMILIES[name].kind == "image":
            return model(pixel_values=batch).last_hidden_state
        return model(**batch).last_hidden_state


def _block(model, name, index):
    return model.get_submodule(LAYOUTS[name][0])[index]


def _children(name, kind):
    _, attn, attn_norm, mlp, mlp_norm = LAYOUTS[name]
    return (attn, attn_norm) if kind == "attention" else (mlp, mlp_norm)


def _zero_output(module, args, output):
    if isinstance(output, tuple):
        return (torch.zeros_like(output[0]), *output[1:])
    return torch.zeros_like(output)


def _numel(module):
    return sum(p.numel() for p in module.parameters())


def _remove(model, name, block, kind):
    from toast.hf.model.blocks import find_blocks
    from toast.methods.sublayer.stages import apply_sublayers

    apply_sublayers(find_blocks(model), [(block, kind)])


@pytest.mark.parametrize("kind", ["attention", "mlp"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_removal_equals_zeroed_sublayer_output(name, kind):
    original = _model(name)
    batch = _batches(name)[0]
    main = getattr(_block(original, name, 1), _children(name, kind)[0])
    handle = main.register_forward_hook(_zero_output)
    expected = _call(name, original, batch)
    handle.remove()
    pruned = copy.deepcopy(original)
    _remove(pruned, name, 1, kind)
    torch.testing.assert_close(_call(name, pruned, batch), expected, atol=1e-6, rtol=0)
    assert not torch.allclose(_call(name, original, batch), expected)  # the hook mattered


@pytest.mark.parametrize("kind", ["attention", "mlp"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_params_drop_by_exactly_the_sublayer_and_its_norm(name, kind):
    original = _model(name)
    block = _block(original, name, 2)
    gone = sum(_numel(getattr(block, child)) for child in _children(name, kind))
    pruned = copy.deepcopy(original)
    _remove(pruned, name, 2, kind)
    assert _numel(pruned) == _numel(original) - gone
    assert all(_numel(getattr(_block(pruned, name, 2), c)) == 0 for c in _children(name, kind))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_saved_then_reloaded_outputs_equal_the_pruned_model(name, tmp_path):
    model, report = toast.compress(
        _model(name), _batches(name), method="sublayer", num_sublayers=3, progress=False
    )
    toast.save_pretrained(model, tmp_path / "saved")
    back = toast.load_pretrained(tmp_path / "saved")
    batch = _batches(name)[1]
    assert torch.equal(_call(name, back, batch), _call(name, model, batch))
    assert _numel(back) == report.params_after == _numel(model)


def _independent_scores(name, model, batches):
    """Each (block, kind)'s mean 1 − cos(h, h + f(h)) over the unpadded
    tokens, from hooks on the norm's input and the main module's output."""
    totals, counts, entering, mask = {}, {}, {}, {}
    handles = []
    for b in range(H.LAYERS):
        block = _block(model, name, b)
        for kind in ("attention", "mlp"):
            main, norm = _children(name, kind)

            def enter(module, args, key=(b, kind)):
                entering[key] = args[0].double()

            def leave(module, args, output, key=(b, kind)):
                out = output[0] if isinstance(output, tuple) else output
                h = entering[key]
                cos = torch.nn.functional.cosine_similarity(h, h + out.double(), dim=-1)
                if "tokens" in mask:
                    cos = cos[mask["tokens"]]
                totals[key] = totals.get(key, 0.0) + float((1 - cos).sum())
                counts[key] = counts.get(key, 0) + cos.numel()

            handles.append(getattr(block, norm).register_forward_pre_hook(enter))
            handles.append(getattr(block, main).register_forward_hook(leave))
    for batch in batches:
        if isinstance(batch, dict):
            mask["tokens"] = batch["attention_mask"].bool()
        _call(name, model, batch)
    for handle in handles:
        handle.remove()
    return {key: totals[key] / counts[key] for key in totals}


@pytest.mark.parametrize("kind", ["attention", "mlp", "any"])
@pytest.mark.parametrize("name", ["llama", "vit"])
def test_score_selection_removes_the_lowest_scored_sublayers(name, kind):
    batches = _batches(name)  # padded text: padding is left out of the mean
    scores = _independent_scores(name, _model(name), batches)
    pool = {k: v for k, v in scores.items() if kind == "any" or k[1] == kind}
    expected = sorted(pool, key=pool.get)[:3]
    _, report = toast.compress(
        _model(name), batches, method="sublayer", num_sublayers=3, kind=kind, progress=False
    )
    assert [(r.block, r.kind) for r in report.removed] == expected
    for r in report.removed:
        assert r.score == pytest.approx(scores[(r.block, r.kind)], rel=1e-9, abs=1e-12)


def test_measured_selection_takes_the_best_measured_removal_first():
    from toast.hf.evaluate.quality import Evaluator
    from toast.hf.model.blocks import find_blocks
    from toast.methods.sublayer.parts import find_sublayers, zeroed

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(H.config("llama")).eval()
    batches = _batches("llama")
    stack = find_blocks(model)
    evaluator = Evaluator(batches, progress=False)
    evaluator.measure(model)
    perplexity = {}
    for sub in find_sublayers(stack):
        with zeroed(stack, [sub]):
            perplexity[(sub.block, sub.kind)] = evaluator.measure(model)
    _, report = toast.compress(
        model, batches, method="sublayer", num_sublayers=1, selection="measured", progress=False
    )
    first = report.removed[0]
    assert (first.block, first.kind) == min(perplexity, key=perplexity.get)
    assert first.measured == pytest.approx(min(perplexity.values()))


def test_more_sublayers_than_the_kind_has_raises_naming_the_limit():
    with pytest.raises(ValueError, match=r"num_sublayers <= 4 or kind='any'"):
        toast.compress(
            _model("llama"), _batches("llama"), method="sublayer", num_sublayers=5, kind="mlp"
        )


def test_unknown_kind_raises_naming_the_choices():
    with pytest.raises(ValueError, match=r"kind.*'attention', 'mlp', 'any'"):
        toast.compress(
            _model("llama"), _batches("llama"), method="sublayer", num_sublayers=1, kind="ffn"
        )


def test_post_norm_block_is_refused_naming_the_supported_layouts():
    with pytest.raises(ValueError, match="pre-norm blocks"):
        toast.compress(_model("bert"), _batches("bert"), method="sublayer", num_sublayers=1)
