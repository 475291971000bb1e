"""``toast replaceme MODEL --data FILE --blocks N --out DIR``: ReplaceMe from the
command line (the user-facing text is ``_DESCRIPTION``, plain for ``--help``).

Imports nothing heavy at import time, so that ``toast --help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

from toast._validation import Interval, check
from toast.cli.checks import (
    check_data_path,
    check_model_path,
    check_out,
    check_tokenizer_files,
    staged_output,
)
from toast.cli.options import (
    EXIT_STATUSES,
    HELDOUT_HELP,
    add_calibration_arguments,
    add_config_arguments,
    add_memory_arguments,
    add_output_arguments,
    calibration_from_args,
    config_values,
    forced_path,
    heldout_value,
    quiet_libraries,
    report_warnings,
    say_path,
)
from toast.methods.replaceme.config import PAPER, ReplaceMeConfig

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
    "massive_rows",
    "precision",
    "loss",
    "solver",
    "init",
    "lr",
    "epochs",
    "holdout",
    "fallback",
    "candidates",
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
    "massive_rows": "LS rows whose massive activation the cut would create",
    "precision": "products of the LS statistics (mixed: float32, faster, less exact)",
    "init": "cosine: start from",
    "holdout": "fraction of calibration batches held out to check the fit",
    "fallback": "keep a fit even where plain removal measures better on held-out batches",
    "candidates": "windows measured on held-out batches to choose the cut",
    "loss": "cosine objective",
    "solver": "cosine solver",
    "lr": "cosine: Adam learning rate",
    "epochs": "cosine: Adam epochs",
    "include_padding": "fit on pad tokens too",
}


_DESCRIPTION = (
    "Removes N blocks of a local causal LM by ReplaceMe and writes a standard checkpoint "
    "that plain transformers loads. MODEL_PATH is a folder written by save_pretrained, with "
    "its tokenizer files, or a .gguf file (dequantized to float32; needs the gguf package); "
    "nothing is downloaded. --data is a local .txt file (one text per line), or a .jsonl / "
    ".json file (a 'text' field, or chat 'messages'). --out receives the checkpoint and its "
    "tokenizer, replaceme_report.md (with --heldout: measured perplexity of the original, "
    "plain removal and the pruned model), layer_distances.csv and distances.png."
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Adds the ``replaceme`` subcommand to the ``toast`` parser."""
    p = sub.add_parser(
        "replaceme",
        help="remove blocks of a local causal LM by ReplaceMe; save a standard checkpoint",
        description=_DESCRIPTION,
        epilog=EXIT_STATUSES,
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
    add_output_arguments(p)
    add_config_arguments(p, ReplaceMeConfig, _FIELDS, _HELP)
    p.add_argument(
        "--paper",
        action="store_true",
        help="the paper's protocol: every row fitted, the distance alone choosing the cut, "
        "no held-out check, cosine by Adam from the identity (options given beside it, "
        "other than their defaults, still apply)",
    )
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
    add_memory_arguments(p, "the pruned checkpoint written")
    add_calibration_arguments(p, max_samples=None)


def run(args: argparse.Namespace) -> int:
    """Runs ``toast replaceme``; returns the exit status (errors reach :func:`toast.cli.main`)."""
    return _run(args)


def _config(args: argparse.Namespace) -> ReplaceMeConfig:
    """The method's options from the command line (on the paper's preset
    with ``--paper``: the options left at their defaults take its values)."""
    values = config_values(args, _FIELDS)
    if args.paper:
        defaults = {f.name: f.default for f in dataclasses.fields(ReplaceMeConfig)}
        given = {k: v for k, v in values.items() if v != defaults[k]}
        values = {**values, **PAPER, **given}
    return ReplaceMeConfig(
        num_blocks=args.num_blocks,
        max_buffer_bytes=args.max_buffer_bytes,
        calibration=calibration_from_args(args),
        **values,
    )


def _check_paths(args: argparse.Namespace) -> tuple[Path, Path]:
    """Fails fast on paths, before anything loads; returns the model path and --out."""
    model_path = check_model_path(args.model)
    check_tokenizer_files(model_path)
    check_data_path("--data", args.data, folder_ok=False)
    if isinstance(args.heldout, str):
        check_data_path("--heldout", args.heldout, folder_ok=False)
    for flag, value in (("--max-length", args.max_length), ("--batch-size", args.batch_size)):
        check(flag, value, Interval(int, 1, None))
    return model_path, check_out(args.out, args.overwrite)


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
    import warnings

    model_path, out = _check_paths(args)
    config = _config(args)  # bad options fail before the model loads
    quiet_libraries(progress=not args.no_progress, quiet=args.quiet)
    if model_path.suffix != ".gguf" and _sequential(model_path, args, config):
        return _run_from_disk(model_path, out, args, config)

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
    with warnings.catch_warnings(record=True) as caught, staged_output(out) as stage:
        warnings.simplefilter("always")
        _, report = replaceme(model, batches, config, heldout=heldout)  # in place
        model.save_pretrained(stage)
        tokenizer.save_pretrained(stage)
        summary = report.to_markdown()
        (stage / "replaceme_report.md").write_text(summary + "\n", encoding="utf-8")
        _write_profile(report, args, stage)
        write_model_card(type(model).__name__, report, summary, stage)
    report_warnings(caught, quiet=args.quiet)
    print(summary)
    print(f"saved to {out}")
    return 0


def write_model_card(model_class: str, report: Any, summary: str, out: Path) -> None:
    """The model card, and one file mode for every file (transformers writes
    the weights 0600 and the rest 0644)."""
    import transformers

    from toast import __version__
    from toast.io.folder import apply_umask, write_card

    facts = {
        "model_class": model_class,
        "original_blocks": report.blocks_before,
        "blocks": report.blocks_after,
        "parameters": report.params_after,
        "toast_version": __version__,
        "transformers_version": transformers.__version__,
    }
    write_card(out, facts, summary, custom=False)
    apply_umask(out)


def _sequential(model_path: Path, args: argparse.Namespace, config: ReplaceMeConfig) -> bool:
    """Whether the model folder is calibrated block by block (printed with why)."""
    from toast.hf.budget import choose_path, open_checkpoint

    forced = forced_path(args)
    disk = open_checkpoint(model_path, config.calibration.blocks, forced, "toast replaceme")
    if disk is None:
        return False
    plan = choose_path(disk, args.max_memory, forced, False, "toast replaceme")
    say_path(plan, args, "toast replaceme")
    return plan.sequential


def _run_from_disk(
    model_path: Path, out: Path, args: argparse.Namespace, config: ReplaceMeConfig
) -> int:
    """ReplaceMe block by block from the folder; the pruned checkpoint is
    written without loading the model (with the folder's tokenizer files)."""
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
    data = TextData(args.data, tokenizer, **text)
    with staged_output(out) as stage:
        stage.rmdir()  # the checkpoint writer makes the folder itself, whole or not at all
        report = replaceme_from_disk(model_path, data, stage, config)
        summary = report.to_markdown()
        (stage / "replaceme_report.md").write_text(summary + "\n", encoding="utf-8")
        _write_profile(report, args, stage)
        write_model_card(_architecture(model_path), report, summary, stage)
    print(summary)
    print(f"saved to {out}")
    return 0


def _architecture(model_path: Path) -> str:
    """The model class a checkpoint folder names (its config's first architecture)."""
    import json

    config = json.loads((model_path / "config.json").read_text(encoding="utf-8"))
    return str((config.get("architectures") or ["unknown"])[0])


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
