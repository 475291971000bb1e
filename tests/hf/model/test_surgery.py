"""Replacing spans of blocks by translators, in place."""

import pytest

from tests._helpers import rel_err

torch = pytest.importorskip("torch")
hf_models = pytest.importorskip("tests._helpers.hf_models")

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

import toast  # noqa: E402

FAMILIES = hf_models.FAMILIES
IDS = [f.name for f in FAMILIES]
SPAN = (1, 3)  # blocks 1 and 2 of 4


def _forward(model, batch):
    kwargs = batch if isinstance(batch, dict) else {"pixel_values": batch}
    with torch.inference_mode():
        return model(**kwargs).last_hidden_state


def _n_params(module):
    return sum(p.numel() for p in module.parameters())


def _residual_outputs(block):
    """The parameters writing into the residual stream of one block."""
    names = ("o_proj", "out_proj", "fc2", "down_proj", "c_proj", "Wo", "wo")
    found = [
        m
        for name, m in block.named_modules()
        if name.rpartition(".")[2] in names and any(True for _ in m.parameters(recurse=False))
    ]
    # BERT-style output dense layers sit in `attention.output.dense` / `output.dense`
    found += [m for name, m in block.named_modules() if name.endswith("output.dense")]
    return found


# BERT's rank-deficient states
@pytest.mark.filterwarnings("ignore::toast.core.IllConditionedWarning")
@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_replaced_model_runs_with_the_expected_parameter_count(family):
    model = hf_models.build(family)
    batches = hf_models.loader(family, 8, batch_size=4)
    m, stack = toast.hf.capture_moments(model, batches, folds=0, progress=False)
    t = toast.fit_translator(m, *SPAN, kind="affine")
    removed = sum(_n_params(stack.blocks[k]) for k in range(*SPAN))
    before = _n_params(model)
    toast.io.replace_spans(model, [SPAN], [t])
    d = hf_models.HIDDEN
    assert _n_params(model) == before - removed + d * d + d
    out = _forward(model, batches[0])
    assert torch.isfinite(out).all()
    assert model.config.num_hidden_layers == hf_models.LAYERS - 1


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.name != "bert"], ids=lambda f: f.name)
def test_a_span_of_identity_blocks_has_zero_error_and_is_reproduced(family):
    # Pre-LN blocks whose residual branches write zeros are the identity map:
    # the error of that span is ~0 and the translator must reproduce the model.
    model = hf_models.build(family)
    with torch.no_grad():
        for k in range(*SPAN):
            blocks = model.get_submodule(toast.hf.find_blocks(model).path)
            for module in _residual_outputs(blocks[k]):
                for p in module.parameters(recurse=False):
                    p.zero_()
    batches = hf_models.loader(family, 16, batch_size=8)
    reference = [_forward(model, b) for b in batches]
    m, _ = toast.hf.capture_moments(model, batches, folds=0, progress=False)
    E = toast.error_matrix(m, estimator="in_sample", ridge=1e-8, ridge_relative=True)
    # ~0 up to the precision of a residual computed from moments (the RSS is a
    # difference of traces, so its square root carries ~sqrt(eps * cond)).
    assert E[SPAN] < 1e-4
    assert E[SPAN] < 1e-2 * min(E[0, 1], E[3, 4])
    t = toast.fit_translator(m, *SPAN, kind="affine", ridge=1e-10, ridge_relative=True)
    toast.io.replace_spans(model, [SPAN], [t])
    for batch, ref in zip(batches, reference, strict=True):
        assert rel_err(_forward(model, batch).double().numpy(), ref.double().numpy()) < 1e-5


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_states_before_the_span_are_unchanged(family):
    model = hf_models.build(family)
    batches = hf_models.loader(family, 6, batch_size=6)
    before, _ = toast.hf.capture_moments(model, batches, folds=0, progress=False)
    toast.io.replace_spans(
        model,
        [SPAN],
        [toast.core.Translator("identity", None, None, 1.0, hf_models.HIDDEN, "none")],
    )
    after, _ = toast.hf.capture_moments(model, batches, folds=0, progress=False)
    assert after.num_states == hf_models.LAYERS  # one translator for two blocks
    for k in range(SPAN[0] + 1):
        assert rel_err(after.cross(k, k), before.cross(k, k)) < 1e-12


def test_identity_span_equals_deleting_the_blocks():
    family = next(f for f in FAMILIES if f.name == "llama")
    a, b = hf_models.build(family), hf_models.build(family)
    batch = hf_models.loader(family, 4, 4)[0]
    toast.io.replace_spans(a, [SPAN], [torch.nn.Identity()])
    del b.layers[SPAN[0] : SPAN[1]]
    b.config.num_hidden_layers = hf_models.LAYERS - 2
    for position, layer in enumerate(b.layers):
        layer.self_attn.layer_idx = position
    assert rel_err(_forward(a, batch).numpy(), _forward(b, batch).numpy()) == 0.0


def test_layer_indices_are_renumbered():
    family = next(f for f in FAMILIES if f.name == "qwen2")
    model = hf_models.build(family)
    toast.io.replace_spans(model, [(1, 3)], [torch.nn.Identity()])
    layers = model.layers
    assert [
        getattr(layer, "self_attn", None) and layer.self_attn.layer_idx for layer in layers
    ] == [0, None, 2]
    assert len(model.config.layer_types) == 3


def test_several_spans_and_state_dict_reach_the_translators():
    family = FAMILIES[0]
    model = hf_models.build(family)
    m, _ = toast.hf.capture_moments(model, hf_models.loader(family, 8, 4), folds=0, progress=False)
    spans = [(3, 4), (1, 2)]
    toast.io.replace_spans(model, spans, [toast.fit_translator(m, *s) for s in spans])
    keys = [k for k in model.state_dict() if ".translator." in k]
    assert len(keys) == 4  # weight and bias of two translators
    model.to(torch.float64)
    assert all(p.dtype == torch.float64 for p in model.parameters())


@pytest.mark.parametrize(
    "spans,match",
    [([(1, 3), (2, 4)], "overlap"), ([(0, 5)], "0 <= start < stop <= 4"), ([(2, 2)], "start")],
)
def test_bad_spans_are_rejected(spans, match):
    model = hf_models.build(FAMILIES[0])
    with pytest.raises(ValueError, match=match):
        toast.io.replace_spans(model, spans, [torch.nn.Identity()] * len(spans))


def _kwargs(batch):
    return batch if isinstance(batch, dict) else {"pixel_values": batch}


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_output_hidden_states_lists_the_patched_depth(family):
    model = hf_models.build(family)
    batch = hf_models.loader(family, 4, batch_size=4)[0]
    with torch.inference_mode():
        before = model(**_kwargs(batch), output_hidden_states=True).hidden_states
    toast.io.replace_spans(model, [SPAN], [torch.nn.Linear(hf_models.HIDDEN, hf_models.HIDDEN)])
    with torch.inference_mode():
        after = model(**_kwargs(batch), output_hidden_states=True).hidden_states
    # one entry per block plus the embeddings: two blocks became one translator
    assert len(after) == len(before) - 1
    for k in range(SPAN[0] + 1):
        torch.testing.assert_close(after[k], before[k], rtol=0, atol=0)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.kind == "text"], ids=lambda f: f.name)
def test_patched_model_still_ignores_padding(family):
    model = hf_models.build(family)
    batches = hf_models.loader(family, 8, batch_size=8)
    m, _ = toast.hf.capture_moments(model, batches, folds=0, progress=False)
    toast.io.replace_spans(model, [SPAN], [toast.fit_translator(m, *SPAN, ridge=1e-6)])
    text = hf_models.sentences(4, seed=5)
    tight, wide = hf_models.pad(text), hf_models.pad(text, length=15)
    a, b = _forward(model, tight), _forward(model, wide)
    valid = tight["attention_mask"].bool()
    torch.testing.assert_close(b[:, : a.shape[1]][valid], a[valid], rtol=1e-5, atol=1e-5)


def test_classification_head_runs_on_the_patched_model():
    transformers = pytest.importorskip("transformers")
    cfg = hf_models.config("vit", num_labels=5)
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(cfg).eval()
    toast.io.replace_spans(model, [SPAN], [torch.nn.Identity()])
    with torch.inference_mode():
        logits = model(pixel_values=hf_models.images(3)).logits
    assert logits.shape == (3, 5) and torch.isfinite(logits).all()


def test_generate_with_the_kv_cache_works_after_patching():
    transformers = pytest.importorskip("transformers")
    cfg = hf_models.config("llama")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    toast.io.replace_spans(model, [SPAN], [torch.nn.Identity()])
    prompt = torch.tensor([[5, 9, 11, 4]])
    with torch.inference_mode():
        cached = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
        uncached = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=False)
    assert cached.shape == (1, 10)
    torch.testing.assert_close(cached, uncached)


def test_a_translator_in_first_place_records_the_embedding_output():
    family = FAMILIES[0]
    model = hf_models.build(family)
    batch = hf_models.images(2)
    with torch.inference_mode():
        before = model(pixel_values=batch, output_hidden_states=True).hidden_states
    toast.io.replace_spans(model, [(0, 2)], [torch.nn.Identity()])
    with torch.inference_mode():
        after = model(pixel_values=batch, output_hidden_states=True).hidden_states
    assert len(after) == len(before) - 1
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    torch.testing.assert_close(after[1], before[0], rtol=0, atol=0)  # identity output


def _dinov2_backbone(out_indices):
    transformers = pytest.importorskip("transformers")
    cfg = hf_models.config("dinov2", out_indices=out_indices)
    torch.manual_seed(0)
    return transformers.Dinov2Backbone(cfg).eval()


def test_backbone_outputs_follow_their_stages_through_the_patch():
    model = _dinov2_backbone([2, 4])
    with torch.no_grad():
        for k in (0, 1):  # blocks 0 and 1 become the identity
            for module in (
                model.encoder.layer[k].attention.o_proj,
                model.encoder.layer[k].mlp.fc2,
            ):
                module.weight.zero_()
                module.bias.zero_()
    batch = hf_models.images(2)
    with torch.inference_mode():
        before = model(pixel_values=batch).feature_maps
    toast.io.replace_spans(model, [(0, 2)], [torch.nn.Identity()])
    assert model.config.stage_names == ["stem", "stage1", "stage2", "stage3"]
    assert model.config.out_features == ["stage1", "stage3"]
    with torch.inference_mode():
        after = model(pixel_values=batch).feature_maps
    for a, b in zip(after, before, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_a_backbone_output_inside_a_span_is_refused_before_patching():
    model = _dinov2_backbone([2, 4])
    with pytest.raises(ValueError, match="stage2.*inside a replaced span"):
        toast.io.replace_spans(model, [(1, 3)], [torch.nn.Identity()])
    assert len(model.encoder.layer) == 4


def test_translators_follow_the_model_training_mode():
    model = hf_models.build(FAMILIES[0])  # eval mode
    toast.io.replace_spans(model, [SPAN], [toast.translators.ResMLPTranslator(hf_models.HIDDEN)])
    assert not toast.hf.find_blocks(model).blocks[1].translator.training
