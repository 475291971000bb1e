"""Token merging through ``toast.search``: its stages propose constant-r
plans for MAC targets, extend other methods' plans, and the search builds
and measures them with the linear MACs the analytic count gives."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import toast  # noqa: E402
from tests.frontier.conftest import image_batches, tiny_llama, tiny_vit  # noqa: E402
from toast.hf.model.blocks import find_blocks  # noqa: E402
from toast.hf.model.surgery import remove_blocks  # noqa: E402
from toast.methods.base import Plan, Sizes, find_layout  # noqa: E402
from toast.methods.heads.scwp import prune_heads  # noqa: E402
from toast.methods.merge import enable_merging, merging_of  # noqa: E402
from toast.methods.merge.macs import SCHEDULES, merge_schedule, merged_macs  # noqa: E402
from toast.methods.merge.part import MergePart  # noqa: E402
from toast.methods.merge.sites import find_sites  # noqa: E402
from toast.methods.merge.stages import STAGES  # noqa: E402
from toast.methods.merge.widths import merge_widths  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


def _merge(plan):
    """The plan's reducer setting (None: no reduction)."""
    part = next((p for p in plan.parts if isinstance(p, MergePart)), None)
    return None if part is None else part.setting


def _stats(model):
    layout = find_layout(model)
    return STAGES.calibrate(model, [], layout, None, toast.Calibration(), 3)


def _analytic_linear(model, plan):
    """The plan's linear MACs, counted on a copy with its blocks removed."""
    model = copy.deepcopy(model)
    remove_blocks(model, list(plan.spans))
    heads = plan.part("toast-vit")
    if heads is not None and heads.head_sparsity is not None:
        prune_heads(model, heads.head_sparsity)
    stack = find_blocks(model)
    sites = find_sites(model, stack)
    widths = merge_widths(model, sites, stack)
    merge = _merge(plan)
    if isinstance(merge, int):
        rs = merge_schedule(merge, sites.num_blocks)
    else:  # "ToMe r=R[, <schedule>][, MLERP]"
        head, *rest = merge.split(", ")
        schedule = next((part for part in rest if part != "MLERP"), "constant")
        rs = merge_schedule(int(head.split("r=")[1]), sites.num_blocks, schedule)
    return merged_macs(widths, rs).linear


def test_a_mac_search_measures_merging_alone_and_combined_at_the_analytic_macs(tmp_path):
    model = tiny_vit()
    data, heldout = image_batches(3, 1), image_batches(1, 2)
    result = toast.search(
        model,
        data,
        heldout,
        target="macs=20%",
        # merging and the methods it combines with; every plan of theirs measured
        methods=["remove", "toast-vit", "tome"],
        max_measured=200,
        cache=tmp_path,
        latency=False,
        progress=False,
    )
    merged = [m for m in result.measured if _merge(m.candidate) is not None]
    families = {m.candidate.family for m in merged}
    assert "tome" in families
    assert any(f.endswith("+tome") for f in families)
    checked = 0
    for m in merged:
        assert m.measurement.params == m.candidate.params_after
        if m.candidate.translator in (None, "identity"):  # nothing new in the blocks' place
            assert m.measurement.macs == _analytic_linear(model, m.candidate)
            checked += 1
    assert checked >= 2


def test_every_r_that_merges_something_is_proposed_with_growing_savings():
    stats = _stats(tiny_vit())
    sizes = Sizes(1000, (100,) * 6)
    plans = STAGES.propose(stats, sizes, 3, macs_matter=True)
    constant = [p for p in plans if isinstance(_merge(p), int)]
    savings = [stats.savings[_merge(p)] for p in constant]
    assert [_merge(p) for p in constant] == list(range(1, len(constant) + 1))
    assert all(a < b for a, b in zip(savings, savings[1:], strict=False))
    assert max(savings) >= 0.4
    assert all(p.params_after == 1000 and p.spans == () for p in plans)
    assert {p.family for p in constant} == {"tome"}


@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if s != "constant"])
def test_every_other_schedule_is_its_own_family_with_growing_savings(schedule):
    stats = _stats(tiny_vit())
    plans = STAGES.propose(stats, Sizes(1000, (100,) * 6), 3, macs_matter=True)
    mine = [p for p in plans if p.family == f"tome-{schedule}"]
    assert mine and all(_merge(p).endswith(f", {schedule}") for p in mine)
    # in grid order: each r merges more tokens than the one before, so saves more
    keys = [k for k in stats.savings if isinstance(k, str) and k.endswith(f", {schedule}")]
    assert [_merge(p) for p in mine] == keys
    savings = [stats.savings[k] for k in keys]
    assert all(a < b for a, b in zip(savings, savings[1:], strict=False))


def test_other_methods_plans_are_extended_by_the_constant_schedule_only():
    stats = _stats(tiny_vit())
    base = Plan(("remove",), "plain", ((1, 2),), "identity", 900, 0.5, extendable=True)
    extended = STAGES.extend(base, stats, Sizes(1000, (100,) * 6))
    assert extended and all(isinstance(_merge(p), int) for p in extended)


@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if s != "constant"])
def test_a_scheduled_plan_applies_that_schedule(schedule):
    model = tiny_vit()
    layout = find_layout(model)
    stats = STAGES.calibrate(model, [], layout, None, toast.Calibration(), 3)
    plan = Plan(
        ("tome",), "tome", (), None, 1000, 0.1, parts=(MergePart("tome", f"ToMe r=3, {schedule}"),)
    )
    built, copied = copy.deepcopy((model, layout))
    STAGES.apply(built, plan, stats, copied)
    twin = copy.deepcopy(model)
    enable_merging(twin, 3, schedule=schedule)
    images = image_batches(1, 3)[0]
    with torch.inference_mode():
        torch.testing.assert_close(built(images)[0], twin(images)[0], rtol=0, atol=0)
    assert merging_of(built).r == merging_of(twin).r


def test_mlerp_is_a_family_of_each_schedule_with_the_same_savings():
    stats = _stats(tiny_vit())
    plans = STAGES.propose(stats, Sizes(1000, (100,) * 6), 3, macs_matter=True)
    families = {p.family for p in plans if _merge(p) is not None}
    assert {"tome-max"} | {f"tome-{s}-max" for s in SCHEDULES if s != "constant"} <= families
    for p in plans:
        if p.family.endswith("-max"):
            paper = _merge(p).removesuffix(", MLERP")
            paper = int(paper.split("r=")[1]) if "," not in paper else paper
            assert stats.savings[_merge(p)] == stats.savings[paper]


def test_an_mlerp_plan_applies_the_max_merge_norm():
    model = tiny_vit()
    layout = find_layout(model)
    stats = STAGES.calibrate(model, [], layout, None, toast.Calibration(), 3)
    plan = Plan(
        ("tome",), "tome-max", (), None, 1000, 0.1, parts=(MergePart("tome", "ToMe r=3, MLERP"),)
    )
    built, copied = copy.deepcopy((model, layout))
    STAGES.apply(built, plan, stats, copied)
    twin, paper = copy.deepcopy(model), copy.deepcopy(model)
    enable_merging(twin, 3, merge_norm="max")
    enable_merging(paper, 3)
    images = image_batches(1, 3)[0]
    with torch.inference_mode():
        torch.testing.assert_close(built(images)[0], twin(images)[0], rtol=0, atol=0)
        assert not torch.equal(built(images)[0], paper(images)[0])
    assert merging_of(built).state() == merging_of(twin).state()


def test_nothing_is_proposed_when_macs_do_not_matter():
    stats = _stats(tiny_vit())
    assert STAGES.propose(stats, Sizes(1000, (100,) * 6), 3, macs_matter=False) == []


def test_a_language_model_has_no_merge_structure():
    assert find_layout(tiny_llama()).part("tome") is None


def test_plan_keys_name_merging_only_when_set():
    plain = Plan(("remove",), "plain", ((1, 3),), "identity", 10, 0.5)
    merged = plain.with_part(MergePart("tome", 4), methods=("remove", "tome"), family="plain+tome")
    assert plain.key == "plain|identity|1-3||"
    assert "merge" not in plain.to_dict()
    assert merged.key == "plain+tome|identity|1-3|||r4"
    assert merged.to_dict()["merge"] == 4
    assert "ToMe r=4" in merged.label


def test_the_calibration_counts_the_tokens_of_the_data_not_of_the_config():
    from . import models as M

    model = M.build("dinov2")
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    stats = STAGES.calibrate(model, [images], find_layout(model), None, toast.Calibration(), 3)
    with torch.inference_mode():
        patches = model.embeddings(images).shape[1]
    assert stats.widths.tokens == patches
    assert patches != _stats(model).widths.tokens  # the config's size differs


def test_a_scheduled_rapid_plan_prunes_and_merges_by_that_schedule():
    from toast.methods.merge.rapid import RapidReducer
    from toast.methods.merge.stages import RAPID_STAGES

    model = tiny_vit()
    layout = find_layout(model)
    stats = RAPID_STAGES.calibrate(model, [], layout, None, toast.Calibration(), 3)
    n = find_sites(model).num_blocks
    split = next(k for k in stats.savings if k.endswith("delayed-decreasing"))
    plan = Plan(
        ("rapid",),
        "rapid-delayed-decreasing",
        (),
        None,
        1000,
        0.1,
        parts=(MergePart("rapid", split),),
    )
    built, copied = copy.deepcopy((model, layout))
    RAPID_STAGES.apply(built, plan, stats, copied)
    r = int(split.split("r=")[1].split(",")[0])
    until = int(split.split("prune<")[1].split(",")[0])
    expected = RapidReducer(merge_schedule(r, n, "delayed-decreasing"), until)
    assert merging_of(built).reducer == expected
