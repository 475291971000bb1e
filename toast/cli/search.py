"""``toast search MODEL --data DATA --heldout HELDOUT --target 20% --out DIR``:
:func:`toast.search` on a local model, the chosen model and the report
(table, plot, JSON) written to ``--out``. A model folder that does not fit
``--max-memory`` is searched block by block from disk, never loaded (the
choice said once, as ``toast compress`` says it)."""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import Any

from toast._cachedir import cache_limit
from toast._validation import Interval, check
from toast.cli.checks import (
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
    add_memory_arguments,
    add_output_arguments,
    calibration_from_args,
    forced_path,
    heldout_value,
    quiet_libraries,
    report_warnings,
)

__all__ = ["add_parser", "run"]

_HELP = "find the best compression for a target across every method, measured on held-out data"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("search", help=_HELP, description=_HELP, epilog=EXIT_STATUSES)
    p.add_argument("model", help="local model: a directory, or a .gguf file")
    p.add_argument("--data", required=True, help="calibration data: folder of images, or text")
    p.add_argument("--heldout", type=heldout_value, required=True, help=HELDOUT_HELP)
    p.add_argument(
        "--target",
        default="params=20%",
        help="params=20%%, macs=25%%, latency=30%% or quality=10%% (params=20%%)",
    )
    p.add_argument(
        "--objective",
        default=None,
        help="what the front and the choice follow: perplexity, kl, kl_p99, agreement, "
        "accuracy, cosine, or task:PRESET|TASKS|YAML (default: the model's held-out metric)",
    )
    p.add_argument(
        "--task-limit",
        type=int,
        default=None,
        help="examples per task for a task: objective (all)",
    )
    p.add_argument("--max-measured", type=int, default=8, help="candidates to measure (8)")
    p.add_argument("--max-minutes", type=float, default=None, help="time budget (none)")
    p.add_argument("--max-blocks", type=int, default=None, help="most blocks removed (half)")
    p.add_argument("--no-latency", action="store_true", help="do not measure throughput")
    p.add_argument(
        "--latency-batch",
        type=int,
        default=None,
        help="time candidates and the original at this batch size, e.g. 1 for one request "
        "(default: the held-out batch as it comes; one sequence for text)",
    )
    p.add_argument("--cache", default=None, help="cache folder (~/.cache/toast/search)")
    p.add_argument("--no-cache", action="store_true", help="keep nothing between calls")
    p.add_argument("--batch-size", type=int, default=8, help="samples per batch (8)")
    p.add_argument("--max-length", type=int, default=256, help="tokens per text sample (256)")
    p.add_argument(
        "--methods",
        nargs="+",
        default=None,
        metavar="METHOD",
        help="search these methods only (default every one: toast compress --method's list)",
    )
    add_memory_arguments(p, "the chosen model written")
    add_output_arguments(p)
    add_calibration_arguments(p, max_samples=256, blocks_flag=True)


def _check(args: argparse.Namespace, writer: bool = True) -> Path | None:
    """Every argument and path before anything loads; the output folder
    where this process writes it (``writer``), else None."""
    from toast.frontier.objective import Objective
    from toast.frontier.target import Target
    from toast.hf.capture.budget import parse_size

    model = check_model_path(args.model)
    data = check_data_path("--data", args.data)
    if isinstance(args.heldout, str):
        check_data_path("--heldout", args.heldout, folder_ok=data.is_dir())
    if data.is_file():
        check_tokenizer_files(model)
    args.target = Target.parse(args.target)
    check("--task-limit", args.task_limit, Interval(int, 1, None), None)
    args.objective = Objective.parse(args.objective, _task_options(args))
    args.objective.check_target(args.target.kind)
    args.objective.check_tasks()  # a task whose data is missing fails before anything loads
    for name in ("max_measured", "batch_size", "max_length"):
        check(f"--{name.replace('_', '-')}", getattr(args, name), Interval(int, 1, None))
    check("--max-blocks", args.max_blocks, Interval(int, 1, None), None)
    check("--max-minutes", args.max_minutes, Interval(float, 0, None, closed="neither"), None)
    calibration_from_args(args)  # checks --max-samples, --max-batches
    if args.max_memory is not None:
        parse_size(args.max_memory)  # a bad size fails before anything loads
    if not args.no_cache:
        cache_limit()  # a bad $TOAST_CACHE_LIMIT too
    return check_out(args.out, args.overwrite) if writer else None


def _task_options(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.task_limit is None:
        return None
    if not str(args.objective or "").startswith("task:"):
        raise ValueError("--task-limit applies to --objective task:... only")
    return {"limit": args.task_limit}


def run(args: argparse.Namespace) -> int:
    """Runs ``toast search``; returns the exit status. Under torchrun every
    rank searches, each forwarding its share of the calibration and
    held-out batches, and rank 0 writes (:mod:`toast.cli.launch`)."""
    with launched_group(getattr(args, "device", None)):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    out = _check(args, quiet_unless_writer(args))
    quiet_libraries(progress=not args.no_progress, quiet=args.quiet)
    import toast
    from toast.io.local import load_batches

    read = {"batch_size": args.batch_size, "max_length": args.max_length}
    data = load_batches(args.model, args.data, **read)
    heldout = args.heldout
    if isinstance(heldout, str):
        heldout = load_batches(args.model, heldout, **read)
    cache = False if args.no_cache else (args.cache or True)
    calibration = calibration_from_args(args)

    def searched() -> Any:
        return toast.search(
            Path(args.model),  # loaded, or searched from disk, as --max-memory allows
            data,
            heldout,
            target=args.target,
            max_measured=args.max_measured,
            max_minutes=args.max_minutes,
            max_blocks=args.max_blocks,
            latency=False if args.no_latency else (args.latency_batch or True),
            cache=cache,
            calibration=calibration,
            max_memory=args.max_memory,
            sequential=forced_path(args),
            objective=args.objective,
            methods=args.methods,
        )

    if out is None:  # another rank: the same search, nothing written
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            searched()
        return 0
    with warnings.catch_warnings(record=True) as caught, staged_output(out) as stage:
        warnings.simplefilter("always")
        result = searched()
        result.save(stage)
    report_warnings(caught, quiet=args.quiet)
    print(result.to_markdown())
    return 0
