"""Checks the command line makes before anything loads, and its output folders.

Every path a command reads or writes is checked first, so that a mistake
costs a second, not a model load and a calibration pass:
:func:`check_model_path`, :func:`check_data_path`, :func:`check_tokenizer_files`
and :func:`check_out` (the overwrite policy, and a probe that the folder
can be created). :func:`staged_output` then writes a command's results into
a hidden sibling folder that replaces ``--out`` only once everything is
written: an error or Ctrl-C leaves no partial output behind.

This module imports nothing heavy: ``toast --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from toast._scratch import hidden_sibling, owned_name

__all__ = [
    "TOKENIZER_FILES",
    "UsageError",
    "check_data_path",
    "check_model_path",
    "check_out",
    "check_tokenizer_files",
    "staged_output",
]

# Files a folder written by a toast command (or toast.save_pretrained) holds:
# --overwrite replaces such a folder, or an empty one, and nothing else.
_TOAST_OUTPUTS = (
    "toast_plan.json",
    "report.md",
    "spans.csv",
    "replaceme_report.md",
    "layer_distances.csv",
)

# Any one of these lets transformers' AutoTokenizer load a folder.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)


class UsageError(ValueError):
    """A command line that cannot work: exit status 2, one line on stderr."""


def check_model_path(path: str) -> Path:
    """``path`` is a model folder (``config.json`` or a toast save) or a ``.gguf`` file."""
    model = Path(path)
    if model.suffix == ".gguf":
        if not model.is_file():
            raise UsageError(f"model {model} does not exist")
        return model
    if not model.exists():
        raise UsageError(f"model folder {model} does not exist")
    if not model.is_dir():
        raise UsageError(f"model {model} is a file; give the folder save_pretrained wrote")
    if not ((model / "config.json").is_file() or (model / "toast_plan.json").is_file()):
        raise UsageError(
            f"{model} is not a local model directory (no config.json); toast reads models "
            "saved with save_pretrained and never downloads"
        )
    return model


def check_data_path(flag: str, path: str, *, folder_ok: bool = True) -> Path:
    """``path`` exists: a file (text), or, when ``folder_ok``, a folder of images."""
    data = Path(path)
    if not data.exists():
        raise UsageError(f"{flag} {data} does not exist")
    if data.is_dir() and not folder_ok:
        raise UsageError(f"{flag} {data} is a folder; give a .txt, .jsonl or .json file")
    if not (data.is_dir() or data.is_file()):
        raise UsageError(f"{flag} {data} is neither a file nor a folder")
    return data


def check_tokenizer_files(model: Path) -> None:
    """A model folder that must tokenize text holds the tokenizer's files."""
    if model.suffix == ".gguf":  # the tokenizer is inside the GGUF file
        return
    if not any((model / name).is_file() for name in TOKENIZER_FILES):
        raise UsageError(
            f"{model} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...): "
            "save the tokenizer next to the model (tokenizer.save_pretrained(folder))"
        )


def _is_toast_output(folder: Path) -> bool:
    return any((folder / name).is_file() for name in _TOAST_OUTPUTS)


def _nearest_existing(path: Path) -> Path:
    for parent in (path, *path.parents):
        if parent.exists():
            return parent
    return Path.cwd()


def check_out(path: str, overwrite: bool) -> Path:
    """``--out``: a new or empty folder, or with ``overwrite`` a folder a toast
    command wrote; its parent must be writable (probed by creating a file, so
    read-only file systems and permissions are both caught, as root too)."""
    out = Path(path).absolute()
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {path} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise UsageError(f"--out {path} exists and is not empty (pass --overwrite)")
        if not _is_toast_output(out):
            raise UsageError(
                f"--out {path} holds files no toast command wrote; refusing to overwrite it "
                "(give a new or empty folder)"
            )
    base = _nearest_existing(out.parent)
    if not base.is_dir():
        raise UsageError(f"--out {path}: {base} is a file, not a folder")
    try:
        with tempfile.NamedTemporaryFile(dir=base, prefix=".toast-probe-"):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UsageError(f"--out {path}: cannot write in {base} ({reason})") from None
    return out


@contextlib.contextmanager
def staged_output(out: Path) -> Iterator[Path]:
    """A hidden folder beside ``out`` to write into; it becomes ``out`` (replacing
    a folder :func:`check_out` allowed) when the block ends normally, and is
    removed when it raises, Ctrl-C included."""
    stage = hidden_sibling(out)  # what a killed run left beside out goes first
    try:
        yield stage
        if out.exists():
            old = owned_name(out, "old")
            os.replace(out, old)
            os.replace(stage, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(stage, out)
    finally:
        if stage.exists():
            shutil.rmtree(stage, ignore_errors=True)
