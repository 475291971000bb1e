"""LinearPatch from a checkpoint on disk, block by block, writes what the
in-memory path saves: the same window, the same statistics (the
magnitudes exactly, the cosines to the rounding of their sums), tensors
equal tensor for tensor, a folder that reloads with the same outputs, and
the same held-out quality; an interrupted run leaves nothing behind."""

from __future__ import annotations

import copy
import json
import tempfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

import toast  # noqa: E402
from tests._helpers import replaceme_models as R  # noqa: E402
from toast.hf.capture.sequential import DiskModel  # noqa: E402
from toast.hf.data.calibration import Calibration  # noqa: E402
from toast.hf.model.blocks import find_blocks  # noqa: E402
from toast.methods.linearpatch.statistics import (  # noqa: E402
    measure_patch_statistics,
    measure_patch_statistics_from_disk,
)

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

REL = 1e-5


def _plans(*folders):
    plans = [json.loads((f / "toast_plan.json").read_text()) for f in folders]
    for plan in plans:  # where the config was read from: the folder, or nowhere
        plan["config"].pop("_name_or_path")
        plan["weights"].pop("bytes"), plan["weights"].pop("sha256")  # headers' order may differ
    return plans


@pytest.mark.parametrize("name", ["llama", "gemma"])
@pytest.mark.parametrize("n", [1, 2])
def test_linearpatch_from_disk_equals_the_toast_save_of_the_in_memory_result(name, n, tmp_path):
    model, data = R.decoder(name), R.text_loader()
    model.save_pretrained(tmp_path / "source")
    report = toast.compress(
        tmp_path / "source", data, method="linearpatch", num_blocks=n, sequential=True,
        output=tmp_path / "disk", progress=False,
    )  # fmt: skip
    patched, expected = toast.compress(
        copy.deepcopy(model), data, method="linearpatch", num_blocks=n, progress=False
    )
    toast.save_pretrained(patched, tmp_path / "memory")
    assert [(s.start, s.stop) for s in report.spans] == [(s.start, s.stop) for s in expected.spans]
    assert report.params_after == expected.params_after
    assert report.rows == expected.rows
    for a, b in zip(report.scales, expected.scales, strict=True):
        np.testing.assert_array_equal(a, b)  # the same formula on the same states
    a = load_file(tmp_path / "disk" / "model.safetensors")
    b = load_file(tmp_path / "memory" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    disk_plan, memory_plan = _plans(tmp_path / "disk", tmp_path / "memory")
    for key in ("layout", "config", "dtype", "weights"):
        assert disk_plan[key] == memory_plan[key], key
    assert 'toast.load_pretrained("disk")' in (tmp_path / "disk" / "README.md").read_text()
    loaded = toast.load_pretrained(tmp_path / "disk").eval()
    for batch in data[:2]:
        assert torch.equal(R.outputs(loaded, batch), R.outputs(patched, batch))


def test_statistics_from_disk_are_the_in_memory_ones(tmp_path):
    """Magnitudes exactly; the cosines' sums are added in another order (a
    dot product per pair and batch, not one product of every state), so
    they agree to float64 rounding."""
    model, data = R.decoder("llama"), R.text_loader(24, batch_size=5)  # a short last batch
    model.save_pretrained(tmp_path / "source")
    calibration = Calibration(progress=False)
    memory = measure_patch_statistics(model, data, find_blocks(model), calibration, 3)
    disk = DiskModel.open(tmp_path / "source")
    found = measure_patch_statistics_from_disk(disk, data, calibration, 3)
    assert found.rows == memory.rows
    np.testing.assert_array_equal(found.magnitudes, memory.magnitudes)
    assert np.array_equal(np.isnan(found.similarity), np.isnan(memory.similarity))
    np.testing.assert_allclose(found.similarity, memory.similarity, rtol=1e-12, atol=0)


def test_heldout_quality_from_disk_equals_in_memory(tmp_path):
    model, data, heldout = R.decoder("llama"), R.text_loader(), R.text_loader(16, seed=1)
    model.save_pretrained(tmp_path / "source")
    options = {"method": "linearpatch", "num_blocks": 2, "heldout": heldout, "progress": False}
    on_disk = toast.compress(
        tmp_path / "source", data, sequential=True, output=tmp_path / "disk", **options
    )
    _, in_memory = toast.compress(copy.deepcopy(model), data, **options)
    a, b = on_disk.quality, in_memory.quality
    assert a is not None and b is not None
    assert on_disk.spans == in_memory.spans
    assert (a.metric, a.samples, a.count) == (b.metric, b.samples, b.count)
    assert a.original == pytest.approx(b.original, rel=REL)
    assert a.plain_removal == pytest.approx(b.plain_removal, rel=REL)
    assert a.compressed == pytest.approx(b.compressed, rel=REL)


def test_explicit_spans_from_disk_write_that_window(tmp_path):
    model, data = R.decoder("llama"), R.text_loader()
    model.save_pretrained(tmp_path / "source")
    report = toast.compress(
        tmp_path / "source", data, method="linearpatch", spans=[(2, 4)], sequential=True,
        output=tmp_path / "disk", progress=False,
    )  # fmt: skip
    patched, _ = toast.compress(model, data, method="linearpatch", spans=[(2, 4)], progress=False)
    assert [(s.start, s.stop) for s in report.spans] == [(2, 4)]
    loaded = toast.load_pretrained(tmp_path / "disk").eval()
    assert torch.equal(R.outputs(loaded, data[0]), R.outputs(patched, data[0]))


def test_interrupted_run_leaves_no_temporary_files_and_no_output(tmp_path, monkeypatch):
    R.decoder("llama").save_pretrained(tmp_path / "source")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the state files go
    handle = R.interrupt_after(20)  # 6 batches a block: inside block 3
    try:
        with pytest.raises(KeyboardInterrupt):
            toast.compress(
                tmp_path / "source", R.text_loader(), method="linearpatch", num_blocks=2,
                sequential=True, output=tmp_path / "out", progress=False,
            )  # fmt: skip
    finally:
        handle.remove()
    assert list(scratch.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scratch", "source"]
