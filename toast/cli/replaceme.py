"""``toast replaceme MODEL --data FILE --blocks N --out DIR``.

Reads a local causal LM, a directory (``save_pretrained`` output with its
tokenizer) or a ``.gguf`` file (dequantized to float32; needs the ``gguf``
package), nothing downloaded, and a local ``.txt`` (one text per line),
``.jsonl`` or ``.json`` (a ``"text"`` field, or chat ``"messages"``) file,
removes ``N`` blocks by ReplaceMe (:func:`toast.replaceme`) and writes a
standard checkpoint to ``DIR`` (``model.save_pretrained`` plus the
tokenizer) that plain ``transformers`` loads, with ``replaceme_report.md``
(with ``--heldout``: measured perplexity of the original, plain removal and
the pruned model), the reference code's ``layer_distances.csv`` and
``distances.png``.

This module imports nothing heavy at import time: ``toast --help`` stays fast.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from toast.cli.options import (
    HELDOUT_HELP,
    add_calibration_arguments,
    add_config_arguments,
    calibration_from_args,
    config_values,
    heldout_value,
)
from toast.methods.replaceme.config import ReplaceMeConfig

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _bytes(text: str) -> int:
    """``"8GiB"``, ``"512M"``, ``"1000000"`` → bytes (powers of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8GiB, 512MiB, 1000000)")
    unit = (match.group(2) or "").upper().rstrip("B").rstrip("I")
    return int(float(match.group(1)) * _UNITS[unit])


# ReplaceMeConfig fields offered as --options under their own names, with
# the config's defaults and allowed values (--blocks and --max-buffer below
# keep their established spellings).
_FIELDS = [
    "objective",
    "num_cuts",
    "adjacent",
    "distance",
    "distance_tokens",
    "min_start",
    "structure",
    "ridge",
    "loss",
    "solver",
    "lr",
    "epochs",
    "include_padding",
]
_HELP = {
    "objective": "how the transform is fitted",
    "num_cuts": "number of transforms",
    "adjacent": "what to do with touching cuts",
    "distance": "distance of the cut profile",
    "distance_tokens": "tokens the profile measures",
    "min_start": "first block that may be cut",
    "structure": "structure of the LS transform",
    "ridge": "LS ridge alpha",
    "loss": "cosine objective",
    "solver": "cosine solver",
    "lr": "cosine: Adam learning rate",
    "epochs": "cosine: Adam epochs",
    "include_padding": "fit on pad tokens too",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Adds the ``replaceme`` subcommand to the ``toast`` parser."""
    p = sub.add_parser(
        "replaceme",
        help="remove blocks of a local causal LM by ReplaceMe; save a standard checkpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model",
        metavar="MODEL_PATH",
        help="local model directory (with tokenizer), or a .gguf file",
    )
    p.add_argument(
        "--data",
        required=True,
        help="calibration text: .txt (a text per line), .jsonl or .json ('text', or chat "
        "'messages' rendered by the tokenizer's chat template)",
    )
    p.add_argument(
        "--heldout",
        type=heldout_value,
        default=None,
        help=HELDOUT_HELP + " (for a causal LM: perplexity)",
    )
    p.add_argument(
        "--blocks", dest="num_blocks", type=int, required=True, help="number of blocks to remove"
    )
    p.add_argument("--out", required=True, help="output directory for the pruned model")
    add_config_arguments(p, ReplaceMeConfig, _FIELDS, _HELP)
    p.add_argument(
        "--max-buffer",
        dest="max_buffer_bytes",
        type=_bytes,
        default="8GiB",
        help="cosine row buffer (8GiB)",
    )
    p.add_argument("--max-length", type=int, default=1024, help="tokens per text (1024)")
    p.add_argument("--batch-size", type=int, default=8, help="texts per batch (8)")
    p.add_argument(
        "--pack",
        action="store_true",
        help="join the texts and cut them into sequences of exactly --max-length tokens "
        "(for files of short lines; the usual perplexity protocol)",
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument(
        "--max-memory",
        default=None,
        help="memory budget (e.g. 64GiB; default: what the machine has available): a model "
        "folder that does not fit is calibrated block by block from disk and written "
        "without loading it",
    )
    p.add_argument(
        "--path",
        dest="memory_path",
        default="auto",
        choices=["auto", "memory", "disk"],
        help="force the in-memory or the block-by-block path (auto: by --max-memory)",
    )
    add_calibration_arguments(p, max_samples=None)


def run(args: argparse.Namespace) -> int:
    """Runs ``toast replaceme``; returns the exit status."""
    try:
        return _run(args)
    except (ValueError, FileExistsError, FileNotFoundError, OSError) as exc:
        print(f"toast replaceme: {exc}", file=sys.stderr)
        return 2


def _config(args: argparse.Namespace) -> ReplaceMeConfig:
    """The method's options from the command line."""
    return ReplaceMeConfig(
        num_blocks=args.num_blocks,
        max_buffer_bytes=args.max_buffer_bytes,
        calibration=calibration_from_args(args),
        **config_values(args, _FIELDS),
    )


def _check_paths(args: argparse.Namespace) -> Path:
    """Fails fast on paths, before anything loads; returns the model path."""
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise FileExistsError(f"{out} exists and is not empty (pass --overwrite)")
    model_path = Path(args.model)
    is_gguf = model_path.suffix == ".gguf"
    if is_gguf and not model_path.is_file():
        raise ValueError(f"{model_path} does not exist")
    if not is_gguf and not (model_path / "config.json").is_file():
        raise ValueError(f"{model_path} is not a local model directory (no config.json)")
    for flag, path in (("--data", args.data), ("--heldout", args.heldout)):
        if isinstance(path, str) and not Path(path).is_file():
            raise ValueError(f"{flag} {path} is not a file")
    return model_path


def _load(model_path: Path, args: argparse.Namespace) -> Any:
    """The causal LM on ``--device`` in ``--dtype`` (a GGUF file dequantized)."""
    import torch
    import transformers

    from toast.io.local import load_model

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    model: Any  # a transformers causal LM either way
    if model_path.suffix == ".gguf":  # dequantized to float32
        model = load_model(model_path)
        if dtype != "auto":
            model.to(dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_path, local_files_only=True, dtype=dtype
        )
    return model.to(device).eval()


def _run(args: argparse.Namespace) -> int:
    model_path = _check_paths(args)
    config = _config(args)  # bad options fail before the model loads
    if model_path.suffix != ".gguf" and _sequential(model_path, args, config):
        return _run_from_disk(model_path, args, config)

    from toast.hf.text import TextData
    from toast.io.local import load_tokenizer
    from toast.methods.replaceme.method import replaceme

    model = _load(model_path, args)
    tokenizer = load_tokenizer(model_path)
    text = {"max_length": args.max_length, "batch_size": args.batch_size, "pack": args.pack}
    batches = TextData(args.data, tokenizer, **text)
    heldout = args.heldout  # None, or a fraction of the calibration texts
    if isinstance(heldout, str):
        heldout = TextData(heldout, tokenizer, **text)
    _, report = replaceme(model, batches, config, heldout=heldout)  # in place
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    summary = report.to_markdown()
    (out / "replaceme_report.md").write_text(summary + "\n", encoding="utf-8")
    _write_profile(report, args, out)
    print(summary)
    print(f"saved to {out}")
    return 0


def _sequential(model_path: Path, args: argparse.Namespace, config: ReplaceMeConfig) -> bool:
    """Whether the model folder is calibrated block by block (printed with why)."""
    from toast.hf.sequential import DiskModel
    from toast.methods.replaceme.checkpoint import choose_path

    forced = {"auto": None, "memory": False, "disk": True}[args.memory_path]
    disk = DiskModel.open(model_path, config.calibration.blocks)
    return choose_path(disk, args.max_memory, forced, progress=True).sequential


def _run_from_disk(model_path: Path, args: argparse.Namespace, config: ReplaceMeConfig) -> int:
    """ReplaceMe block by block from the folder; the pruned checkpoint is
    written without loading the model (with the folder's tokenizer files)."""
    import shutil

    from toast.hf.text import TextData
    from toast.io.local import load_tokenizer
    from toast.methods.replaceme.disk import replaceme_from_disk

    if args.heldout is not None:
        print(
            "toast replaceme: --heldout needs the model in memory; not measured on the "
            "sequential path",
            file=sys.stderr,
        )
    if args.dtype != "auto":
        print(
            f"toast replaceme: the sequential path computes in the checkpoint's dtype; "
            f"--dtype {args.dtype} is ignored",
            file=sys.stderr,
        )
    tokenizer = load_tokenizer(model_path)
    text = {"max_length": args.max_length, "batch_size": args.batch_size, "pack": args.pack}
    out = Path(args.out)
    fresh = out.with_name(f".{out.name}.new")
    shutil.rmtree(fresh, ignore_errors=True)
    report = replaceme_from_disk(model_path, TextData(args.data, tokenizer, **text), fresh, config)
    if out.exists():  # empty, or --overwrite (checked before anything ran)
        shutil.rmtree(out)
    fresh.rename(out)
    summary = report.to_markdown()
    (out / "replaceme_report.md").write_text(summary + "\n", encoding="utf-8")
    _write_profile(report, args, out)
    print(summary)
    print(f"saved to {out}")
    return 0


def _write_profile(report: Any, args: argparse.Namespace, out: Path) -> None:
    """The reference code's ``layer_distances.csv`` and ``distances.png``."""
    profile = report.profile
    assert profile is not None  # --blocks always chooses the cut from a profile
    window = args.num_blocks // args.num_cuts
    profile.to_csv(out / "layer_distances.csv", window, metric=args.distance)
    try:
        import matplotlib

        matplotlib.use("Agg")
        fig = profile.plot(window, args.distance, cuts=report.spans, min_start=args.min_start)
        fig.savefig(out / "distances.png", dpi=120, bbox_inches="tight")
    except ImportError:  # matplotlib is an optional dependency
        pass
