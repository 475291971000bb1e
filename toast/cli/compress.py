"""``toast compress MODEL --method NAME --data DATA --out DIR [options]``: any
registered method on a local model, through :func:`toast.compress`.

The method's options are its config's fields (:func:`toast.methods.method_config`:
every number, string and flag of the dataclass, with its default and its
allowed values), so a method that registers is on the command line with no
code here. A checkpoint folder goes through the one entry, which loads it
when it fits ``--max-memory`` and compresses it block by block from disk
otherwise; a toast save or a ``.gguf`` file is loaded.

The output folder holds the model (a toast save where plain
``transformers`` cannot rebuild it, else a standard checkpoint with a model
card), the tokenizer, ``report.md`` and the method's figures: the heatmap
of an error matrix, the distance profile of a cut.

Imports nothing heavy at import time, so that ``toast --help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import warnings
from pathlib import Path
from typing import Any

from toast._validation import Interval, check
from toast.cli.checks import (
    UsageError,
    check_data_path,
    check_model_path,
    check_out,
    check_tokenizer_files,
    staged_output,
)
from toast.cli.launch import launched_group, quiet_unless_writer
from toast.cli.options import (
    EXIT_STATUSES,
    HELDOUT_HELP,
    add_calibration_arguments,
    add_config_arguments,
    add_memory_arguments,
    add_output_arguments,
    calibration_from_args,
    config_fields,
    config_values,
    forced_path,
    heldout_value,
    quiet_libraries,
    report_warnings,
)
from toast.methods import available_methods, method_config

__all__ = ["DEFAULT_METHOD", "add_parser", "run", "write_model_card"]

DEFAULT_METHOD = "toast"

_DESCRIPTION = (
    "Compresses a local model with one of toast's methods ({methods}) and writes it to --out: "
    "the model (a toast save where plain transformers cannot rebuild it, else a standard "
    "checkpoint with a model card), its tokenizer, report.md (with --heldout: measured "
    "quality of the original, plain removal and the compressed model) and the method's "
    "figures. MODEL is a folder written by save_pretrained (with its tokenizer files for "
    "text), a toast save, or a .gguf file; nothing is downloaded. A checkpoint folder that "
    "does not fit --max-memory with its run (statistics, a batch's forward and logits) is "
    "compressed block by block from disk, without loading it. "
    "The options under 'method' are those of --method {method}; `toast compress --method "
    "NAME --help` lists another method's."
)


def add_parser(sub: Any, method: str = DEFAULT_METHOD) -> None:
    """Adds the ``compress`` subcommand with the options of ``method``."""
    config = method_config(method)
    methods = available_methods()
    p = sub.add_parser(
        "compress",
        help=f"compress a local model with any method ({', '.join(methods)}); save it",
        description=_DESCRIPTION.format(methods=", ".join(methods), method=method),
        epilog=EXIT_STATUSES,
    )
    p.add_argument(
        "model", help="local model: a save_pretrained folder, a toast save or a .gguf file"
    )
    p.add_argument("--method", default=DEFAULT_METHOD, choices=methods, help="the method (toast)")
    p.add_argument(
        "--data",
        default=None,
        help="calibration data: a folder of images, or text: .txt (a text per line), .jsonl or "
        ".json ('text', or chat 'messages' rendered by the tokenizer's chat template)",
    )
    p.add_argument("--heldout", type=heldout_value, default=None, help=HELDOUT_HELP)
    add_output_arguments(p)
    reading = p.add_argument_group("reading the data and the model")
    reading.add_argument("--batch-size", type=int, default=8, help="samples per batch (8)")
    reading.add_argument("--max-length", type=int, default=1024, help="tokens per text (1024)")
    reading.add_argument(
        "--pack",
        action="store_true",
        help="join the texts and cut them into sequences of exactly --max-length tokens "
        "(for files of short lines; the usual perplexity protocol)",
    )
    reading.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    reading.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto)")
    add_memory_arguments(p, "the compressed model written")
    options = p.add_argument_group(f"method ({method})")
    add_config_arguments(options, config, config_fields(config))  # help: the config's HELP
    if hasattr(config, "paper"):
        options.add_argument(
            "--paper",
            action="store_true",
            help="the paper's protocol (options given beside it, other than their defaults, "
            "still apply)",
        )
    add_calibration_arguments(p, max_samples=None)


def config_from_args(args: argparse.Namespace) -> Any:
    """The method's config from the command line (on the paper's preset with
    ``--paper``: the options left at their defaults take its values)."""
    config: Any = method_config(args.method)
    values = config_values(args, config_fields(config))
    calibration = calibration_from_args(args)
    if getattr(args, "paper", False):
        defaults = {f.name: f.default for f in dataclasses.fields(config)}
        given = {k: v for k, v in values.items() if v != defaults.get(k)}  # an alias: None
        return config.paper(**given, calibration=calibration)
    return config(**values, calibration=calibration)


def _check(args: argparse.Namespace, writer: bool = True) -> Path:
    """Every argument, path and the output folder (``writer``: this process
    writes it), before anything loads."""
    from toast.methods import get_method

    model = check_model_path(args.model)
    if args.data is not None:
        data = check_data_path("--data", args.data)
        if data.is_file():
            check_tokenizer_files(model)
        if isinstance(args.heldout, str):
            check_data_path("--heldout", args.heldout, folder_ok=data.is_dir())
    for flag, value in (("--max-length", args.max_length), ("--batch-size", args.batch_size)):
        check(flag, value, Interval(int, 1, None))
    args.config = config_from_args(args)  # bad options fail before the model loads
    if args.data is None and get_method(args.method).needs_data:
        raise UsageError(f"--method {args.method} needs calibration data: pass --data")
    if args.memory_path == "disk" and not _is_checkpoint_folder(model):
        raise UsageError(
            f"--path disk needs a Hugging Face checkpoint folder with safetensors weights; "
            f"{model} is not one (a toast save, a .gguf file, pickled weights): use --path memory"
        )
    return check_out(args.out, args.overwrite) if writer else Path(args.out)


def _is_checkpoint_folder(folder: Path) -> bool:
    plain = (folder / "config.json").is_file() and not (folder / "toast_plan.json").exists()
    return plain and any(folder.glob("*.safetensors"))


def _read(args: argparse.Namespace, path: str | float | None) -> tuple[Any, dict[str, Any]]:
    """``path`` as :func:`toast.compress` takes it: a text file stays a path
    (read with the tokenizer and the text options returned), a folder of
    images becomes batches; a fraction passes through."""
    if path is None or isinstance(path, float):
        return path, {}
    from toast.io.local import load_batches, load_tokenizer

    if Path(path).is_dir():
        return load_batches(args.model, path, batch_size=args.batch_size), {}
    text = {"max_length": args.max_length, "batch_size": args.batch_size, "pack": args.pack}
    return path, {"tokenizer": load_tokenizer(args.model), **text}


def _device(device: str) -> str | None:
    """``--device``: ``auto`` is the GPU when there is one, else the CPU (None)."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else None


def run(args: argparse.Namespace) -> int:
    """Runs ``toast compress``; returns the exit status (errors reach
    :func:`toast.cli.main`). Under torchrun every rank compresses, each
    forwarding its share of the batches, and rank 0 writes
    (:mod:`toast.cli.launch`)."""
    with launched_group(_device(args.device)):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    writer = quiet_unless_writer(args)
    out = _check(args, writer)
    quiet_libraries(progress=not args.no_progress, quiet=args.quiet)
    from toast.methods import compress

    data, text = _read(args, args.data)
    heldout, held_text = _read(args, args.heldout)  # a text file is read with --data's options
    if held_text and not text:  # held-out text beside images: read on its own
        from toast.io.local import load_batches

        read = {"batch_size": args.batch_size, "max_length": args.max_length}
        heldout = load_batches(args.model, args.heldout, **read)

    def compressed(output: Path) -> Any:
        return compress(
            Path(args.model), data, method=args.method, output=output, config=args.config,
            max_memory=args.max_memory, sequential=forced_path(args), heldout=heldout,
            device=_device(args.device), dtype=None if args.dtype == "auto" else args.dtype,
            **text,
        )  # fmt: skip

    if not writer:  # the same run, its folder (rank 0's twin) thrown away
        with warnings.catch_warnings(), tempfile.TemporaryDirectory(prefix="toast-") as tmp:
            warnings.simplefilter("ignore")
            compressed(Path(tmp) / "model")
        return 0
    with warnings.catch_warnings(record=True) as caught, staged_output(out) as stage:
        warnings.simplefilter("always")
        stage.rmdir()  # toast.compress makes the folder itself, whole or not at all
        report = compressed(stage)
        summary = report.to_markdown()
        _write_extras(report, summary, args.config, stage)
    report_warnings(caught, quiet=args.quiet)
    print(summary)
    print(f"saved to {out}")
    return 0


def _write_extras(report: Any, summary: str, config: Any, out: Path) -> None:
    """``report.md``, the figures the report has data for, and a model card
    for a standard checkpoint (a toast save wrote its own)."""
    (out / "report.md").write_text(summary + "\n", encoding="utf-8")
    analysis = getattr(report, "analysis", None)
    if analysis is not None:  # an error matrix: the heatmap with the chosen spans
        figure = analysis.heatmap(spans=report.spans)
        figure.savefig(out / "heatmap.png", dpi=120, bbox_inches="tight")
    if getattr(report, "profile", None) is not None:  # a cut chosen by its distance profile
        _write_profile(report, config, out)
    if not (out / "toast_plan.json").exists():
        write_model_card(_architecture(out), report, summary, out)


def _write_profile(report: Any, config: Any, out: Path) -> None:
    """The reference code's ``layer_distances.csv`` and ``distances.png``."""
    window = config.num_blocks // config.num_cuts
    report.profile.to_csv(out / "layer_distances.csv", window, metric=config.distance)
    try:
        import matplotlib

        matplotlib.use("Agg")
        fig = report.profile.plot(
            window, config.distance, cuts=report.spans, min_start=config.min_start
        )
        fig.savefig(out / "distances.png", dpi=120, bbox_inches="tight")
    except ImportError:  # matplotlib is an optional dependency
        pass


def _architecture(folder: Path) -> str:
    """The model class a checkpoint folder names (its config's first architecture)."""
    import json

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return str((config.get("architectures") or ["unknown"])[0])


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
