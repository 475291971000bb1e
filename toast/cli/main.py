"""Command line interface (``toast ...`` or ``python -m toast ...``).

- ``toast demo``: the embedded end-to-end demo (digits ViT).
- ``toast analyze MODEL_DIR --data DATA --out DIR``: heatmap and span table.
- ``toast compress MODEL_DIR --data DATA --budget N --out DIR``: a compressed
  model saved with :func:`toast.save_pretrained`, with its report.
- ``toast replaceme MODEL_PATH --data FILE --blocks N --out DIR``: ReplaceMe on
  a local causal LM; a standard checkpoint out (:mod:`toast.methods.replaceme.cli`).
"""

from __future__ import annotations

import argparse
import sys

from toast.methods.replaceme.cli import add_parser as _add_replaceme


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="toast",
        description="Make pretrained transformers smaller and faster, with no training.",
        epilog="Run `toast COMMAND --help` for a command's options. Nothing is downloaded: "
        "models and data are local directories and files.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="compress a ViT trained on scikit-learn's digits, end to end, offline"
    )
    demo.add_argument("--out", default="toast-demo", help="output folder (default ./toast-demo)")
    demo.add_argument("--budget", type=int, default=2, help="blocks to remove (default 2)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--cache", default=None, help="model cache folder (default ~/.cache/toast)")
    demo.add_argument("--retrain", action="store_true", help="train the ViT even if cached")
    demo.add_argument("--no-progress", action="store_true", help="hide progress bars")
    _add_local_commands(sub)
    _add_replaceme(sub)
    return parser


def _add_local_commands(sub) -> None:
    def data_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("model", help="local model directory (save_pretrained or a toast save)")
        p.add_argument("--data", required=True, help="folder of images, or a .txt/.jsonl file")
        p.add_argument("--max-samples", type=int, default=512, help="calibration samples (512)")
        p.add_argument("--batch-size", type=int, default=32)
        p.add_argument("--tokens", default="all", choices=["all", "cls", "mean", "last"])
        p.add_argument("--estimator", default="cv", choices=["cv", "gcv", "in_sample"])
        p.add_argument("--out", required=True, help="output directory")
        p.add_argument("--no-progress", action="store_true", help="hide progress bars")

    analyze = sub.add_parser("analyze", help="block error matrix of a local model on local data")
    data_options(analyze)
    analyze.add_argument("--metric", default="linear", help="selection metric (default linear)")
    compress = sub.add_parser(
        "compress", help="replace redundant spans of a local model; save it with toast"
    )
    data_options(compress)
    compress.add_argument("--budget", type=int, help="blocks to remove")
    compress.add_argument("--max-error", type=float, help="largest predicted error per span")
    compress.add_argument("--translator", default="affine", help="translator kind (affine)")
    compress.add_argument("--overwrite", action="store_true", help="replace an existing --out")


def _run_local(args: argparse.Namespace) -> int:
    import warnings
    from pathlib import Path

    import toast
    from toast.io.local import load_batches, load_model

    out = Path(args.out)
    if args.command == "compress" and out.exists() and not args.overwrite:
        print(f"toast compress: {out} exists (pass --overwrite to replace it)", file=sys.stderr)
        return 2
    model = load_model(args.model)
    batches = load_batches(args.model, args.data, batch_size=args.batch_size)
    common = {
        "tokens": args.tokens,
        "estimator": args.estimator,
        "max_samples": args.max_samples,
        "progress": not args.no_progress,
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if args.command == "analyze":
            analysis = toast.analyze(model, batches, metric=args.metric, **common)
            out.mkdir(parents=True, exist_ok=True)
            analysis.heatmap().savefig(out / "heatmap.png", dpi=120, bbox_inches="tight")
            analysis.to_dataframe().to_csv(out / "spans.csv", index=False)
            lines = [f"{len(analysis.errors) - 1} blocks, {analysis.rows:,} rows; top spans:"]
            lines += [f"  {span}" for span in analysis.top_spans(5)]
            summary = "\n".join(lines)
        else:
            if args.budget is None and args.max_error is None:
                print("toast compress: give --budget and/or --max-error", file=sys.stderr)
                return 2
            model, report = toast.compress(
                model,
                batches,
                budget=args.budget,
                max_error=args.max_error,
                translator=args.translator,
                **common,
            )
            toast.save_pretrained(model, out, overwrite=args.overwrite)
            summary = report.to_markdown()
            (out / "report.md").write_text(summary + "\n", encoding="utf-8")
            report.analysis.heatmap(spans=report.spans).savefig(
                out / "heatmap.png", dpi=120, bbox_inches="tight"
            )
    for w in {str(w.message) for w in caught}:
        print(f"warning: {w}", file=sys.stderr)
    print(summary)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "replaceme":
        from toast.methods.replaceme.cli import run

        return run(args)
    if args.command in ("analyze", "compress"):
        try:
            return _run_local(args)
        except (ValueError, FileExistsError, FileNotFoundError) as exc:
            print(f"toast {args.command}: {exc}", file=sys.stderr)
            return 2
    if args.command == "demo":
        from toast.cli.demo import run_demo

        if not 1 <= args.budget <= 6:
            print(
                "toast demo: --budget must be between 1 and 6 (the ViT has 8 blocks)",
                file=sys.stderr,
            )
            return 2
        run_demo(
            out=args.out,
            budget=args.budget,
            seed=args.seed,
            cache=args.cache,
            retrain=args.retrain,
            progress=not args.no_progress,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
