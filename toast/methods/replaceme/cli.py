"""``toast replaceme MODEL_DIR --data FILE --blocks N --out DIR``.

Reads a local causal-LM directory (``save_pretrained`` output with its
tokenizer; nothing downloads) and a local ``.txt`` (one text per line) or
``.jsonl`` (a ``"text"`` field) file, removes ``N`` blocks by ReplaceMe
(:func:`toast.replaceme`) and writes a standard checkpoint to
``DIR`` (``model.save_pretrained`` plus the tokenizer) that plain
``transformers`` loads, with ``replaceme_report.md``, the reference code's
``layer_distances.csv`` and ``distances.png``.

This module imports nothing heavy at import time: ``toast --help`` stays fast.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from toast.methods.replaceme.config import ReplaceMeConfig

# The options that go to ReplaceMeConfig under their own names (the
# CLI's --batch-size is texts per batch, not the cosine fit's rows per step).
_CONFIG_OPTIONS = (
    "num_blocks",
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
    "max_buffer_bytes",
    "include_padding",
)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _bytes(text: str) -> int:
    """``"8GiB"``, ``"512M"``, ``"1000000"`` → bytes (powers of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8GiB, 512MiB, 1000000)")
    unit = (match.group(2) or "").upper().rstrip("B").rstrip("I")
    return int(float(match.group(1)) * _UNITS[unit])


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Adds the ``replaceme`` subcommand to the ``toast`` parser."""
    p = sub.add_parser(
        "replaceme",
        help="remove blocks of a local causal LM by ReplaceMe; save a standard checkpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL_PATH", help="local model directory (with tokenizer)")
    p.add_argument("--data", required=True, help="calibration text: .txt or .jsonl ('text')")
    p.add_argument(
        "--blocks", dest="num_blocks", type=int, required=True, help="number of blocks to remove"
    )
    p.add_argument("--out", required=True, help="output directory for the pruned model")
    p.add_argument("--objective", default="ls", choices=["ls", "cosine", "identity"])
    p.add_argument("--num-cuts", type=int, default=1, help="number of transforms (1)")
    p.add_argument("--adjacent", default="merge", choices=["merge", "forbid"])
    p.add_argument("--distance", default="angular", choices=["angular", "cosine", "l2"])
    p.add_argument("--distance-tokens", default="last", choices=["last", "all", "mean"])
    p.add_argument("--min-start", type=int, default=1, help="first block that may be cut (1)")
    p.add_argument("--structure", default="full", choices=["full", "diagonal", "orthogonal"])
    p.add_argument("--ridge", type=float, default=0.0, help="LS ridge alpha (0)")
    p.add_argument("--loss", default="approximate", choices=["approximate", "exact"])
    p.add_argument("--solver", default="adam", choices=["adam", "lbfgs"])
    p.add_argument("--lr", type=float, default=1e-4, help="cosine: Adam learning rate (1e-4)")
    p.add_argument("--epochs", type=int, default=10, help="cosine: Adam epochs (10)")
    p.add_argument(
        "--max-buffer",
        dest="max_buffer_bytes",
        type=_bytes,
        default="8GiB",
        help="cosine row buffer (8GiB)",
    )
    p.add_argument("--max-samples", type=int, default=None, help="calibration texts (all)")
    p.add_argument("--max-length", type=int, default=1024, help="tokens per text (1024)")
    p.add_argument("--batch-size", type=int, default=8, help="texts per batch (8)")
    p.add_argument("--include-padding", action="store_true", help="fit on pad tokens too")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")


def run(args: argparse.Namespace) -> int:
    """Runs ``toast replaceme``; returns the exit status."""
    try:
        return _run(args)
    except (ValueError, FileExistsError, FileNotFoundError, OSError) as exc:
        print(f"toast replaceme: {exc}", file=sys.stderr)
        return 2


def _config(args: argparse.Namespace) -> ReplaceMeConfig:
    """The method's options from the command line (calibration: the first
    ``--max-samples`` texts, ``--seed``, progress bars unless
    ``--no-progress``)."""
    from toast.hf.calibration import Calibration
    from toast.methods.replaceme.config import ReplaceMeConfig

    calibration = Calibration(
        max_samples=args.max_samples, seed=args.seed, progress=not args.no_progress
    )
    return ReplaceMeConfig(
        **{name: getattr(args, name) for name in _CONFIG_OPTIONS}, calibration=calibration
    )


def _run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise FileExistsError(f"{out} exists and is not empty (pass --overwrite)")
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir} is not a local model directory (no config.json)")
    if not Path(args.data).is_file():
        raise ValueError(f"--data {args.data} is not a file")
    config = _config(args)  # bad options fail before the model loads

    import torch
    import transformers

    from toast.io.local import load_batches
    from toast.methods.replaceme.method import replaceme

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, local_files_only=True, dtype=dtype
    )
    model.to(device).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    batches = load_batches(
        model_dir, args.data, batch_size=args.batch_size, max_length=args.max_length
    )
    _, report = replaceme(model, batches, config)  # in place
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    summary = report.to_markdown()
    (out / "replaceme_report.md").write_text(summary + "\n", encoding="utf-8")
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
    print(summary)
    print(f"saved to {out}")
    return 0
