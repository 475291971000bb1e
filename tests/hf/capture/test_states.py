"""Capturing block outputs of Hugging Face models into moments."""

import numpy as np
import pytest

from tests._helpers import assert_rel

torch = pytest.importorskip("torch")
hf_models = pytest.importorskip("tests._helpers.hf_models")

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

import toast  # noqa: E402

FAMILIES = hf_models.FAMILIES
IDS = [f.name for f in FAMILIES]


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_find_blocks_locates_every_block(family):
    model = hf_models.build(family)
    stack = toast.hf.find_blocks(model)
    assert stack.num_blocks == hf_models.LAYERS
    assert (stack.final_norm is not None) == family.final_norm


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_captured_states_equal_output_hidden_states(family):
    model = hf_models.build(family)
    batches = hf_models.loader(family, n=6, batch_size=6)
    inputs = batches[0]
    kwargs = inputs if isinstance(inputs, dict) else {"pixel_values": inputs}
    with torch.inference_mode():
        hidden = model(**kwargs, output_hidden_states=True).hidden_states
    m, _ = toast.hf.capture_moments(model, batches, folds=0, progress=False)
    mask = kwargs.get("attention_mask")
    # hidden_states[k] is the input of block k for k < L; the last entry is the
    # final block's output, normalised by some families, so it is skipped there.
    last = len(hidden) - (1 if family.normalised_last else 0)
    for k in range(last):
        rows = hidden[k].reshape(-1, hf_models.HIDDEN).double().numpy()
        if mask is not None:
            rows = rows[mask.reshape(-1).bool().numpy()]
        assert_rel(m.cross(k, k), rows.T @ rows, 1e-6, f"state {k}")


# random BERT-style embeddings are rank-deficient (LayerNorm centring)
@pytest.mark.filterwarnings("ignore::toast.core.IllConditionedWarning")
@pytest.mark.parametrize("family", [f for f in FAMILIES if f.kind == "text"], ids=lambda f: f.name)
def test_padding_never_enters_the_statistics(family):
    model = hf_models.build(family)
    text = hf_models.sentences(8, seed=3)
    tight = [hf_models.pad(text[i : i + 4]) for i in (0, 4)]
    wide = [hf_models.pad(text[i : i + 4], length=14) for i in (0, 4)]
    a, _ = toast.hf.capture_moments(model, tight, folds=0, progress=False)
    b, _ = toast.hf.capture_moments(model, wide, folds=0, progress=False)
    assert a.rows == b.rows == sum(len(s) for s in text)
    for k in range(hf_models.LAYERS + 1):
        assert_rel(b.cross(k, k), a.cross(k, k), 1e-5, f"state {k}")
    ea = toast.error_matrix(a, estimator="gcv")
    eb = toast.error_matrix(b, estimator="gcv")
    iu = np.triu_indices(hf_models.LAYERS + 1, 1)
    assert_rel(eb[iu], ea[iu], 1e-5, "gcv error matrix")


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_batch_size_does_not_change_the_moments_or_the_errors(family):
    model = hf_models.build(family)
    small, _ = toast.hf.capture_moments(
        model, hf_models.loader(family, 64, batch_size=2), folds=0, progress=False
    )
    large, _ = toast.hf.capture_moments(
        model, hf_models.loader(family, 64, batch_size=64), folds=0, progress=False
    )
    assert small.rows == large.rows
    for k in range(hf_models.LAYERS + 1):
        assert_rel(small.cross(0, k), large.cross(0, k), 1e-5, f"cross(0, {k})")
    # Padding differs between the two batchings of text; the errors must not.
    iu = np.triu_indices(hf_models.LAYERS + 1, 1)
    e_small = toast.error_matrix(small, estimator="gcv", ridge=1e-6, ridge_relative=True)
    e_large = toast.error_matrix(large, estimator="gcv", ridge=1e-6, ridge_relative=True)
    assert_rel(e_small[iu], e_large[iu], 1e-5, "gcv error matrix")


@pytest.mark.parametrize("tokens", ["cls", "mean", "last"])
def test_token_choices_give_one_row_per_sequence(tokens):
    family = next(f for f in FAMILIES if f.name == "llama")
    model = hf_models.build(family)
    batches = hf_models.loader(family, 10, batch_size=5)
    m, _ = toast.hf.capture_moments(model, batches, tokens=tokens, folds=0, progress=False)
    assert m.rows == 10


def test_last_token_ignores_left_and_right_padding():
    family = next(f for f in FAMILIES if f.name == "gpt2")
    model = hf_models.build(family)
    text = hf_models.sentences(6, seed=5)
    # GPT-2 uses absolute positions, so left padding shifts them; the last
    # token agrees only when positions follow the mask: compare right padding
    # at two widths instead.
    a, _ = toast.hf.capture_moments(
        model, [hf_models.pad(text)], tokens="last", folds=0, progress=False
    )
    b, _ = toast.hf.capture_moments(
        model, [hf_models.pad(text, length=16)], tokens="last", folds=0, progress=False
    )
    for k in range(hf_models.LAYERS + 1):
        assert_rel(b.cross(k, k), a.cross(k, k), 1e-5, f"state {k}")


def test_mean_tokens_equal_masked_mean_of_hidden_states():
    family = next(f for f in FAMILIES if f.name == "bert")
    model = hf_models.build(family)
    batch = hf_models.pad(hf_models.sentences(5, seed=6))
    with torch.inference_mode():
        hidden = model(**batch, output_hidden_states=True).hidden_states
    m, _ = toast.hf.capture_moments(model, [batch], tokens="mean", folds=0, progress=False)
    w = batch["attention_mask"].unsqueeze(-1).double()
    for k in range(hf_models.LAYERS):
        mean = ((hidden[k].double() * w).sum(1) / w.sum(1)).numpy()
        assert_rel(m.sum(k), mean.sum(0), 1e-6, f"state {k}")


def test_max_samples_truncates_the_last_batch():
    family = FAMILIES[0]
    model = hf_models.build(family)
    m, _ = toast.hf.capture_moments(
        model,
        hf_models.loader(family, 12, batch_size=5),
        tokens="cls",
        max_samples=7,
        folds=0,
        progress=False,
    )
    assert m.rows == 7


def test_random_subset_is_seeded():
    family = FAMILIES[0]
    model = hf_models.build(family)
    data = torch.utils.data.TensorDataset(hf_models.images(20))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    runs = [
        toast.hf.capture_moments(
            model,
            loader,
            tokens="cls",
            max_samples=8,
            sample="random",
            seed=s,
            folds=0,
            progress=False,
        )[0]
        for s in (1, 1, 2)
    ]
    np.testing.assert_array_equal(runs[0].cross(0, 1), runs[1].cross(0, 1))
    assert not np.array_equal(runs[0].cross(0, 1), runs[2].cross(0, 1))


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_pass_ends_at_the_last_wanted_state(family):
    model = hf_models.build(family)
    batches = hf_models.loader(family, n=6, batch_size=3)
    stack = toast.hf.find_blocks(model)
    calls = {}

    def count(name):
        def hook(*_):
            calls[name] = calls.get(name, 0) + 1

        return hook

    handles = [b.register_forward_hook(count(k)) for k, b in enumerate(stack.blocks)]
    wanted = [0, 2]  # the embedding output and block 1's output
    try:
        part, _ = toast.hf.capture_moments(model, batches, states=wanted, folds=0, progress=False)
    finally:
        for h in handles:
            h.remove()
    # two batches through blocks 0 and 1 only: no later block, norm or head ran
    assert calls == {0: 2, 1: 2}
    whole, _ = toast.hf.capture_moments(model, batches, folds=0, progress=False)
    for a, k in enumerate(wanted):
        for b, j in enumerate(wanted):
            np.testing.assert_array_equal(part.cross(a, b), whole.cross(k, j))


def test_capture_leaves_training_mode_and_removes_hooks():
    family = FAMILIES[0]
    model = hf_models.build(family)
    model.train()
    toast.hf.capture_moments(model, hf_models.loader(family, 4, 4), folds=0, progress=False)
    assert model.training
    assert all(not b._forward_hooks and not b._forward_pre_hooks for b in model.layers)


def test_unknown_architecture_names_the_blocks_argument():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with pytest.raises(ValueError, match="blocks="):
        toast.hf.find_blocks(model)


def test_explicit_blocks_path_is_used_and_checked():
    family = next(f for f in FAMILIES if f.name == "dinov2")
    model = hf_models.build(family)
    assert toast.hf.find_blocks(model, blocks="encoder.layer").num_blocks == hf_models.LAYERS
    with pytest.raises(ValueError, match="no attribute path"):
        toast.hf.find_blocks(model, blocks="encoder.missing")


def test_empty_loader_raises():
    model = hf_models.build(FAMILIES[0])
    with pytest.raises(ValueError, match="no rows"):
        toast.hf.capture_moments(model, [], progress=False)


def test_nan_activations_name_the_block():
    family = FAMILIES[0]
    model = hf_models.build(family)
    with torch.no_grad():
        model.layers[2].mlp.fc2.bias.fill_(float("nan"))
    with pytest.raises(ValueError, match="block 2"):
        toast.hf.capture_moments(model, hf_models.loader(family, 4, 4), folds=0, progress=False)


@pytest.mark.parametrize("family", FAMILIES, ids=IDS)
def test_block_parts_have_the_shapes_of_their_roles(family):
    model = hf_models.build(family)
    d = hf_models.HIDDEN
    for block in toast.hf.find_blocks(model).blocks:
        parts = toast.hf.block_parts(block)
        if parts.qkv is None:
            assert (parts.q.in_features, parts.k.in_features, parts.v.in_features) == (d, d, d)
            assert parts.q.out_features == d
        else:
            assert (parts.qkv.in_features, parts.qkv.out_features) == (d, 3 * d)
        assert (parts.out.in_features, parts.out.out_features) == (d, d)
        assert parts.up.in_features == d
        assert parts.down.out_features == d
        if parts.gate is not None:
            assert parts.gate.out_features == parts.down.in_features
        assert parts.down.module is not parts.out.module


def test_gpt2_projections_are_marked_as_transposed():
    model = hf_models.build(next(f for f in FAMILIES if f.name == "gpt2"))
    parts = toast.hf.block_parts(toast.hf.find_blocks(model).blocks[0])
    assert parts.down.layout == "conv1d" and parts.down.path == "mlp.c_proj"
    assert parts.out.path == "attn.c_proj"


def test_unknown_block_layout_names_what_is_missing():
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"q/k/v \(or a fused qkv\), out, up, down"):
        toast.hf.block_parts(block)


def test_heads_are_found_outside_the_blocks():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    vit = transformers.ViTForImageClassification(
        hf_models.config("vit", num_hidden_layers=2, num_labels=3)
    )
    assert list(toast.hf.find_head(vit)) == ["classifier"]
    llama = transformers.LlamaForCausalLM(hf_models.config("llama", num_hidden_layers=2))
    assert list(toast.hf.find_head(llama)) == ["lm_head"]
    bert = transformers.BertModel(hf_models.config("bert", num_hidden_layers=2))
    assert list(toast.hf.find_head(bert)) == ["pooler"]


def test_fused_gate_up_projection_is_the_up_part():
    transformers = pytest.importorskip("transformers")
    cfg = hf_models.config("phi3", num_hidden_layers=2)
    parts = toast.hf.block_parts(toast.hf.find_blocks(transformers.Phi3Model(cfg)).blocks[0])
    assert (parts.up.path, parts.up.out_features) == ("mlp.gate_up_proj", 128)
    assert parts.down.in_features == 64
    assert parts.qkv.path == "self_attn.qkv_proj"
