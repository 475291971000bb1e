"""Sub-layer pruning by score from a checkpoint on disk, block by block,
writes what the in-memory path saves: the same scores (the same float64
arithmetic on the same states), the same sub-layers, tensors equal tensor
for tensor, a folder that reloads with the same outputs, and the same
held-out quality; the measured greedy is refused there with its reason,
and an interrupted run leaves nothing behind."""

from __future__ import annotations

import copy
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

import toast  # noqa: E402
from tests._helpers import replaceme_models as R  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

REL = 1e-5


def _plan(folder):
    plan = json.loads((folder / "toast_plan.json").read_text())
    plan["config"].pop("_name_or_path")  # where the config was read from
    plan["weights"].pop("bytes"), plan["weights"].pop("sha256")  # headers' order may differ
    return plan


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("kind", ["any", "attention"])
def test_sublayer_from_disk_equals_the_toast_save_of_the_in_memory_result(name, kind, tmp_path):
    model, data = R.decoder(name), R.text_loader()
    model.save_pretrained(tmp_path / "source")
    options = {"method": "sublayer", "num_sublayers": 3, "kind": kind, "progress": False}
    report = toast.compress(
        tmp_path / "source", data, sequential=True, output=tmp_path / "disk", **options
    )
    pruned, expected = toast.compress(copy.deepcopy(model), data, **options)
    toast.save_pretrained(pruned, tmp_path / "memory")
    assert report.removed == expected.removed  # the same sub-layers, scores equal exactly
    assert report.params_after == expected.params_after
    a = load_file(tmp_path / "disk" / "model.safetensors")
    b = load_file(tmp_path / "memory" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    disk_plan, memory_plan = _plan(tmp_path / "disk"), _plan(tmp_path / "memory")
    for key in ("layout", "config", "dtype", "weights", "patches"):
        assert disk_plan.get(key) == memory_plan.get(key), key
    loaded = toast.load_pretrained(tmp_path / "disk").eval()
    for batch in data[:2]:
        assert torch.equal(R.outputs(loaded, batch), R.outputs(pruned, batch))


def test_heldout_quality_from_disk_equals_in_memory(tmp_path):
    model, data, heldout = R.decoder("llama"), R.text_loader(), R.text_loader(16, seed=1)
    model.save_pretrained(tmp_path / "source")
    options = {"method": "sublayer", "num_sublayers": 4, "heldout": heldout, "progress": False}
    on_disk = toast.compress(
        tmp_path / "source", data, sequential=True, output=tmp_path / "disk", **options
    )
    _, in_memory = toast.compress(copy.deepcopy(model), data, **options)
    a, b = on_disk.quality, in_memory.quality
    assert a is not None and b is not None
    assert on_disk.removed == in_memory.removed
    assert (a.metric, a.samples, a.count) == (b.metric, b.samples, b.count)
    assert a.original == pytest.approx(b.original, rel=REL)
    assert a.compressed == pytest.approx(b.compressed, rel=REL)
    assert a.plain_removal is None and b.plain_removal is None  # no block goes


def test_measured_selection_from_disk_is_refused_with_its_reason(tmp_path):
    R.decoder("llama").save_pretrained(tmp_path / "source")
    with pytest.raises(ValueError, match=r"selection='measured'.*pass sequential=False"):
        toast.compress(
            tmp_path / "source", R.text_loader(), method="sublayer", num_sublayers=2,
            selection="measured", sequential=True, output=tmp_path / "out", progress=False,
        )  # fmt: skip
    assert not (tmp_path / "out").exists()


def test_interrupted_run_leaves_no_output(tmp_path):
    R.decoder("llama").save_pretrained(tmp_path / "source")
    handle = R.interrupt_after(20)  # 6 batches a block: inside block 3
    try:
        with pytest.raises(KeyboardInterrupt):
            toast.compress(
                tmp_path / "source", R.text_loader(), method="sublayer", num_sublayers=2,
                sequential=True, output=tmp_path / "out", progress=False,
            )  # fmt: skip
    finally:
        handle.remove()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]
