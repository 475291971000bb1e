"""Calibration and evaluation data that works offline.

- :func:`digits`: scikit-learn's bundled 8×8 scans of handwritten digits
  (1,797 real images; nothing downloads), split into a seeded train and test
  set.
- :func:`digits_rgb`, :func:`natural_images` and :func:`elpv`: real images
  at a ViT's input size, ImageNet-normalised: the digits upscaled (labelled),
  crops of scikit-image's bundled photographs (calibration), and the
  ``elpv-dataset`` package's solar-cell images (labelled defective or not).
- :func:`stdlib_sentences`: English sentences from the docstrings of Python's
  own standard library, a real text corpus every Python installation ships.
- :func:`image_folder` and :func:`text_file`: local data for the command line
  (a folder of images, one sub-folder per class or flat; a ``.txt`` file with
  one text per line or a ``.jsonl`` file with a ``"text"`` field).
"""

from __future__ import annotations

import ast
import json
import os
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from toast._validation import Interval, Options, check

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "SKIMAGE_PHOTOS",
    "Digits",
    "LabelledImages",
    "digits",
    "digits_rgb",
    "elpv",
    "image_folder",
    "imagenet_normalise",
    "natural_images",
    "stdlib_sentences",
    "text_file",
]


@dataclass(frozen=True)
class Digits:
    """Images ``(n, 1, 8, 8)`` float32 in ``[0, 1]`` and labels ``(n,)`` int64."""

    images: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


def digits(split: str = "train", test_size: int = 500, seed: int = 0) -> Digits:
    """scikit-learn's digits, split into ``train`` (the rest) and ``test``
    (``test_size`` images), with a seeded permutation."""
    check("split", split, Options(("train", "test", "all")))
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            "the digits data comes with scikit-learn: pip install scikit-learn"
        ) from exc
    bunch = load_digits()
    images = (bunch.images / 16.0).astype(np.float32)[:, None]
    labels = bunch.target.astype(np.int64)
    if split == "all":
        return Digits(images, labels)
    check("test_size", test_size, Interval(int, 0, len(labels), closed="neither"))
    order = np.random.default_rng(seed).permutation(len(labels))
    pick = order[:test_size] if split == "test" else order[test_size:]
    return Digits(images[pick], labels[pick])


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_WORD = re.compile(r"^[A-Z][A-Za-z ,;:'()\-]*[.!?]$")


def _docstrings(path: Path) -> Iterator[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                yield doc


def stdlib_sentences(
    limit: int | None = 5000,
    min_words: int = 6,
    max_words: int = 40,
    modules: tuple[str, ...] | None = None,
) -> list[str]:
    """Sentences of plain English prose from the standard library's docstrings.

    Files are read in sorted order, paragraphs are split into sentences, and
    a sentence is kept when it starts with a capital letter, ends with
    ``.``, ``!`` or ``?``, holds only letters and light punctuation (no code,
    paths or doctest prompts) and has ``min_words`` to ``max_words`` words.
    Duplicates are dropped; the first ``limit`` sentences are returned, so
    the list is the same on every run of one Python version.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    names = modules or ("", "email", "json", "logging", "unittest", "concurrent", "asyncio")
    files: list[Path] = []
    for name in names:
        folder = root / name
        if folder.is_dir():
            files.extend(sorted(p for p in folder.glob("*.py") if "test" not in p.name))
    seen: set[str] = set()
    out: list[str] = []
    for path in files:
        for doc in _docstrings(path):
            for paragraph in doc.split("\n\n"):
                text = " ".join(paragraph.split())
                for sentence in _SENTENCE_END.split(text):
                    words = sentence.split()
                    if not min_words <= len(words) <= max_words or not _WORD.match(sentence):
                        continue
                    if sentence not in seen:
                        seen.add(sentence)
                        out.append(sentence)
                        if limit is not None and len(out) >= limit:
                            return out
    if not out:
        raise RuntimeError(f"no docstring sentences found under {root}")
    return out


_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


def image_folder(path: str | os.PathLike) -> tuple[list[Path], list[int], list[str]]:
    """Image files under ``path``: ``(files, labels, classes)``.

    With one sub-folder per class (ImageFolder layout) the labels are the
    sorted sub-folder indices; a flat folder gives label -1 for every image.
    """
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"{root} is not a directory of images")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    files: list[Path] = []
    labels: list[int] = []
    if classes:
        for index, name in enumerate(classes):
            found = sorted(
                p for p in (root / name).rglob("*") if p.suffix.lower() in _IMAGE_SUFFIXES
            )
            files += found
            labels += [index] * len(found)
    else:
        files = sorted(p for p in root.iterdir() if p.suffix.lower() in _IMAGE_SUFFIXES)
        labels = [-1] * len(files)
    if not files:
        raise ValueError(f"no images ({', '.join(sorted(_IMAGE_SUFFIXES))}) found under {root}")
    return files, labels, classes


def text_file(path: str | os.PathLike, field: str = "text") -> list[str]:
    """Texts of a ``.txt`` file (one per non-empty line) or a ``.jsonl`` file
    (the ``field`` of each line's object)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{p} is not a file")
    texts: list[str] = []
    with p.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            if p.suffix.lower() == ".jsonl":
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{p}:{number}: not valid JSON ({exc.msg})") from None
                if not isinstance(record, dict) or not isinstance(record.get(field), str):
                    raise ValueError(f"{p}:{number}: expected an object with a string {field!r}")
                texts.append(record[field])
            else:
                texts.append(line)
    if not texts:
        raise ValueError(f"{p} holds no text")
    return texts


# --- real RGB images at a ViT's input size (ImageNet-normalised) ---

# The statistics ImageNet-pretrained ViTs (DINOv2 included) normalise inputs with.
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


@dataclass(frozen=True)
class LabelledImages:
    """Images ``(n, 3, size, size)`` float32, ImageNet-normalised, and labels
    ``(n,)`` int64."""

    images: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


def imagenet_normalise(rgb: np.ndarray) -> np.ndarray:
    """``(n, 3, H, W)`` values in ``[0, 1]`` -> ``(x - mean) / std`` per channel."""
    return ((rgb - IMAGENET_MEAN[:, None, None]) / IMAGENET_STD[:, None, None]).astype(np.float32)


def _bilinear_matrix(n_in: int, n_out: int) -> np.ndarray:
    """``(n_out, n_in)``: linear interpolation with half-pixel centres (torch's
    ``interpolate(mode="bilinear", align_corners=False)``), edges clamped."""
    centres = (np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5
    centres = np.clip(centres, 0.0, n_in - 1)
    low = np.floor(centres).astype(np.int64)
    high = np.minimum(low + 1, n_in - 1)
    frac = centres - low
    matrix = np.zeros((n_out, n_in))
    matrix[np.arange(n_out), low] += 1.0 - frac
    matrix[np.arange(n_out), high] += frac
    return matrix


def digits_rgb(
    split: str = "train",
    size: int = 224,
    *,
    start: int = 0,
    limit: int | None = None,
    test_size: int = 500,
    seed: int = 0,
) -> LabelledImages:
    """scikit-learn's digits as a ViT sees a photograph: dark ink on white
    paper, upscaled bilinearly from 8 x 8 to ``size`` x ``size``, three equal
    channels, ImageNet-normalised (:func:`imagenet_normalise`).

    ``split``, ``test_size`` and ``seed`` pick the images as :func:`digits`
    does; only images ``start`` to ``start + limit`` of the split are upscaled
    (all 1,797 at 224 would take 1.1 GB), so a caller can walk a split in
    chunks.
    """
    check("size", size, Interval(int, 1, None))
    check("start", start, Interval(int, 0, None))
    if limit is not None:
        check("limit", limit, Interval(int, 0, None))
    base = digits(split, test_size=test_size, seed=seed)
    stop = len(base) if limit is None else min(len(base), start + limit)
    ink = base.images[start:stop, 0].astype(np.float64)
    resize = _bilinear_matrix(ink.shape[-1], size)
    paper = 1.0 - resize @ ink @ resize.T
    rgb = np.repeat(paper[:, None], 3, axis=1)
    return LabelledImages(imagenet_normalise(rgb), base.labels[start:stop].copy())


# Colour and greyscale photographs bundled with scikit-image's wheel (no download).
SKIMAGE_PHOTOS = (
    "astronaut",
    "coffee",
    "chelsea",
    "rocket",
    "hubble_deep_field",
    "immunohistochemistry",
    "retina",
    "camera",
    "moon",
    "coins",
    "brick",
    "grass",
    "gravel",
    "cell",
    "clock",
)


def _skimage() -> tuple[Any, Any]:
    try:
        import skimage.data
        import skimage.transform
    except ImportError as exc:
        raise ImportError(
            "the photographs and resizing come with scikit-image: pip install scikit-image "
            "(or pip install 'toast-compress[vit]')"
        ) from exc
    return skimage.data, skimage.transform


def _photo(name: str) -> np.ndarray:
    """A bundled photograph as ``(H, W, 3)`` float64 in ``[0, 1]``."""
    data, _ = _skimage()
    image = np.asarray(getattr(data, name)(), dtype=np.float64)
    image = image / 255.0
    if image.ndim == 2:
        image = np.repeat(image[:, :, None], 3, axis=2)
    return image[:, :, :3]


def natural_images(
    count: int, size: int = 224, seed: int = 0, *, photos: tuple[str, ...] = SKIMAGE_PHOTOS
) -> np.ndarray:
    """``count`` ImageNet-normalised crops ``(count, 3, size, size)`` float32 of
    scikit-image's bundled photographs: calibration data for ViTs.

    Image ``i`` is cut from photograph ``photos[i % len(photos)]`` (so any
    ``count`` covers them evenly): a square whose side is a seeded random
    35-100 % of the photograph's shorter side, at a random place, flipped
    left-right half the time, then resized to ``size`` with antialiasing.
    The same ``seed`` gives the same images.
    """
    check("count", count, Interval(int, 0, None))
    check("size", size, Interval(int, 1, None))
    unknown = sorted(set(photos) - set(SKIMAGE_PHOTOS))
    if unknown or not photos:
        raise ValueError(f"unknown photographs {unknown}; choose from {SKIMAGE_PHOTOS}")
    _, transform = _skimage()
    rng = np.random.default_rng(seed)
    loaded = {name: _photo(name) for name in dict.fromkeys(photos[: max(count, 1)])}
    out = np.empty((count, 3, size, size), dtype=np.float32)
    for i in range(count):
        image = loaded[photos[i % len(photos)]]
        height, width = image.shape[:2]
        side = max(1, int(round(min(height, width) * rng.uniform(0.35, 1.0))))
        top, left = rng.integers(0, height - side + 1), rng.integers(0, width - side + 1)
        crop = image[top : top + side, left : left + side]
        if rng.random() < 0.5:
            crop = crop[:, ::-1]
        resized = transform.resize(crop, (size, size), order=1, anti_aliasing=side > size)
        out[i] = np.clip(resized, 0.0, 1.0).transpose(2, 0, 1)
    return imagenet_normalise(out)


_ELPV_FIX = "pip install elpv-dataset"


def _elpv_folder() -> Path:
    """The data folder of the ``elpv-dataset`` package, found without importing
    it (its import pulls in Pillow only, but reading the labels needs none)."""
    import importlib.util

    spec = importlib.util.find_spec("elpv_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the solar-cell images come with elpv-dataset: {_ELPV_FIX}")
    folder = Path(next(iter(spec.submodule_search_locations))) / "data"
    if not (folder / "labels.csv").is_file():
        raise FileNotFoundError(f"{folder / 'labels.csv'} is missing (a broken elpv-dataset?)")
    return folder


def elpv(
    size: int = 224, *, start: int = 0, limit: int | None = None, threshold: float = 0.5
) -> LabelledImages:
    """The ELPV solar-cell images (2,624 electroluminescence scans, 300 x 300
    greyscale; CC BY-NC-SA 4.0: use them, never ship copies), in the
    package's order, resized to ``size`` and ImageNet-normalised as three
    equal channels. Label 1 (defective) where the annotated defect
    probability is at least ``threshold``, else 0. Only images ``start`` to
    ``start + limit`` are read. Needs ``pip install elpv-dataset`` (and
    Pillow, scikit-image).
    """
    check("size", size, Interval(int, 1, None))
    check("start", start, Interval(int, 0, None))
    check("threshold", threshold, Interval(float, 0.0, 1.0))
    if limit is not None:
        check("limit", limit, Interval(int, 0, None))
    folder = _elpv_folder()
    from PIL import Image

    _, transform = _skimage()
    rows = [line.split() for line in (folder / "labels.csv").read_text().splitlines() if line]
    stop = len(rows) if limit is None else min(len(rows), start + limit)
    out = np.empty((max(0, stop - start), 3, size, size), dtype=np.float32)
    for i, (name, *_) in enumerate(rows[start:stop]):
        with Image.open(folder / name) as image:
            grey = np.asarray(image.convert("L"), dtype=np.float64) / 255.0
        grey = transform.resize(grey, (size, size), order=1, anti_aliasing=grey.shape[0] > size)
        out[i] = np.clip(grey, 0.0, 1.0)[None]
    labels = np.array([float(r[1]) >= threshold for r in rows[start:stop]], dtype=np.int64)
    return LabelledImages(imagenet_normalise(out), labels)
