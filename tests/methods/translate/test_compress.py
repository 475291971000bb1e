"""toast.compress: one pass from a model and a loader to a patched model."""

import warnings

import pytest

from tests._helpers import rel_err

torch = pytest.importorskip("torch")
hf_models = pytest.importorskip("tests._helpers.hf_models")

import toast  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


@pytest.mark.parametrize("family", hf_models.FAMILIES, ids=[f.name for f in hf_models.FAMILIES])
def test_compress_removes_the_budget_and_reports_it(family):
    model = hf_models.build(family)
    batches = hf_models.loader(family, 24, batch_size=8)
    before = toast.count_params(model)
    with warnings.catch_warnings():
        # random BERT-style embeddings are rank-deficient (LayerNorm centring)
        warnings.simplefilter("ignore", toast.core.IllConditionedWarning)
        model, report = toast.compress(model, batches, budget=2, folds=3, progress=False)
    assert report.blocks_removed == 2
    assert report.params_before == before
    assert report.params_after == toast.count_params(model)
    # exactly the removed blocks' parameters, plus an affine map (d² + d) per span
    original = toast.hf.find_blocks(hf_models.build(family)).blocks
    removed = sum(
        toast.count_params(original[k]) for s in report.spans for k in range(s.start, s.stop)
    )
    d = hf_models.HIDDEN
    assert report.params_after == before - removed + len(report.spans) * (d * d + d)
    assert report.blocks_after == len(toast.hf.find_blocks(model).blocks)
    assert all(s.start >= 1 for s in report.spans)
    assert "predicted error" in report.to_markdown()
    kwargs = batches[0] if isinstance(batches[0], dict) else {"pixel_values": batches[0]}
    with torch.inference_mode():
        assert torch.isfinite(model(**kwargs).last_hidden_state).all()


def test_num_blocks_and_budget_give_identical_weights():
    family = hf_models.FAMILIES[0]
    batches = hf_models.loader(family, 24, batch_size=8)
    weights = {}
    for name in ("num_blocks", "budget"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", toast.core.IllConditionedWarning)
            model, report = toast.compress(
                hf_models.build(family), batches, method="toast", folds=3, progress=False,
                **{name: 2},
            )  # fmt: skip
        assert report.blocks_removed == 2
        weights[name] = model.state_dict()
    by_num_blocks, by_budget = weights["num_blocks"], weights["budget"]
    assert by_num_blocks.keys() == by_budget.keys()
    assert all(torch.equal(by_num_blocks[k], by_budget[k]) for k in by_budget)


def test_num_blocks_and_budget_given_with_different_values_raise_naming_both():
    family = hf_models.FAMILIES[0]
    with pytest.raises(ValueError, match="num_blocks=2 and budget=3 differ"):
        toast.compress(hf_models.build(family), hf_models.loader(family, 8, 8), num_blocks=2,
                       budget=3, progress=False)  # fmt: skip


def test_compress_reproduces_an_identity_span():
    family = hf_models.FAMILIES[0]
    model = hf_models.build(family)
    with torch.no_grad():
        for k in (2, 3):  # blocks 2 and 3 write nothing into the residual stream
            model.layers[k].attention.o_proj.weight.zero_()
            model.layers[k].attention.o_proj.bias.zero_()
            model.layers[k].mlp.fc2.weight.zero_()
            model.layers[k].mlp.fc2.bias.zero_()
    batches = hf_models.loader(family, 24, batch_size=8)
    with torch.inference_mode():
        reference = model(pixel_values=batches[0]).last_hidden_state
    model, report = toast.compress(
        model, batches, budget=2, estimator="gcv", ridge=1e-10, progress=False
    )
    assert [(s.start, s.stop) for s in report.spans] == [(2, 4)]
    with torch.inference_mode():
        out = model(pixel_values=batches[0]).last_hidden_state
    assert rel_err(out.double().numpy(), reference.double().numpy()) < 1e-5


def test_compress_needs_a_budget_or_a_bound():
    model = hf_models.build(hf_models.FAMILIES[0])
    with pytest.raises(ValueError, match="num_blocks"):
        toast.compress(model, hf_models.loader(hf_models.FAMILIES[0], 4, 4), progress=False)


def _vit_and_batches(n=24):
    family = hf_models.FAMILIES[0]
    return hf_models.build(family), hf_models.loader(family, n, batch_size=8)


@pytest.mark.parametrize("kind", ["mlp", "resmlp"])
def test_trained_translators_replace_the_span_with_their_own_parameters(kind):
    model, batches = _vit_and_batches()
    before = toast.count_params(model)
    removed = sum(toast.count_params(model.layers[k]) for k in (1, 2))
    model, report = toast.compress(
        model,
        batches,
        spans=[(1, 3)],
        translator=kind,
        train_steps=5,
        check_fraction=0.0,  # every batch fits: no fallback to the identity
        progress=False,
    )
    translator = toast.hf.find_blocks(model).blocks[1].translator
    expected = {
        "mlp": toast.translators.MLPTranslator,
        "resmlp": toast.translators.ResMLPTranslator,
    }[kind]
    assert isinstance(translator, expected)
    assert next(translator.parameters()).dtype == torch.float32  # the model's dtype
    assert report.params_after == before - removed + toast.count_params(translator)
    with torch.inference_mode():
        assert torch.isfinite(model(pixel_values=batches[0]).last_hidden_state).all()


def test_trained_translator_learns_the_span_it_replaces():
    # 300 Adam steps must beat the untrained module on the rows it was fit on.
    model, batches = _vit_and_batches()
    with toast.hf.capture_rows(model, batches, [1, 3], progress=False) as rows:
        x, y = torch.from_numpy(rows.state(0).copy()), torch.from_numpy(rows.state(1).copy())
    untrained = toast.translators.train_translator(x, y, "mlp", steps=1, lr=1e-12, progress=False)
    _, report = toast.compress(model, batches, spans=[(1, 3)], translator="mlp", progress=False)
    trained = toast.hf.find_blocks(model).blocks[1].translator
    with torch.inference_mode():
        before = torch.nn.functional.mse_loss(untrained(x), y)
        after = torch.nn.functional.mse_loss(trained(x), y)
    assert after < 0.5 * before


def test_sequential_fit_of_one_span_equals_the_independent_fit():
    a, batches = _vit_and_batches()
    b, _ = _vit_and_batches()
    # every batch fits (sequential fits hold nothing out)
    options = {"spans": [(1, 3)], "folds": 3, "check_fraction": 0.0, "progress": False}
    toast.compress(a, batches, fit="independent", **options)
    toast.compress(b, batches, fit="sequential", **options)
    wa = toast.hf.find_blocks(a).blocks[1].translator.weight
    wb = toast.hf.find_blocks(b).blocks[1].translator.weight
    assert rel_err(wb.detach().double().numpy(), wa.detach().double().numpy()) < 1e-6


def test_sequential_fit_uses_the_partially_compressed_model():
    # The second translator must be the one fitted on the model whose first
    # span is already replaced (input and target from that model).
    model, batches = _vit_and_batches()
    reference, _ = _vit_and_batches()
    toast.compress(model, batches, spans=[(1, 2), (3, 4)], fit="sequential", progress=False)

    m, _ = toast.hf.capture_moments(reference, batches, states=[1, 2], folds=0, progress=False)
    toast.io.replace_spans(reference, [(1, 2)], [toast.fit_translator(m, 0, 1, kind="affine")])
    m, _ = toast.hf.capture_moments(reference, batches, states=[3, 4], folds=0, progress=False)
    expected = toast.fit_translator(m, 0, 1, kind="affine")

    second = toast.hf.find_blocks(model).blocks[3].translator
    got = second.weight.detach().double().numpy().T
    assert rel_err(got, expected.weight) < 1e-5
    independent, _ = _vit_and_batches()
    toast.compress(independent, batches, spans=[(1, 2), (3, 4)], progress=False)
    other_block = toast.hf.find_blocks(independent).blocks[3]
    other = other_block.translator.weight.detach().double().numpy().T
    assert rel_err(other, expected.weight) > 1e-3  # the two protocols differ


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"spans": [(1, 3)], "budget": 2}, "either spans"),
        ({"spans": [(1, 3), (2, 4)]}, "overlap"),
        ({"spans": [(1, 9)]}, "start < stop <= 4"),
        ({"spans": [(1, 3)], "translator": "cubic"}, "translator must be one of"),
        ({"spans": [(1, 3)], "fit": "greedy"}, "fit must be"),
    ],
)
def test_bad_compress_arguments_are_rejected(kwargs, match):
    model, batches = _vit_and_batches(8)
    with pytest.raises(ValueError, match=match):
        toast.compress(model, batches, progress=False, **kwargs)


@pytest.mark.parametrize(
    ("translator", "fit"),
    [("affine", "independent"), ("affine", "sequential"), ("mlp", "independent")],
)
def test_one_call_searches_for_the_blocks_once(monkeypatch, translator, fit):
    model, batches = _vit_and_batches(16)
    modules = len(list(model.named_modules()))
    calls = []
    from toast.hf.model import blocks

    original = blocks._is_block_list

    def counting(module):
        calls.append(module)
        return original(module)

    monkeypatch.setattr(blocks, "_is_block_list", counting)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        toast.compress(
            model,
            batches,
            spans=[(1, 2), (3, 4)],
            translator=translator,
            fit=fit,
            train_steps=2,
            estimator="gcv",
            progress=False,
        )
    assert len(calls) == modules  # one search over the model, then lookups by path
