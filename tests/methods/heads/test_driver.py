"""ToaSt compresses through the one driver: registered with its stages
alone (no ``run``), ``toast.compress(..., method="toast-vit")`` runs them
configured by the options, whose one plan is the search's plan of the same
setting (one ρ of the search's on every block but the first, with or
without one of its TCS schedules), and builds the model the search builds
from it; the fine-tune runs on the data calibration carries (no pass of
its own), and ``before_surgery`` is never called."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import toast  # noqa: E402
from tests._helpers import hf_models as H  # noqa: E402
from toast.hf.data.calibration import Calibration  # noqa: E402
from toast.methods.base import find_layout, get_method  # noqa: E402
from toast.methods.calibrate import model_sizes  # noqa: E402
from toast.methods.driver import compress_with_stages, runner_of  # noqa: E402
from toast.methods.heads import ToastVitConfig, compress_vit  # noqa: E402
from toast.methods.heads.stages import (  # noqa: E402
    STAGES,
    TCS_SCHEDULES,
    ConfiguredToastVitStages,
    tcs_schedule,
)

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


def _setting(plan):
    """The plan's ρ and TCS schedule ((None, None): no ToaSt part)."""
    part = plan.part("toast-vit")
    return (None, None) if part is None else (part.head_sparsity, part.schedule)


def _vit(classifier: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
        image_size=16, patch_size=4, num_labels=5,
    )  # fmt: skip
    if classifier:
        return transformers.ViTForImageClassification(config).eval()
    return transformers.ViTModel(config, add_pooling_layer=False).eval()


def _out(model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(pixel_values=images).last_hidden_state


@pytest.fixture
def planned(monkeypatch):
    """The plans the configured stages report, in order."""
    seen = []
    report = ConfiguredToastVitStages.report

    def spy(self, plan, *args, **kwargs):
        seen.append(plan)
        return report(self, plan, *args, **kwargs)

    monkeypatch.setattr(ConfiguredToastVitStages, "report", spy)
    return seen


def test_registered_with_stages_alone():
    method = get_method("toast-vit")
    assert method.stages is STAGES
    assert runner_of(method).func is compress_with_stages


def _search_plans(model: torch.nn.Module):
    layout = find_layout(model)
    stats = STAGES.calibrate(model, [], layout, None, Calibration(), 0)
    return stats, STAGES.propose(stats, model_sizes(model, layout), 0, True)


#: Every (ρ, TCS schedule) the search proposes on the tiny ViT (ρ = 0: no head
#: pruning; not both absent: that is the original model).
SETTINGS = [
    (rho, schedule)
    for rho in (0.0, 0.25, 0.5, 0.75)
    for schedule in (None, *TCS_SCHEDULES)
    if rho or schedule
]


@pytest.mark.parametrize(("rho", "schedule"), SETTINGS)
def test_compress_builds_the_search_plan_of_the_same_setting(rho, schedule, planned):
    model = _vit()
    stats, plans = _search_plans(model)
    sparsity = rho or None
    plan = next(p for p in plans if _setting(p) == (sparsity, schedule))
    searched = copy.deepcopy(model)
    layout = find_layout(searched)
    STAGES.apply(searched, plan, stats, layout)
    STAGES.finish(searched, plan, stats, layout)

    options = {} if schedule is None else {"schedule": tcs_schedule(schedule, 4)}
    compressed, report = toast.compress(model, method="toast-vit", head_sparsity=rho, **options)
    assert planned == [plan]
    assert report.params_after == plan.params_after
    for (name, a), (_, b) in zip(
        compressed.state_dict().items(), searched.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    images = H.images(3, seed=5)
    assert torch.equal(_out(compressed, images), _out(searched, images))


def test_a_search_of_toast_vit_alone_is_rebuilt_by_compress_with_its_rho(planned):
    model = _vit()
    g = torch.Generator().manual_seed(1)
    data, heldout = [torch.randn(8, 3, 16, 16, generator=g) for _ in range(2)], [H.images(8)]
    result = toast.search(
        model,
        data,
        heldout,
        methods=["toast-vit"],
        target=0.1,
        max_measured=1,
        cache=False,
        latency=False,
        progress=False,
    )
    chosen = result.best.candidate
    compressed, _ = toast.compress(
        model, data, method="toast-vit", head_sparsity=chosen.part("toast-vit").head_sparsity
    )
    assert planned == [chosen]
    images = H.images(3, seed=5)
    assert torch.equal(_out(compressed, images), _out(result.model, images))


class _Loader:
    """Batches of (images, labels) that count how often they are read."""

    def __init__(self) -> None:
        self.reads = 0

    def __iter__(self):
        self.reads += 1
        yield H.images(6, seed=2), torch.arange(6) % 5


def test_calibration_reads_no_data_and_the_finetune_reads_what_it_carries():
    def surgery(spans, stack):
        raise AssertionError("ToaSt removes no block")

    loader = _Loader()
    _, report = compress_vit(_vit(True), loader, ToastVitConfig(head_sparsity=0.5), surgery)
    assert loader.reads == 0 and report.finetune_losses == []
    config = ToastVitConfig(head_sparsity=0.5, finetune_steps=2)
    _, report = compress_vit(_vit(True), loader, config, surgery)
    assert loader.reads >= 1 and len(report.finetune_losses) == 2
    with pytest.raises(ValueError, match="finetune_steps > 0 needs a loader"):
        compress_vit(_vit(True), None, config)


def test_swin_runs_through_the_driver_on_its_stages_list(planned):
    cfg = transformers.SwinConfig(
        image_size=32, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
        window_size=4, mlp_ratio=2.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.SwinModel(cfg).eval()
    _, report = toast.compress(model, method="toast-vit", head_sparsity=0.5, skip="stage_first")
    assert (report.blocks_before, report.blocks_after) == (4, 4)
    assert report.params_after < report.params_before
    assert planned[0].part("toast-vit").head_sparsity == 0.5
