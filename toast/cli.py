"""Command line interface: ``toast demo`` (also ``python -m toast demo``)."""

from __future__ import annotations

import argparse
import sys


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="toast", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="analyse a synthetic residual stream end to end")
    demo.add_argument("--blocks", type=int, default=8, help="number of toy blocks (default 8)")
    demo.add_argument("--dim", type=int, default=64, help="feature width (default 64)")
    demo.add_argument("--rows", type=int, default=20_000, help="calibration rows (default 20000)")
    demo.add_argument("--folds", type=int, default=5, help="folds for held-out errors (default 5)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--no-progress", action="store_true", help="hide progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "demo":
        from toast.demo import run_demo

        for name in ("blocks", "dim", "rows"):
            if getattr(args, name) < 1:
                print(f"toast demo: --{name} must be >= 1", file=sys.stderr)
                return 2
        run_demo(
            blocks=args.blocks,
            dim=args.dim,
            rows=args.rows,
            folds=args.folds,
            seed=args.seed,
            progress=not args.no_progress,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
