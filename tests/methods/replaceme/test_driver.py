"""ReplaceMe registers no driver of its own: ``toast.compress(...,
method="replaceme")`` runs its configured stages through the one driver
(:mod:`toast.methods.driver`), in memory and block by block from disk, and
both paths give the same checkpoint for the default options."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

import toast  # noqa: E402
from tests._helpers import replaceme_models as R  # noqa: E402
from toast.methods import driver  # noqa: E402
from toast.methods.base import get_method  # noqa: E402
from toast.methods.replaceme.configured import ConfiguredReplaceMe  # noqa: E402
from toast.methods.replaceme.report import ReplaceMeReport  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


def _tensors(folder) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def test_replaceme_registers_its_stages_alone():
    method = get_method("replaceme")
    assert method.stages is not None and method.stages.from_disk
    configured = method.stages.configured(toast.ReplaceMeConfig(num_blocks=2))
    assert isinstance(configured, ConfiguredReplaceMe) and configured.from_disk


def test_compress_runs_the_configured_stages_through_the_driver(monkeypatch):
    calls = []
    original = driver.compress_with_stages

    def counted(method, *args, **kwargs):
        calls.append(method.name)
        return original(method, *args, **kwargs)

    monkeypatch.setattr(driver, "compress_with_stages", counted)
    model, report = toast.compress(
        R.decoder("llama"), R.text_loader(), method="replaceme", num_blocks=2, progress=False
    )
    assert calls == ["replaceme"]
    assert isinstance(report, ReplaceMeReport)
    assert (
        report.blocks_after == R.LAYERS - 2 == toast.hf.model.blocks.find_blocks(model).num_blocks
    )


def test_the_default_from_disk_writes_what_the_default_in_memory_writes(tmp_path, monkeypatch):
    source = tmp_path / "source"
    R.decoder("llama").save_pretrained(source)
    calls = []
    original = driver.compress_from_disk_with_stages

    def counted(method, *args, **kwargs):
        calls.append(method.name)
        return original(method, *args, **kwargs)

    monkeypatch.setattr(driver, "compress_from_disk_with_stages", counted)
    reports = {}
    for sequential in (False, True):
        reports[sequential] = toast.compress(
            str(source),
            R.text_loader(),
            method="replaceme",
            output=tmp_path / f"out-{sequential}",
            sequential=sequential,
            num_blocks=2,
            progress=False,
        )
    assert calls == ["replaceme"]  # the block-by-block path, through the driver
    memory, disk = reports[False], reports[True]
    assert memory.spans == disk.spans
    # measured by whole-model forwards and block by block: the same to rounding
    measured = [c.result for c in memory.candidates]
    assert [c.result for c in disk.candidates] == pytest.approx(measured, rel=1e-6)
    assert (memory.params_before, memory.params_after) == (disk.params_before, disk.params_after)
    written, saved = _tensors(tmp_path / "out-True"), _tensors(tmp_path / "out-False")
    assert sorted(written) == sorted(saved)
    for key in written:
        assert written[key].dtype == saved[key].dtype, key
        assert torch.equal(written[key], saved[key]), key


def test_what_the_disk_path_cannot_write_is_refused_before_any_pass(tmp_path, monkeypatch):
    import toast.methods.replaceme.configured as configured

    def no_pass(*args, **kwargs):
        raise AssertionError("a pass ran")

    monkeypatch.setattr(configured, "fit_from_disk", no_pass)
    R.decoder("llama").save_pretrained(tmp_path / "source")
    with pytest.raises(ValueError, match="placement='fold'"):
        toast.compress(
            str(tmp_path / "source"),
            R.text_loader(),
            method="replaceme",
            output=tmp_path / "out",
            sequential=True,
            num_blocks=2,
            placement="mlp",
            progress=False,
        )
    assert not (tmp_path / "out").exists()
