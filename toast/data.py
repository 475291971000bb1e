"""Calibration and evaluation data that works offline.

- :func:`digits`: scikit-learn's bundled 8×8 scans of handwritten digits
  (1,797 real images; nothing downloads), split into a seeded train and test
  set.
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

import numpy as np

from toast._validation import Interval, Options, check

__all__ = ["Digits", "digits", "image_folder", "stdlib_sentences", "text_file"]


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
