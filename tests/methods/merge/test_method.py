"""``toast.compress(..., method="tome")``, ``toast compress --method tome``
and saves: the method gives the model :func:`enable_merging` gives, its
report counts what the model does, and saved == reloaded."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import toast  # noqa: E402
from tests._helpers import hf_models as H  # noqa: E402
from toast.cli import main  # noqa: E402
from toast.hf.model.surgery import remove_blocks  # noqa: E402
from toast.methods.heads.scwp import prune_heads  # noqa: E402
from toast.methods.heads.tcs import enable_tcs  # noqa: E402
from toast.methods.merge import TomeConfig, enable_merging, merging_of  # noqa: E402

from . import models as M  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


def test_compress_equals_enable_merging_and_reports_the_tokens():
    images = H.images(3, seed=11)
    model, report = toast.compress(M.build("vit"), None, method="tome", r=3, progress=False)
    twin = M.build("vit")
    handle = enable_merging(twin, 3)
    assert torch.equal(M.run(model, images), M.run(twin, images))
    assert report.macs_after.tokens == tuple(handle.tokens)
    assert report.params_after == report.params_before
    assert report.macs_after.total < report.macs_before.total
    assert "| 0 | 3 | 17 | 14 |" in report.to_markdown()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"r": -1}, "r must be"),
        ({"r": [1, -2]}, "r must be"),
        ({"schedule": "steep"}, "schedule must be"),
        ({"merge_norm": "median"}, "merge_norm must be"),
    ],
)
def test_bad_options_are_refused_with_their_name(options, message):
    with pytest.raises(ValueError, match=message):
        TomeConfig(**options)


def test_a_per_block_r_goes_through_compress():
    model, report = toast.compress(M.build("vit"), None, method="tome", r=[4, 0, 0, 2])
    assert report.r == (4, 0, 0, 2)
    assert merging_of(model).r == (4, 0, 0, 2)


def test_the_report_counts_the_tokens_of_the_size_the_model_runs_at():
    # DINOv2 checkpoints say 518 in their config and run at 224: the report
    # must follow the data (or image_size=), not the config.
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    by_data = toast.compress(M.build("dinov2"), [images], method="tome", r=2)
    by_size = toast.compress(M.build("dinov2"), None, method="tome", r=2, image_size=32)
    by_config = toast.compress(M.build("dinov2"), None, method="tome", r=2)
    model, report = by_data
    with torch.inference_mode():
        model(pixel_values=images)
    assert report.macs_after.tokens == tuple(merging_of(model).tokens)
    assert by_size[1].macs_after == report.macs_after
    assert by_config[1].macs_after.tokens[0][0] < report.macs_after.tokens[0][0]


def test_a_model_that_is_not_a_vit_is_refused():
    llama = H.build(next(f for f in H.FAMILIES if f.name == "llama"))
    with pytest.raises(ValueError, match="token merging supports"):
        toast.compress(llama, None, method="tome", r=2)


def _saved_equals_reloaded(model, tmp_path):
    images = H.images(3, seed=12)
    expected = M.run(model, images)
    toast.save_pretrained(model, tmp_path / "save")
    loaded = toast.load_pretrained(tmp_path / "save")
    assert merging_of(loaded).state() == merging_of(model).state()
    torch.testing.assert_close(M.run(loaded, images), expected, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["vit", "deit", "dinov2", "dinov2_registers"])
def test_saved_equals_reloaded(family, tmp_path):
    model = M.build(family)
    enable_merging(model, 2, schedule="decreasing", unmerge_output=family != "deit")
    _saved_equals_reloaded(model, tmp_path)


@pytest.mark.parametrize("norm", ["max", "mean"])
def test_a_merge_norm_is_saved_and_reloaded(norm, tmp_path):
    model, _ = toast.compress(M.build("dinov2"), None, method="tome", r=3, merge_norm=norm)
    assert merging_of(model).state()["merge_norm"] == norm
    _saved_equals_reloaded(model, tmp_path)


def test_a_save_with_an_unknown_merge_norm_is_refused_when_loaded(tmp_path):
    model, _ = toast.compress(M.build("vit"), None, method="tome", r=3, merge_norm="max")
    toast.save_pretrained(model, tmp_path / "save")
    plan = tmp_path / "save" / "toast_plan.json"
    plan.write_text(plan.read_text().replace('"merge_norm": "max"', '"merge_norm": "median"'))
    with pytest.raises(ValueError, match="merge_norm"):
        toast.load_pretrained(tmp_path / "save")


def test_the_papers_average_is_not_written_so_older_saves_read_the_same():
    model, _ = toast.compress(M.build("vit"), None, method="tome", r=3)
    assert "merge_norm" not in merging_of(model).state()


def test_saved_equals_reloaded_with_heads_tcs_and_a_removed_span(tmp_path):
    model = M.build("vit")
    remove_blocks(model, [(1, 2)])
    prune_heads(model, 0.5)
    enable_tcs(model, {"fc2": {1: 0.5, 2: 0.5}})
    enable_merging(model, 3)
    _saved_equals_reloaded(model, tmp_path)


def test_the_command_line_gives_the_library_model(tmp_path):
    model = M.build("vit")
    model.save_pretrained(tmp_path / "vit")
    model = toast.load_pretrained(tmp_path / "vit")
    out = tmp_path / "out"
    argv = ["compress", str(tmp_path / "vit"), "--method", "tome", "--r", "3"]
    assert main([*argv, "--out", str(out), "--no-progress"]) == 0
    expected, _ = toast.compress(model, method="tome", r=3, progress=False)
    images = H.images(2, seed=13)
    assert torch.equal(M.run(toast.load_pretrained(out), images), M.run(expected, images))
    assert "token merging" in (out / "report.md").read_text()
