"""TOAST's analysis of a checkpoint on disk, block by block, equals the
analysis of the loaded model: the same moments, error matrix and plan."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests._helpers import replaceme_models as R  # noqa: E402
from toast.methods.translate import analyze, analyze_from_disk  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


@pytest.mark.parametrize(
    ("name", "pairs", "estimator"),
    [("llama", "all", "cv"), ("gpt2", "consecutive", "gcv"), ("qwen2", 2, "in_sample")],
)
def test_analysis_from_disk_equals_analysis_in_memory(name, pairs, estimator, tmp_path):
    model, data = R.decoder(name), R.text_loader()
    model.save_pretrained(tmp_path / "model")
    options = {"pairs": pairs, "estimator": estimator, "progress": False}
    got = analyze_from_disk(tmp_path / "model", data, buffer_dir=tmp_path, **options)
    want = analyze(model, data, **options)
    assert got.rows == want.rows
    np.testing.assert_allclose(got.errors, want.errors, rtol=1e-12, atol=0)
    assert got.plan(max_blocks=2) == want.plan(max_blocks=2)
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_prenorm_encoder_analysis_from_disk_equals_in_memory(tmp_path):
    model, data = R.encoder("vit"), R.image_loader()
    model.save_pretrained(tmp_path / "model")
    got = analyze_from_disk(tmp_path / "model", data, progress=False)
    want = analyze(model, data, progress=False)
    np.testing.assert_allclose(got.errors, want.errors, rtol=1e-12, atol=0)
