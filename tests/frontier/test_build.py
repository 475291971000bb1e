"""Candidates built over the original's tensors: the same model as one
built on a whole copy, the original left unchanged, untouched weights
shared rather than copied, and a stage's write into a shared weight
refused before it happens (that candidate then built on a whole copy)."""

from __future__ import annotations

import copy

import pytest

from toast.frontier import build as build_module
from toast.frontier.build import build
from toast.frontier.candidates import enumerate_candidates
from toast.hf.data.calibration import Calibration
from toast.methods.base import find_layout, get_method, staged_methods
from toast.methods.calibrate import calibrate, model_sizes

from .conftest import CALIBRATION_LENGTH, tiny_llama, token_batches

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def calibrated():
    model = tiny_llama()
    layout = find_layout(model, None)
    methods = staged_methods()
    data = token_batches(4, CALIBRATION_LENGTH, 1)
    found = calibrate(model, data, layout, methods, Calibration(progress=False), "auto", 3)
    plans = enumerate_candidates(methods, found, model_sizes(model, layout), 3, macs_matter=False)
    return model, layout, found, plans


def _whole_copy(model, layout, plan, found):
    built, copied = copy.deepcopy((model, layout))
    for name in plan.methods:
        get_method(name).stages.apply(built, plan, found.stats[name], copied)
    return built


def test_a_shared_build_gives_the_whole_copys_logits_and_leaves_the_original(calibrated):
    model, layout, found, plans = calibrated
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = token_batches(1, 12, 5)[0]["input_ids"]
    families = set()
    for plan in plans:
        families.add(plan.family)
        with torch.inference_mode():
            got = build(model, layout, plan, found).model(input_ids=ids).logits
            expected = _whole_copy(model, layout, plan, found)(input_ids=ids).logits
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert {"plain", "toast", "replaceme"} <= families
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_built_candidate_shares_the_weights_it_does_not_change(calibrated):
    model, layout, found, plans = calibrated
    plan = next(p for p in plans if p.family == "replaceme")
    built = build(model, layout, plan, found).model
    embed = built.get_input_embeddings().weight
    assert embed.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert embed is not model.get_input_embeddings().weight
    # the block ReplaceMe folds into is the candidate's own
    start = plan.spans[0][0]
    folded = built.model.layers[start - 1].mlp.down_proj.weight
    assert folded.data_ptr() != model.model.layers[start - 1].mlp.down_proj.weight.data_ptr()


def test_a_write_into_a_shared_weight_is_refused_and_built_on_a_whole_copy(calibrated, monkeypatch):
    model, layout, found, plans = calibrated
    plan = next(p for p in plans if p.family == "plain")
    before = model.get_input_embeddings().weight.clone()
    stages = get_method(plan.methods[0]).stages
    apply = stages.apply
    attempts = []

    def writing(built, plan, stats, copied):
        attempts.append(1)
        with torch.no_grad():
            built.get_input_embeddings().weight.mul_(2.0)
        apply(built, plan, stats, copied)

    monkeypatch.setattr(stages, "apply", writing)
    built = build(model, layout, plan, found).model
    assert len(attempts) == 2  # refused on the shared copy, then done on a whole one
    assert torch.equal(model.get_input_embeddings().weight, before)
    assert torch.equal(built.get_input_embeddings().weight, 2.0 * before)


def test_the_refusal_names_the_operation():
    weight = torch.ones(3)
    with pytest.raises(build_module.SharedWrite, match="add_"):
        with build_module.SharedWrites({weight.untyped_storage().data_ptr()}):
            weight.add_(1.0)
