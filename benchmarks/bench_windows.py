"""TOAST's measured choice on SmolLM2-135M-Instruct: every plan the default
measures before it keeps one, and how the same fits score elsewhere.

At 2/4/6/8 of 30 blocks, ``toast.compress(model, calib, num_blocks=n,
candidates=K)`` (``bench_fidelity.py``'s calibration split) fits its K plans
of lowest predicted error (the planned spans, then the single windows of
as many blocks) and measures each by 4-fold cross-validation over the 8
calibration batches (every batch scored by fits of the other folds); the
default measures the first 3 (``candidates=3``). For every candidate this
prints its predicted error, the figure the choice read, the perplexity on
the one batch the default's check holds out of the same spans fitted on the
other 7 (what the choice read before it cross-validated), and on
``bench_fidelity.py``'s selection and test splits, which no choice reads.

Usage: ``python benchmarks/bench_windows.py [--sizes 2 4 6 8] [--candidates 5]
[--out benchmarks/results/windows.json]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _machine  # noqa: E402
import bench_fidelity  # noqa: E402

import toast  # noqa: E402
from toast.hf.evaluate.check import CheckSplit  # noqa: E402
from toast.hf.evaluate.quality import Evaluator  # noqa: E402
from toast.hf.model.blocks import find_blocks  # noqa: E402
from toast.methods.translate.check import MeasuredPlans, translated  # noqa: E402
from toast.methods.translate.config import ToastConfig  # noqa: E402
from toast.methods.translate.fitting import Fitter  # noqa: E402

DEFAULT_CANDIDATES = ToastConfig(num_blocks=1).candidates


def _quiet(call: Any, *args: Any, **options: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return call(*args, **options)


def run(sizes: list[int], candidates: int) -> dict[str, Any]:
    model, _, calib, selection, test = bench_fidelity.data()
    stack = find_blocks(model)
    held = CheckSplit(calib, ToastConfig(num_blocks=1).check_fraction).check
    splits = {
        name: Evaluator(data, progress=False, fidelity=False)
        for name, data in (("held-out batch", held), ("selection", selection), ("test", test))
    }
    load = os.getloadavg()
    record: dict[str, Any] = {"candidates": candidates, "rows": []}
    for n in sizes:
        start = time.perf_counter()
        config = ToastConfig(num_blocks=n, candidates=candidates)
        _, report = _quiet(toast.compress, copy.deepcopy(model), calib, config=config)
        measured = report.measured
        assert measured is not None and measured.folds  # 8 batches: 4 folds
        fitter = Fitter(config)
        first = MeasuredPlans(
            measured.plans[:DEFAULT_CANDIDATES], measured.values[:DEFAULT_CANDIDATES],
            measured.metric, measured.count,
        )  # fmt: skip
        default = first.chosen  # what candidates=3 keeps
        for k, (plan, value) in enumerate(zip(measured.plans, measured.values, strict=True)):
            spans = [(s.start, s.stop) for s in plan]
            fits = _quiet(fitter.closed_forms, plan, report.analysis)
            row: dict[str, Any] = {
                "blocks": n, "spans": spans, "predicted": sum(s.error for s in plan),
                "heldout": value, "kept": k == default,
            }  # fmt: skip
            with translated(stack, plan, fits):
                for name, evaluator in splits.items():
                    row[name] = evaluator.measure(model, name)
            print(row, flush=True)
            record["rows"].append(row)
        record.setdefault("seconds", {})[str(n)] = time.perf_counter() - start
    record["measured_tokens"], record["folds"] = measured.count, measured.folds
    record["machine"] = _machine.machine(load)
    return record


def table(record: dict[str, Any]) -> str:
    lines = [
        f"| blocks | plan | predicted error | {record['folds']}-fold CV (the choice) "
        "| held-out batch | selection | test |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in record["rows"]:
        where = " + ".join(f"[{a}:{b}]" for a, b in r["spans"])
        if r["kept"]:
            where = f"**{where}** (kept)"
        cells = " | ".join(
            f"{r[k]:.2f}" for k in ("heldout", "held-out batch", "selection", "test")
        )
        lines.append(f"| {r['blocks']} | {where} | {r['predicted']:.4g} | {cells} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 6, 8])
    parser.add_argument("--candidates", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/windows.json")
    args = parser.parse_args()
    out = Path(args.out)
    start = time.perf_counter()
    record = run(args.sizes, args.candidates)
    record["wall_seconds"] = time.perf_counter() - start
    out.write_text(json.dumps(record, indent=1))
    text = (
        "# SmolLM2-135M-Instruct: the plans TOAST's default measures (`bench_windows.py`)\n\n"
        f"Each size: the {args.candidates} plans of lowest predicted error, each measured by "
        f"{record['folds']}-fold cross-validation over the 8 calibration batches "
        f"({record['measured_tokens']:,} tokens, every batch scored by fits of the other "
        f"folds: the figure the choice reads; the default measures the first "
        f"{DEFAULT_CANDIDATES} and keeps the bold one); then the same spans fitted on the 7 "
        "batches the default's check does not hold out, scored on the one it does (what the "
        "choice read before it cross-validated) and on bench_fidelity.py's selection and "
        "test splits (16 × 256 tokens each, read by no choice). "
        f"Wall time {record['wall_seconds'] / 60:.0f} min.\n\n"
        f"{table(record)}\n\n{_machine.describe(record['machine'])}\n"
    )
    out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
