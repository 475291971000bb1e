"""Local models and local data for the command line.

:func:`load_model` reads a Hugging Face model directory (``config.json`` and
weights; nothing is downloaded) into the class named by its config's
``architectures``. :func:`load_batches` turns local data into the batches
:func:`toast.analyze` eats: a folder of images (preprocessed by the model's
image processor when the directory has one) or a ``.txt`` / ``.jsonl`` text
file (tokenised by the model's tokenizer).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from toast._validation import Interval, check
from toast.data import image_folder
from toast.hf.data.text import TextData
from toast.io.gguf import load_gguf_model, load_gguf_tokenizer

__all__ = ["TOKENIZER_FILES", "load_batches", "load_model", "load_tokenizer"]

# Any one of these lets transformers' AutoTokenizer load a folder (the command
# line's own copy, toast.cli.checks.TOKENIZER_FILES, stays torch-free; a test
# keeps the two equal).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def _check_dir(path: str | os.PathLike) -> Path:
    root = Path(path)
    if not (root / "config.json").is_file():
        raise ValueError(
            f"{root} is not a local model directory (no config.json); toast reads models "
            "saved with save_pretrained and never downloads"
        )
    return root


def load_model(path: str | os.PathLike) -> torch.nn.Module:
    """The model saved in ``path``, in eval mode: a toast save (through
    :func:`toast.load_pretrained`), a ``save_pretrained`` folder, or a
    ``.gguf`` file of a causal LM (dequantized to float32 by transformers'
    GGUF loader, which needs the ``gguf`` package, on the first load; later
    loads read the float32 copy it cached: :mod:`toast.io.gguf`)."""
    from toast.io.load import load_pretrained

    root = Path(path)
    if root.suffix == ".gguf":
        return load_gguf_model(root)
    if (root / "toast_plan.json").is_file():
        return load_pretrained(root)
    return load_pretrained(_check_dir(root))


def load_tokenizer(path: str | os.PathLike) -> Any:
    """The tokenizer of the model at ``path`` (a folder or a ``.gguf`` file)."""
    import transformers

    root = Path(path)
    if root.suffix == ".gguf":
        return load_gguf_tokenizer(root)
    root = _check_dir(root)
    if not any((root / name).is_file() for name in TOKENIZER_FILES):
        # transformers would blame a missing sentencepiece or tiktoken instead
        raise ValueError(
            f"{root} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...): save the "
            "tokenizer next to the model (tokenizer.save_pretrained(folder))"
        )
    return transformers.AutoTokenizer.from_pretrained(root, local_files_only=True)


class _Batches:
    """A re-iterable, lazy sequence of batches: each pass reads the data
    again, one batch at a time, so memory holds one batch."""

    def __init__(self, count: int, make) -> None:
        self._count, self._make = count, make

    def __len__(self) -> int:
        return self._count

    def __iter__(self):
        for index in range(self._count):
            yield self._make(index)


def _image_batches(model_dir: Path, data: Path, config: Any, batch_size: int) -> _Batches:
    from PIL import Image

    files, _, _ = image_folder(data)
    processor = None
    if (model_dir / "preprocessor_config.json").is_file():
        import transformers

        processor = transformers.AutoImageProcessor.from_pretrained(
            model_dir, local_files_only=True
        )
    channels = int(getattr(config, "num_channels", 3))
    size = getattr(config, "image_size", 224)
    size = (size, size) if isinstance(size, int) else tuple(size)
    mode = "L" if channels == 1 else "RGB"

    def make(index: int) -> torch.Tensor:
        chunk = files[index * batch_size : (index + 1) * batch_size]
        images = [Image.open(f).convert(mode) for f in chunk]
        if processor is not None:
            return processor(images=images, return_tensors="pt")["pixel_values"]
        arrays = [
            np.asarray(im.resize(size[::-1]), dtype=np.float32).reshape(size[0], size[1], -1)
            / 255.0
            for im in images
        ]
        return torch.from_numpy(np.stack(arrays).transpose(0, 3, 1, 2).copy())

    return _Batches((len(files) + batch_size - 1) // batch_size, make)


def _text_batches(model_dir: Path, data: Path, batch_size: int, max_length: int) -> TextData:
    try:
        tokenizer = load_tokenizer(model_dir)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {data}: {exc}") from exc
    return TextData(data, tokenizer, max_length=max_length, batch_size=batch_size)


def load_batches(
    model_dir: str | os.PathLike,
    data: str | os.PathLike,
    *,
    batch_size: int = 32,
    max_length: int = 128,
):
    """Batches of ``data`` for the model in ``model_dir`` (a folder, or a
    ``.gguf`` file for text), read lazily, one batch at a time, on every
    pass: image tensors for a folder of images, tokenizer outputs for a
    ``.txt``/``.jsonl`` file (a :class:`toast.hf.data.text.TextData`: texts, or
    ``"messages"`` chats rendered by the tokenizer's chat template)."""
    check("batch_size", batch_size, Interval(int, 1, None))
    root, source = Path(model_dir), Path(data)
    if source.is_dir():
        import transformers

        plan = root / "toast_plan.json"
        if plan.is_file():
            import json

            config = transformers.PretrainedConfig.from_dict(json.loads(plan.read_text())["config"])
        else:
            config = transformers.AutoConfig.from_pretrained(
                _check_dir(root), local_files_only=True
            )
        return _image_batches(root, source, config, batch_size)
    if source.is_file():
        return _text_batches(root, source, batch_size, max_length)
    if not source.exists():
        raise FileNotFoundError(f"data {source} does not exist")
    raise ValueError(f"data {source} is neither a folder of images nor a text file")
