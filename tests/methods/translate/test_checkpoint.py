"""TOAST on a model folder chooses its path by the memory budget, says which
and why, and writes the same toast save either way; a bounded span keeps
the in-memory and from-disk plans equal."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

import toast  # noqa: E402
from tests._helpers import replaceme_models as R  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

OPTIONS = {"budget": 2, "translator": "affine", "estimator": "gcv", "progress": True}


def _tensors(folder):
    return load_file(folder / "model.safetensors")


@pytest.mark.parametrize("extra", [{}, {"max_span": 2}, {"ridge": 0.5}], ids=str)
def test_both_paths_write_the_same_save_and_say_which_they_took(extra, tmp_path, capsys):
    R.decoder("llama").save_pretrained(tmp_path / "source")
    data = R.text_loader()
    options = {**OPTIONS, **extra}
    max_span = extra.get("max_span")
    small = toast.compress(
        tmp_path / "source", data, output=tmp_path / "disk", sequential=True, **options
    )
    said_small = capsys.readouterr().err
    large = toast.compress(
        tmp_path / "source", data, output=tmp_path / "memory", max_memory="64GiB", **options
    )
    said_large = capsys.readouterr().err
    assert "toast compress: sequential path, as asked" in said_small
    assert "memory plan:" in said_small
    assert "toast compress: in-memory path" in said_large
    assert small.spans == large.spans
    assert max_span is None or all(s.num_blocks <= max_span for s in small.spans)
    a, b = _tensors(tmp_path / "disk"), _tensors(tmp_path / "memory")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert small.analysis is not None and large.analysis is not None
    np.testing.assert_allclose(small.analysis.errors, large.analysis.errors, rtol=1e-10)
    loaded = [toast.load_pretrained(tmp_path / d).eval() for d in ("disk", "memory")]
    assert torch.equal(R.outputs(loaded[0], data[0]), R.outputs(loaded[1], data[0]))


def test_an_existing_output_is_refused_before_anything_runs(tmp_path):
    R.decoder("llama").save_pretrained(tmp_path / "source")
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError, match="goes to a new folder"):
        toast.compress(tmp_path / "source", R.text_loader(), output=tmp_path / "out", budget=2)


def test_explicit_spans_longer_than_max_span_name_the_fix():
    with pytest.raises(ValueError, match="raise max_span or leave it None"):
        toast.ToastConfig(spans=[(1, 4)], max_span=2)


def test_a_method_without_a_disk_path_asked_to_go_from_disk_names_the_fix(tmp_path):
    with pytest.raises(ValueError, match="has no block-by-block path.*sequential=None or False"):
        toast.compress(tmp_path, [], output=tmp_path / "out", method="toast-vit", sequential=True)


def test_a_folder_without_output_names_the_fix(tmp_path):
    with pytest.raises(TypeError, match="pass output="):
        toast.compress(tmp_path, [], budget=2)


def test_folder_options_on_a_model_in_memory_are_refused():
    with pytest.raises(TypeError, match="max_memory, output apply to a checkpoint folder"):
        toast.compress(R.decoder("llama"), [], budget=2, output="x", max_memory="1GiB")
