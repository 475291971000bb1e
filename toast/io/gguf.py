"""GGUF files, read once: transformers' GGUF reader parses the file three
times (config, tensor map, weights) and dequantizes every tensor, which takes
about a minute for SmolLM2-135M on 2 CPU cores, on every load. The first load
of a file therefore also writes what it produced, a float32 ``save_pretrained``
checkpoint and the tokenizer, into ``$TOAST_CACHE/gguf/<key>/`` (the key: the
file's resolved path, size and modification time, and the transformers
version); later loads read that folder in seconds. The copy holds exactly the
tensors and config the GGUF load gave (a test compares them), so a result
never depends on whether the cache was warm.

Entries are written into a hidden folder beside them that records its owner
(:func:`toast._scratch.hidden_sibling`) and is renamed into place only once
complete, so an interrupted write is never read and what a killed one left is
removed by the next write; they count against
``$TOAST_CACHE_LIMIT`` with the search cache's least-recently-used eviction
(:mod:`toast._cachedir`; ``toast cache list|clear --gguf``). Set
``TOAST_GGUF_CACHE=0`` to always read the GGUF file itself. A cache that
cannot be written (read-only, full disk) is skipped with a warning: the model
still loads.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from toast._cachedir import cache_limit, evict, gguf_cache_dir, touch
from toast._scratch import hidden_sibling

__all__ = ["CACHE_VARIABLE", "entry_for", "is_cached", "load_gguf_model", "load_gguf_tokenizer"]

CACHE_VARIABLE = "TOAST_GGUF_CACHE"
_RECIPE = "v1"  # bump when what an entry holds changes
_COMPLETE = "complete"  # written last: a folder without it is never read


def _enabled() -> bool:
    return os.environ.get(CACHE_VARIABLE, "1").strip().lower() not in ("0", "false", "no", "off")


def entry_for(file: Path) -> Path:
    """The cache folder of ``file`` (which need not exist yet)."""
    import transformers

    stat = file.stat()
    ident = f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    digest = hashlib.sha256(f"{ident}|{_RECIPE}".encode()).hexdigest()[:20]
    return gguf_cache_dir() / f"{file.stem}-{digest}"


def _require_gguf(file: Path) -> None:
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist")
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader)
    except ImportError as exc:
        raise ImportError(
            f"loading {file.name} needs the gguf package: pip install 'toast-compress[llm]'"
        ) from exc


def is_cached(file: Path) -> bool:
    """Whether the cache holds a complete copy of ``file``."""
    return (entry_for(file) / _COMPLETE).is_file()


def _cached(file: Path, part: str) -> Path | None:
    if not _enabled() or not is_cached(file):
        return None
    entry = entry_for(file)
    touch(entry)
    return entry / part


def load_gguf_model(file: Path) -> torch.nn.Module:
    """The causal LM of ``file``, dequantized to float32, in eval mode."""
    import transformers

    _require_gguf(file)
    folder = _cached(file, "model")
    if folder is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, local_files_only=True
        )
        # named as the GGUF load names it: where the file lies, not the cache
        model.config._name_or_path = model.name_or_path = str(file.parent)
        return model.eval()
    read = _read_model(file)
    if _enabled():
        _store(file, read, _read_tokenizer(file))
    return read.eval()


def load_gguf_tokenizer(file: Path) -> Any:
    """The tokenizer of ``file``."""
    import transformers

    _require_gguf(file)
    folder = _cached(file, "tokenizer")
    if folder is not None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        with contextlib.suppress(AttributeError):
            tokenizer.name_or_path = str(file.parent)
        return tokenizer
    return _read_tokenizer(file)


def _read_model(file: Path) -> torch.nn.Module:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        file.parent, gguf_file=file.name, dtype=torch.float32, local_files_only=True
    )
    _forget_gguf_origin(model)
    return model


def _read_tokenizer(file: Path) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(
        file.parent, gguf_file=file.name, local_files_only=True
    )


def _forget_gguf_origin(model: torch.nn.Module) -> None:
    # transformers dequantizes every GGUF tensor to a plain float32 weight but
    # keeps the model marked as quantized, and save_pretrained then refuses to
    # write it. Nothing quantized is left: drop the marks, so that the model
    # (compressed or not) saves as a standard float32 checkpoint.
    marks = (("hf_quantizer", None), ("is_quantized", False), ("quantization_method", None))
    for name, value in marks:
        if hasattr(model, name):
            setattr(model, name, value)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "quantization_config"):
        del config.quantization_config


def _store(file: Path, model: Any, tokenizer: Any) -> None:
    """Writes the entry of ``file``: the model and the tokenizer as loaded."""
    entry = entry_for(file)
    temporary: Path | None = None
    try:
        # owned by this process; what a killed write left goes at the next write
        temporary = hidden_sibling(entry, "gguf")
        model.save_pretrained(temporary / "model")
        tokenizer.save_pretrained(temporary / "tokenizer")
        (temporary / _COMPLETE).write_text(f"{file.resolve()}\n")
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(entry)  # a stale half of an older write
        os.replace(temporary, entry)
        temporary = None
        evict(entry.parent, cache_limit(), keep=frozenset({entry.name}))
    except OSError as exc:
        warnings.warn(
            f"could not cache the float32 copy of {file.name} in {entry.parent} ({exc}); "
            f"the next load reads the GGUF file again (set {CACHE_VARIABLE}=0 to skip the cache)",
            RuntimeWarning,
            stacklevel=3,
        )
    finally:
        if temporary is not None:  # failed or interrupted: nothing half-written stays
            shutil.rmtree(temporary, ignore_errors=True)
