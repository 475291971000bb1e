"""TOAST from a checkpoint on disk writes what the in-memory path saves: the
same plan, tensors equal tensor for tensor, and a model that loads with
the same outputs."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

import toast  # noqa: E402
from tests._helpers import replaceme_models as R  # noqa: E402
from toast.methods.translate.from_disk import compress_from_disk  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_translated_checkpoint_from_disk_equals_toast_save_of_in_memory_result(name, tmp_path):
    model, data = R.decoder(name), R.text_loader()
    model.save_pretrained(tmp_path / "source")
    options = {"budget": 2, "translator": "affine", "estimator": "gcv", "progress": False}
    report = compress_from_disk(tmp_path / "source", data, tmp_path / "disk", **options)
    patched, expected = toast.compress(model, data, method="toast", **options)
    toast.save_pretrained(patched, tmp_path / "memory")
    assert report.spans == expected.spans
    assert report.params_after == expected.params_after
    a = load_file(tmp_path / "disk" / "model.safetensors")
    b = load_file(tmp_path / "memory" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    plans = [json.loads((tmp_path / d / "toast_plan.json").read_text()) for d in ("disk", "memory")]
    for plan in plans:  # where the config was read from: the folder, or nowhere
        plan["config"].pop("_name_or_path")
    for key in ("layout", "config", "dtype", "weights"):
        if key == "weights":  # the tensors are compared above; headers may differ in order
            for plan in plans:
                plan[key].pop("bytes"), plan[key].pop("sha256")
        assert plans[0][key] == plans[1][key], key
    for name in ("config.json", "README.md", "generation_config.json"):  # a whole save
        assert (tmp_path / "disk" / name).is_file() == (tmp_path / "memory" / name).is_file()
    for d in ("disk", "memory"):  # each card loads its own folder, not a temporary one
        assert f'toast.load_pretrained("{d}")' in (tmp_path / d / "README.md").read_text()
    loaded = toast.load_pretrained(tmp_path / "disk").eval()
    assert torch.equal(R.outputs(loaded, data[0]), R.outputs(patched, data[0]))


def test_trained_translators_are_refused_from_disk(tmp_path):
    R.decoder("llama").save_pretrained(tmp_path / "source")
    with pytest.raises(ValueError, match="closed-form"):
        compress_from_disk(
            tmp_path / "source", R.text_loader(), tmp_path / "out", budget=2, translator="mlp"
        )


@pytest.mark.parametrize("max_span", [None, 2])
def test_interrupted_run_leaves_no_temporary_files_and_no_output(max_span, tmp_path):
    R.decoder("llama").save_pretrained(tmp_path / "source")
    buffers = tmp_path / "buffers"
    buffers.mkdir()
    handle = R.interrupt_after(20)  # 6 batches a block: inside block 3
    try:
        with pytest.raises(KeyboardInterrupt):
            compress_from_disk(
                tmp_path / "source",
                R.text_loader(),
                tmp_path / "out",
                budget=2,
                max_span=max_span,
                progress=False,
                buffer_dir=buffers,
            )
    finally:
        handle.remove()
    assert list(buffers.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["buffers", "source"]
