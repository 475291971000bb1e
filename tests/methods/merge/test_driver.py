"""The token reducers compress through the one driver: registered with
their stages alone (no ``run``), ``toast.compress(..., method=m)`` runs
their stages configured by the options, whose one plan is the search's
plan of the same setting, and builds the model the search builds from it;
a search restricted to a reducer chooses a plan that ``compress`` with
that setting rebuilds exactly."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import toast  # noqa: E402
from tests._helpers import hf_models as H  # noqa: E402
from toast.hf.data.calibration import Calibration  # noqa: E402
from toast.methods.base import find_layout, get_method  # noqa: E402
from toast.methods.calibrate import model_sizes  # noqa: E402
from toast.methods.driver import compress_with_stages, runner_of  # noqa: E402
from toast.methods.merge.config import TomeConfig  # noqa: E402
from toast.methods.merge.configured import ConfiguredReducer  # noqa: E402
from toast.methods.merge.method import compress_tome  # noqa: E402
from toast.methods.merge.part import MergePart  # noqa: E402

from . import models as M  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


def _merge(plan):
    """The plan's reducer setting (None: no reduction)."""
    part = next((p for p in plan.parts if isinstance(p, MergePart)), None)
    return None if part is None else part.setting


NAMES = ("tome", "rapid", "token-transforming", "atm", "pitome")

#: Options of each reducer whose setting the search's grid has (on the tiny
#: ViT: 4 blocks; RAPID's switch at a third, a half, two thirds), with the
#: grid's key for it.
SETTINGS = [
    ("tome", {"r": 2}, 2),
    ("tome", {"r": 3, "schedule": "decreasing"}, "ToMe r=3, decreasing"),
    ("tome", {"r": 2, "merge_norm": "max", "schedule": "delayed"}, "ToMe r=2, delayed, MLERP"),
    ("rapid", {"r": 2, "prune_until": 1}, "RAPID r=2, prune<1"),
    ("rapid", {"r": 1, "prune_until": 3, "schedule": "front"}, "RAPID r=1, prune<3, front"),
    ("token-transforming", {"r": 2, "temperature": 0.02}, "Token Transforming r=2, τ=0.02"),
    ("atm", {"alpha": 0.9, "beta": 0.05}, "ATM α=0.9, β=0.05"),
    ("pitome", {"r": 3, "margin": 0.75}, "PiToMe r=3, margin 0.75"),
]


@pytest.fixture
def planned(monkeypatch):
    """The plans the configured stages report, in order."""
    seen = []
    report = ConfiguredReducer.report

    def spy(self, plan, *args, **kwargs):
        seen.append(plan)
        return report(self, plan, *args, **kwargs)

    monkeypatch.setattr(ConfiguredReducer, "report", spy)
    return seen


@pytest.mark.parametrize("name", NAMES)
def test_registered_with_stages_alone(name):
    method = get_method(name)
    assert method.stages is not None
    assert runner_of(method).func is compress_with_stages


@pytest.mark.parametrize(("name", "options", "key"), SETTINGS)
def test_compress_builds_the_search_plan_of_the_same_setting(name, options, key, planned):
    model, data = M.build("vit"), [H.images(4, seed=3)]
    stages, layout = get_method(name).stages, find_layout(model)
    stats = stages.calibrate(model, data, layout, None, Calibration(), 0)
    proposed = {_merge(p): p for p in stages.propose(stats, model_sizes(model, layout), 0, True)}
    searched = copy.deepcopy(model)
    stages.apply(searched, proposed[key], stats, find_layout(searched))

    compressed, report = toast.compress(model, data, method=name, **options)
    assert planned == [proposed[key]]
    images = H.images(3, seed=5)
    assert torch.equal(M.run(compressed, images), M.run(searched, images))
    assert type(report).__name__ == "TomeReport" and report.method == name


def test_a_search_of_tome_alone_is_rebuilt_by_compress_with_its_r(planned):
    model = M.build("vit")
    data, heldout = [H.images(4, seed=3)], [H.images(4, seed=4)]
    result = toast.search(
        model,
        data,
        heldout,
        methods=["tome"],
        target="macs=20%",
        max_measured=1,
        cache=False,
        latency=False,
        progress=False,
    )
    chosen = result.best.candidate
    assert isinstance(_merge(chosen), int) and chosen.family == "tome"
    compressed, _ = toast.compress(model, data, method="tome", r=_merge(chosen))
    assert planned == [chosen]
    images = H.images(3, seed=5)
    assert torch.equal(M.run(compressed, images), M.run(result.model, images))


def test_no_calibration_pass_and_no_surgery_hook(planned):
    """Without data the reducer is sized from the config; with data its first
    batch sets the size and nothing else reads it (no pass over the data);
    no block goes, so ``before_surgery`` is never called."""
    read = []

    class Loader:
        def __iter__(self):
            read.append(1)
            yield H.images(2, seed=1)

    def surgery(spans, stack):
        raise AssertionError("no block is removed")

    model, report = compress_tome(M.build("vit"), Loader(), TomeConfig(r=2), surgery)
    assert read == [1]  # the first batch, for its image size
    assert report.r == (2,) * 4 and _merge(planned[0]) == 2
    _, again = compress_tome(M.build("vit"), None, TomeConfig(r=2), surgery)
    assert again.to_markdown() == report.to_markdown()


def test_options_the_grid_never_varies_name_the_plan(planned):
    toast.compress(M.build("vit"), None, method="tome", r=[1, 2, 0, 1], unmerge_output=False)
    toast.compress(M.build("vit"), None, method="atm", thresholds=[0.9, 0.8, 0.7, 0.6])
    assert [_merge(p) for p in planned] == [
        "ToMe r=(1, 2, 0, 1), merged output",
        "ATM thresholds (0.9, 0.8, 0.7, 0.6)",
    ]
    assert [p.family for p in planned] == ["tome", "atm"]
