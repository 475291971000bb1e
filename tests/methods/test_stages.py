"""The stage API every method implements: each method's plans, applied,
give exactly the size they state; needs combine; plans name themselves
stably."""

from __future__ import annotations

import copy

import pytest

import toast
from toast.frontier.candidates import enumerate_candidates
from toast.methods import available_methods
from toast.methods.base import (
    Needs,
    Plan,
    Sizes,
    capture_shared,
    find_layout,
    get_method,
    staged_methods,
)
from toast.methods.calibrate import Calibrated
from toast.methods.heads.part import HeadsPart
from toast.methods.merge.macs import SCHEDULES

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=97,
    )
    return transformers.LlamaForCausalLM(config).eval()


def _vit():
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=16,
        patch_size=4,
    )
    return transformers.ViTModel(config, add_pooling_layer=False).eval()


def _tokens(count=4):
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, 97, (4, 16), generator=g) for _ in range(count)]
    return [{"input_ids": i, "attention_mask": torch.ones_like(i)} for i in ids]


def _images(count=4):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 3, 16, 16, generator=g) for _ in range(count)]


def _every_plan(model, data, max_blocks=2):
    """Each staged method's calibration and its plans, extended plans included."""
    available_methods()
    methods = staged_methods()
    layout = find_layout(model)
    calibration = toast.Calibration(progress=False)
    shared = capture_shared(model, data, layout, calibration, "auto")
    stats = {
        m.name: m.stages.calibrate(model, data, layout, shared, calibration, max_blocks)
        for m in methods
    }
    blocks = tuple(toast.count_params(b) for b in layout.stack.blocks)
    sizes = Sizes(toast.count_params(model), blocks)
    plans = enumerate_candidates(methods, Calibrated(stats), sizes, max_blocks, macs_matter=True)
    return layout, stats, plans


def _applied(model, layout, plan, stats):
    built, copied = copy.deepcopy((model, layout))
    for name in plan.methods:
        get_method(name).stages.apply(built, plan, stats[name], copied)
    for name in plan.methods:
        get_method(name).stages.finish(built, plan, stats[name], copied)
    return built


@pytest.mark.parametrize(("make", "data"), [(_llama, _tokens), (_vit, _images)])
def test_every_plan_applied_has_exactly_its_stated_parameters(make, data):
    model = make()
    batches = data()
    layout, stats, plans = _every_plan(model, batches)
    families = {p.family for p in plans}
    expected = {"plain", "shortgpt", "toast", "ghosted", "replaceme", "sublayer", "linearpatch"}
    if make is _vit:
        expected |= {"toast-vit", "plain+toast-vit", "toast+toast-vit"}
        for reducer in ("tome", "rapid", "token-transforming", "pitome"):
            expected |= {reducer, f"plain+{reducer}", f"toast+{reducer}"}
            expected |= {f"toast-vit+{reducer}", f"plain+toast-vit+{reducer}"}
            expected |= {f"toast+toast-vit+{reducer}"}
        # ToMe and RAPID alone at every other schedule (each its own family)
        for reducer in ("tome", "rapid"):
            expected |= {f"{reducer}-{s}" for s in SCHEDULES if s != "constant"}
        # and ToMe with Token Fusion's MLERP at every schedule
        expected |= {"tome-max"} | {f"tome-{s}-max" for s in SCHEDULES if s != "constant"}
        # ATM's counts depend on the images: alone only, where its thresholds merge
        expected |= {"atm"} & families
    assert families == expected
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for plan in plans:
        built = _applied(model, layout, plan, stats)
        assert toast.count_params(built) == plan.params_after, plan.label
        with torch.no_grad():
            out = built(**batches[0]) if isinstance(batches[0], dict) else built(batches[0])
        assert torch.isfinite(out[0]).all(), plan.label
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # copies only


def test_plans_of_a_size_remove_that_many_blocks_and_predict_finitely():
    _, _, plans = _every_plan(_llama(), _tokens(), max_blocks=3)
    for plan in plans:
        if plan.part("sublayer") is None:
            assert 1 <= plan.blocks_removed <= 3
        else:  # sub-layer plans remove no block: up to two sub-layers a block
            assert plan.blocks_removed == 0 and 1 <= len(plan.part("sublayer").removed) <= 6
        assert plan.predicted_error == plan.predicted_error  # not NaN
        assert all(a >= 1 for a, _ in plan.spans)  # the papers keep block 0


def test_needs_combine_as_a_union():
    assert (Needs() | Needs()) == Needs()
    assert (Needs() | Needs(moments=True)) == Needs(moments=True)


def test_a_plan_names_itself_stably():
    plan = Plan(
        ("remove", "toast-vit"), "plain+toast-vit", ((1, 3),), "identity", 10, 0.2,
        parts=(HeadsPart(0.5),),
    )  # fmt: skip
    assert plan.key == "plain+toast-vit|identity|1-3|0.5|"
    assert plan.label == "plain+toast-vit: remove blocks[1:3], heads ρ=0.5"
    assert plan.blocks_removed == 2
    assert plan.to_dict()["methods"] == ["remove", "toast-vit"]


def test_sizes_after_spans_count_the_modules_put_in():
    sizes = Sizes(100, (10, 20, 30, 40))
    assert sizes.after_spans([(1, 3)]) == 50
    assert sizes.after_spans([(1, 2), (3, 4)], added_per_span=5) == 100 - 60 + 10


def test_shared_pass_bounded_by_max_blocks_gives_every_method_the_all_pairs_plans():
    model, data = _llama(), _tokens()
    available_methods()
    methods = [m for m in staged_methods() if m.name in ("toast", "remove")]
    layout = find_layout(model)
    calibration = toast.Calibration(progress=False)
    blocks = tuple(toast.count_params(b) for b in layout.stack.blocks)
    sizes = Sizes(toast.count_params(model), blocks)
    found = []
    for bound in (None, 2):
        shared = capture_shared(model, data, layout, calibration, "auto", max_blocks=bound)
        stats = {
            m.name: m.stages.calibrate(model, data, layout, shared, calibration, 2) for m in methods
        }
        found.append(enumerate_candidates(methods, Calibrated(stats), sizes, 2, macs_matter=True))
    key = [(p.methods, p.spans, p.params_after) for p in found[0]]
    assert key == [(p.methods, p.spans, p.params_after) for p in found[1]]
    for a, b in zip(found[0], found[1], strict=True):
        assert a.predicted_error == pytest.approx(b.predicted_error, rel=1e-12, nan_ok=True)


def test_a_chunked_shared_pass_gives_the_whole_tables_plans_and_a_small_picklable_calibration():
    import pickle

    import numpy as np

    from toast.core.chunked import ChunkedMoments, PairMoments, pair_nbytes

    model, data = _llama(), _tokens()
    available_methods()
    methods = [m for m in staged_methods() if m.name in ("toast", "remove", "replaceme")]
    layout = find_layout(model)
    calibration = toast.Calibration(progress=False)
    blocks = tuple(toast.count_params(b) for b in layout.stack.blocks)
    sizes = Sizes(toast.count_params(model), blocks)
    width = model.config.hidden_size
    found, tables = [], []
    for bound in (2**40, pair_nbytes(width, 0)):  # whole moments; one pair at a time
        shared = capture_shared(model, data, layout, calibration, "auto", 2, bound)
        assert isinstance(shared.moments, ChunkedMoments) == (bound < 2**40)
        tables.append({m: shared.errors(m) for m in ("linear", "affine", "mse")})
        stats = {
            m.name: m.stages.calibrate(model, data, layout, shared, calibration, 2) for m in methods
        }
        shared.close()
        stats = pickle.loads(pickle.dumps(stats))  # what the search cache stores
        found.append(enumerate_candidates(methods, Calibrated(stats), sizes, 2, macs_matter=True))
    for metric, table in tables[0].items():
        np.testing.assert_allclose(tables[1][metric], table, rtol=1e-12, err_msg=metric)
    key = [(p.methods, p.spans, p.params_after) for p in found[0]]
    assert key == [(p.methods, p.spans, p.params_after) for p in found[1]]
    for a, b in zip(found[0], found[1], strict=True):
        assert a.predicted_error == pytest.approx(b.predicted_error, rel=1e-12, nan_ok=True)
    kept = stats["toast"].analysis.moments
    assert isinstance(kept, PairMoments)
    toast_spans = {s for p in found[1] if p.methods[0] == "toast" for s in p.spans}
    assert toast_spans <= set(kept.spans)
    for plan in found[1]:  # every plan applies from what the calibration kept
        if plan.methods[0] in ("toast", "remove"):
            _applied(model, layout, plan, stats)


def test_span_moments_from_disk_are_kept_within_the_replays_memory_and_said(monkeypatch):
    import toast.methods.stages as stages_module
    from toast.core.chunked import ChunkedMoments, pair_nbytes

    model, data = _llama(), _tokens()
    available_methods()
    toast_method = next(m for m in staged_methods() if m.name == "toast")
    layout = find_layout(model)
    calibration = toast.Calibration(progress=False)
    sizes = Sizes(
        toast.count_params(model), tuple(toast.count_params(b) for b in layout.stack.blocks)
    )
    bound = pair_nbytes(model.config.hidden_size, 0)
    # as if a span's moments took the whole bound: room for two
    monkeypatch.setattr(stages_module, "pair_moments_nbytes", lambda dim: bound)
    shared = capture_shared(model, data, layout, calibration, "auto", 2, bound)
    assert isinstance(shared.moments, ChunkedMoments)
    stats = toast_method.stages.calibrate(model, data, layout, shared, calibration, 2)
    shared.close()
    kept = stats.analysis.moments.spans
    assert len(kept) == 2 and "spans were kept" in stats.note
    from toast.methods.span_plans import span_plans
    from toast.methods.translate.stages import TRANSLATORS

    exact = [next(span_plans(stats.errors[k], n)) for k in TRANSLATORS for n in (1, 2)]
    assert set(kept) == set(list(dict.fromkeys(s for plan in exact for s in plan))[:2])
    plans = toast_method.stages.propose(stats, sizes, 2, macs_matter=True)
    assert plans and all(set(p.spans) <= set(kept) for p in plans)
