"""Sub-layer pruning's stages: exact plan sizes, and a search that
measures sub-layer plans among the other methods'."""

from __future__ import annotations

import copy

import pytest

import toast
from tests.frontier.conftest import CALIBRATION_LENGTH, tiny_llama, token_batches
from toast.hf.data.calibration import Calibration
from toast.hf.model.params import count_params
from toast.methods.base import Sizes, find_layout
from toast.methods.sublayer.part import removed_sublayers
from toast.methods.sublayer.stages import STAGES

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.hf


def test_every_proposed_plan_has_the_exact_size_of_its_applied_model():
    model = tiny_llama(layers=4)
    layout = find_layout(model)
    sizes = Sizes(count_params(model), tuple(count_params(b) for b in layout.stack.blocks))
    data = token_batches(2, CALIBRATION_LENGTH, 1)
    stats = STAGES.calibrate(model, data, layout, None, Calibration(progress=False), 2)
    plans = STAGES.propose(stats, sizes, 2, False)
    assert {len(removed_sublayers(p)) for p in plans} == {1, 2, 3, 4}
    for plan in plans:
        built, copied = copy.deepcopy((model, layout))
        STAGES.apply(built, plan, stats, copied)
        assert count_params(built) == plan.params_after, plan.label


def test_search_measures_a_sublayer_plan(tmp_path):
    model = tiny_llama()
    data, heldout = token_batches(3, CALIBRATION_LENGTH, 1), token_batches(1, 12, 2)
    result = toast.search(
        model,
        data,
        heldout,
        target=0.1,
        max_measured=6,
        cache=False,
        latency=False,
        progress=False,
    )
    measured = [m for m in result.measured if m.candidate.family == "sublayer"]
    assert measured, [m.candidate.label for m in result.measured]
    plan = measured[0].candidate
    assert measured[0].measurement.params == plan.params_after
    assert plan.to_dict()["sublayers"] == [list(s) for s in removed_sublayers(plan)]
