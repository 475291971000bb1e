"""toast.compress: one pass from a model and a loader to a patched model."""

import pytest
from conftest import rel_err

torch = pytest.importorskip("torch")
hf_models = pytest.importorskip("hf_models")

import toast  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


@pytest.mark.parametrize("name", ["vit", "llama"])
def test_compress_removes_the_budget_and_reports_it(name):
    family = next(f for f in hf_models.FAMILIES if f.name == name)
    model = hf_models.build(family)
    batches = hf_models.loader(family, 24, batch_size=8)
    before = toast.count_params(model)
    model, report = toast.compress(model, batches, budget=2, folds=3, progress=False)
    assert report.blocks_removed == 2
    assert report.params_before == before
    assert report.params_after == toast.count_params(model)
    # exactly the removed blocks' parameters, plus an affine map (d² + d) per span
    original = toast.find_blocks(hf_models.build(family)).blocks
    removed = sum(
        toast.count_params(original[k]) for s in report.spans for k in range(s.start, s.stop)
    )
    d = hf_models.HIDDEN
    assert report.params_after == before - removed + len(report.spans) * (d * d + d)
    assert report.blocks_after == len(toast.find_blocks(model).blocks)
    assert all(s.start >= 1 for s in report.spans)
    assert "predicted error" in report.to_markdown()
    kwargs = batches[0] if isinstance(batches[0], dict) else {"pixel_values": batches[0]}
    with torch.inference_mode():
        assert torch.isfinite(model(**kwargs).last_hidden_state).all()


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
    with pytest.raises(ValueError, match="budget"):
        toast.compress(model, hf_models.loader(hf_models.FAMILIES[0], 4, 4), progress=False)
