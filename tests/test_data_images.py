"""Real images at a ViT's input size: the digits upscaled, crops of
scikit-image's photographs, the ELPV solar cells; all ImageNet-normalised."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

from toast import data
from toast._validation import InvalidParameterError

needs_sklearn = pytest.mark.skipif(
    importlib.util.find_spec("sklearn") is None, reason="needs scikit-learn"
)
needs_skimage = pytest.mark.skipif(
    importlib.util.find_spec("skimage") is None, reason="needs scikit-image"
)
needs_elpv = pytest.mark.skipif(
    importlib.util.find_spec("elpv_dataset") is None or importlib.util.find_spec("PIL") is None,
    reason="needs elpv-dataset and Pillow",
)


def _elpv_data() -> str:
    spec = importlib.util.find_spec("elpv_dataset")
    return f"{next(iter(spec.submodule_search_locations))}/data"


def _elpv_table() -> np.ndarray:
    """labels.csv read as the package's own ``load_dataset`` reads it."""
    return np.genfromtxt(
        f"{_elpv_data()}/labels.csv",
        dtype=["|S19", "<f8", "|S4"],
        names=["path", "probability", "type"],
    )


def _unnormalise(images: np.ndarray) -> np.ndarray:
    return images * data.IMAGENET_STD[:, None, None] + data.IMAGENET_MEAN[:, None, None]


def test_normalising_maps_the_imagenet_mean_to_zero_and_one_std_to_one():
    mean = np.broadcast_to(data.IMAGENET_MEAN[None, :, None, None], (1, 3, 2, 2))
    np.testing.assert_allclose(data.imagenet_normalise(mean), 0.0, atol=1e-7)
    shifted = mean + data.IMAGENET_STD[None, :, None, None]
    np.testing.assert_allclose(data.imagenet_normalise(shifted), 1.0, atol=1e-6)


@needs_sklearn
def test_digits_rgb_has_the_digits_labels_and_a_vit_input_shape():
    images = data.digits_rgb("test", size=56, limit=10)
    assert images.images.shape == (10, 3, 56, 56) and images.images.dtype == np.float32
    assert images.labels.dtype == np.int64
    np.testing.assert_array_equal(images.labels, data.digits("test").labels[:10])


@needs_sklearn
def test_digits_rgb_upscales_as_torch_bilinear_interpolation_does():
    torch = pytest.importorskip("torch")
    ink = data.digits("train").images[:4].astype(np.float64)
    reference = torch.nn.functional.interpolate(
        torch.from_numpy(ink), size=(224, 224), mode="bilinear", align_corners=False
    ).numpy()
    rgb = _unnormalise(data.digits_rgb("train", limit=4).images)
    for channel in range(3):  # dark ink on white paper, the same in every channel
        np.testing.assert_allclose(rgb[:, channel], 1.0 - reference[:, 0], atol=1e-6)


@needs_sklearn
def test_digits_rgb_chunks_join_into_the_whole_range():
    whole = data.digits_rgb("test", size=28, limit=8)
    part = data.digits_rgb("test", size=28, start=5, limit=3)
    np.testing.assert_array_equal(part.images, whole.images[5:8])
    np.testing.assert_array_equal(part.labels, whole.labels[5:8])


@needs_skimage
def test_natural_images_are_normalised_photographs_in_the_unit_range():
    images = data.natural_images(6, size=64, seed=0)
    assert images.shape == (6, 3, 64, 64) and images.dtype == np.float32
    rgb = _unnormalise(images)
    assert rgb.min() >= -1e-6 and rgb.max() <= 1 + 1e-6
    # real photographs: mid-grey on average and far from flat
    assert 0.2 < rgb.mean() < 0.8 and rgb.std() > 0.1


@needs_skimage
def test_natural_images_repeat_for_a_seed_and_change_with_it():
    first = data.natural_images(4, size=32, seed=3)
    np.testing.assert_array_equal(first, data.natural_images(4, size=32, seed=3))
    assert not np.array_equal(first, data.natural_images(4, size=32, seed=4))


@needs_skimage
def test_a_greyscale_photograph_gives_three_equal_channels():
    rgb = _unnormalise(data.natural_images(2, size=32, photos=("camera",)))
    np.testing.assert_allclose(rgb[:, 0], rgb[:, 1], atol=1e-6)
    np.testing.assert_allclose(rgb[:, 0], rgb[:, 2], atol=1e-6)


def test_natural_images_refuse_an_unknown_photograph():
    with pytest.raises(ValueError, match="choose from"):
        data.natural_images(1, photos=("lena",))


def test_natural_images_refuse_a_negative_count():
    with pytest.raises(InvalidParameterError, match="count"):
        data.natural_images(-1)


def test_a_missing_scikit_image_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "skimage", None)
    monkeypatch.setitem(sys.modules, "skimage.data", None)
    with pytest.raises(ImportError, match="pip install scikit-image"):
        data.natural_images(1)


@needs_elpv
@needs_skimage
def test_elpv_labels_are_the_thresholded_defect_probabilities():
    table = _elpv_table()
    cells = data.elpv(size=32, limit=40)
    assert cells.images.shape == (40, 3, 32, 32)
    np.testing.assert_array_equal(cells.labels, table["probability"][:40] >= 0.5)


@needs_elpv
@needs_skimage
def test_elpv_at_its_own_size_is_the_scan_itself():
    from PIL import Image

    names = np.char.decode(_elpv_table()["path"][2:4])
    cells = _unnormalise(data.elpv(size=300, start=2, limit=2).images)
    for i, name in enumerate(names):
        with Image.open(f"{_elpv_data()}/{name}") as image:
            scan = np.asarray(image.convert("L"), dtype=np.float64) / 255.0
        for channel in range(3):
            np.testing.assert_allclose(cells[i, channel], scan, atol=1e-6)


def test_a_missing_elpv_dataset_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "elpv_dataset", None)
    with pytest.raises(ImportError, match="pip install elpv-dataset"):
        data.elpv(limit=1)
