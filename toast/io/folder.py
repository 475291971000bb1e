"""What makes a saved folder self-contained besides the model: the files
that preprocess its inputs, the sentence-transformers modules, a model card,
and one file mode policy.

- :func:`copy_companions` copies, from the folder the model was read from,
  the tokenizer / image processor / generation config files and, for a
  sentence-transformers model, ``modules.json``, its configs and its module
  folders (pooling, normalisation), so that ``SentenceTransformer(folder)``
  loads the saved model with the original pipeline;
- :func:`write_card` writes ``README.md``: the compression report (with the
  measured quality when the report has it) and how to load the folder;
- :func:`apply_umask` gives every file the mode a newly created file gets
  (``0666`` less the umask): safetensors and ``transformers`` create some
  files private (0600) and others not.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

__all__ = ["COMPANION_FILES", "apply_umask", "copy_companions", "write_card"]

#: Files of a model folder that are not the model but belong with it.
COMPANION_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "image_processor_config.json",
    "generation_config.json",
)
# sentence-transformers' own files at the top of its folder.
_SENTENCE_FILES = (
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
)


def _sentence_modules(source: Path) -> list[str]:
    """The sub-folders that ``modules.json`` lists (empty paths excluded)."""
    try:
        modules = json.loads((source / "modules.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    paths = []
    for entry in modules if isinstance(modules, list) else []:
        path = entry.get("path") if isinstance(entry, dict) else None
        if isinstance(path, str) and path and not os.path.isabs(path) and ".." not in path:
            paths.append(path)
    return paths


def copy_companions(source: str | os.PathLike[str] | None, target: Path) -> list[str]:
    """Copies the companion files of the model folder ``source`` into
    ``target`` (files ``target`` has already are kept); returns their names.
    A ``.gguf`` file or a missing folder has none."""
    if source is None or not Path(source).is_dir():
        return []
    root = Path(source)
    copied = []
    for name in COMPANION_FILES + _SENTENCE_FILES:
        if (root / name).is_file() and not (target / name).exists():
            shutil.copyfile(root / name, target / name)
            copied.append(name)
    if "modules.json" in copied:
        for sub in _sentence_modules(root):
            if (root / sub).is_dir() and not (target / sub).exists():
                shutil.copytree(root / sub, target / sub, copy_function=shutil.copyfile)
                copied.append(sub)
    return copied


def _how_to_load(target: Path, custom: bool, name: str) -> list[str]:
    lines = [
        "## How to load",
        "",
        "```python",
        "import toast",
        f'model = toast.load_pretrained("{name}")',
        "```",
        "",
    ]
    if custom:
        lines += [
            "Without toast installed, transformers rebuilds it from the `toast_modeling.py` "
            "in this folder:",
            "",
            "```python",
            "from transformers import AutoModel",
            f'model = AutoModel.from_pretrained("{name}", trust_remote_code=True)',
            "```",
            "",
        ]
    else:
        lines += ["It is a standard checkpoint: `AutoModel.from_pretrained` loads it.", ""]
    if (target / "modules.json").is_file():
        lines += [
            "As a sentence-transformers model (after `import toast.io`, or with "
            "`trust_remote_code=True` where toast is not installed):",
            "",
            "```python",
            "import toast.io  # registers toast saves with transformers' Auto classes",
            "from sentence_transformers import SentenceTransformer",
            f'model = SentenceTransformer("{target.name}")',
            "```",
            "",
        ]
    return lines


def write_card(
    target: Path, summary: dict[str, Any], report: str | None, custom: bool, name: str = ""
) -> None:
    """Writes ``target/README.md``: what the model is, the report, how to
    load it from the folder ``name`` (default: ``target``'s own; a save
    written into a temporary sibling passes the name it is renamed to)."""
    lines = [
        f"# {summary['model_class']} compressed with toast",
        "",
        f"{summary['original_blocks']} blocks → {summary['blocks']}; "
        f"{summary['parameters']:,} parameters. Saved by toast {summary['toast_version']} "
        f"with transformers {summary['transformers_version']}.",
        "",
    ]
    if report:
        lines += ["## Compression report", "", report.strip(), ""]
    lines += _how_to_load(target, custom, name or target.name)
    (target / "README.md").write_text("\n".join(lines), encoding="utf-8")


def _umask() -> int:
    # os.umask can only be read by setting it; put it straight back.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(folder: Path) -> None:
    """Gives every file under ``folder`` mode ``0666 & ~umask`` and every
    folder ``0777 & ~umask``, as newly created ones get."""
    mask = _umask()
    for path in [folder, *folder.rglob("*")]:
        if path.is_symlink():
            continue
        mode = 0o777 if path.is_dir() else 0o666
        if stat.S_IMODE(path.stat().st_mode) != mode & ~mask:
            os.chmod(path, mode & ~mask)
