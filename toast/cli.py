"""Command line interface: ``toast demo`` (also ``python -m toast demo``)."""

from __future__ import annotations

import argparse
import sys


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="toast", description=__doc__)
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "demo":
        from toast.demo import run_demo

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
