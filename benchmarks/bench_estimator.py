"""Does TOAST's default estimator change what it chooses? Spans planned
from 5-fold held-out errors (``estimator="cv"``, the default before) and
from generalised cross-validation (``"gcv"``, what ``"auto"`` takes with
enough rows) side by side, on real models.

For each model the calibration batches are split as ``toast.compress``
splits them (``check_fraction=0.1``: the batches its held-out check keeps
out are not analysed), then analysed once per estimator with pairs up to
8 blocks apart, and the exact plan of every budget from 1 to 8 blocks is
compared. Then ``toast.compress(model, calib, budget=4)`` runs with the
default (``"auto"``) and with ``estimator="cv"``, each in its own process
(one thread), and the results are scored on data no run sees:

- SmolLM2-135M-Instruct (``bench_fidelity.py``'s data: 32 sequences of 256
  tokens, 7,168 rows analysed, width 576): test perplexity;
- DINOv2 ViT-S/14 (``toast.zoo.dinov2_vits14``, 224 x 224): 64 crops of
  scikit-image's photographs (seed 0; the 48 the check leaves, 12,336 token
  rows, width 384); the
  mean cosine of the CLS feature to the original's on 64 other crops
  (seed 2).

Usage::

    .venv/bin/python benchmarks/bench_estimator.py     # ~6 min here

Writes ``benchmarks/results/estimator.md`` and ``estimator.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

MODELS = ("smollm2", "dinov2")
BUDGETS = range(1, 9)
SIZE = 224


def _data(name: str) -> tuple[Any, Any, Any]:
    """(model, calibration batches, a scorer of a compressed model)."""
    import torch

    if name == "smollm2":
        import bench_fidelity

        from toast.hf.evaluate.quality import Evaluator

        model, _, calib, _, test = bench_fidelity.data()

        def score(built: Any) -> float:
            return Evaluator(test, progress=False).measure(built.float().eval())

        return model.float().eval(), calib, score
    import toast.zoo
    from toast.data import natural_images

    images = natural_images(64, size=SIZE, seed=0)
    calib = [torch.from_numpy(images[k : k + 16]) for k in range(0, len(images), 16)]
    test = torch.from_numpy(natural_images(64, size=SIZE, seed=2))
    original = toast.zoo.dinov2_vits14().eval()

    def features(model: Any) -> Any:
        with torch.inference_mode():
            return torch.cat(
                [model(pixel_values=test[k : k + 16]).pooler_output for k in range(0, 64, 16)]
            )

    reference = features(original)

    def cosine(built: Any) -> float:
        got = features(built.float().eval())
        return float(torch.nn.functional.cosine_similarity(got, reference, dim=-1).mean())

    return toast.zoo.dinov2_vits14().eval(), calib, cosine


def plans(name: str, out: Path) -> None:
    """Both estimators' plans at every budget, from one analysis each."""
    import torch

    import toast
    from toast.hf.evaluate.check import CheckSplit

    torch.set_num_threads(1)
    model, calib, _ = _data(name)
    fit = CheckSplit(calib, 0.1).fit
    record: dict[str, Any] = {"model": name}
    for estimator in ("cv", "gcv"):
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            analysis = toast.analyze(model, fit, estimator=estimator, pairs=8, progress=False)
        record[f"{estimator}_analyze_s"] = time.perf_counter() - start
        record["rows"], record["width"] = analysis.rows, analysis.moments.dim
        record[estimator] = {
            b: [[s.start, s.stop] for s in analysis.plan(max_blocks=b)] for b in BUDGETS
        }
    out.write_text(json.dumps(record))


def compressed(name: str, estimator: str, out: Path) -> None:
    """``toast.compress(budget=4)`` with ``estimator``, scored on unseen data."""
    import torch

    import toast

    torch.set_num_threads(1)
    model, calib, score = _data(name)
    options = {} if estimator == "auto" else {"estimator": estimator}
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built, report = toast.compress(model, calib, budget=4, progress=False, **options)
    wall = time.perf_counter() - start
    out.write_text(
        json.dumps(
            {
                "model": name,
                "estimator": estimator,
                "resolved": report.analysis.estimator,
                "wall_s": wall,
                "spans": [[s.start, s.stop] for s in report.spans],
                "score": score(built),
            }
        )
    )


def _child(args: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        record = Path(scratch) / "record.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, __file__, *args, "--record", str(record)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(args)} failed:\n{done.stderr[-2000:]}")
        return json.loads(record.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--plans", help=argparse.SUPPRESS)
    parser.add_argument("--compress", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--record", help=argparse.SUPPRESS)
    parser.add_argument("--render", action="store_true", help="only rewrite estimator.md")
    args = parser.parse_args()
    if args.render:
        saved = ROOT / "benchmarks" / "results" / "estimator.json"
        saved.with_suffix(".md").write_text(_table(json.loads(saved.read_text())))
        return
    if args.plans:
        plans(args.plans, Path(args.record))
        return
    if args.compress:
        compressed(*args.compress, Path(args.record))
        return
    import _machine

    load = os.getloadavg()
    result: dict[str, Any] = {"plans": [], "compress": []}
    for name in args.models:
        result["plans"].append(_child(["--plans", name]))
        print(json.dumps(result["plans"][-1]), flush=True)
        for estimator in ("auto", "cv"):
            result["compress"].append(_child(["--compress", name, estimator]))
            print(json.dumps(result["compress"][-1]), flush=True)
    result["machine"] = _machine.machine(load)
    out = ROOT / "benchmarks" / "results" / "estimator.json"
    out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(_table(result))


def _table(result: dict) -> str:
    lines = [
        "# TOAST's estimator: 5-fold held-out errors against GCV (`bench_estimator.py`)",
        "",
        "Exact plans from one analysis per estimator (pairs up to 8 blocks apart), on the",
        "batches `toast.compress` analyses (its held-out check's batches kept out).",
        "",
        "| model | rows | width | budgets with the same plan | analysis cv | analysis gcv |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for p in result["plans"]:
        same = [b for b in BUDGETS if p["cv"][str(b)] == p["gcv"][str(b)]]
        differ = [b for b in BUDGETS if b not in same]
        said = f"{len(same)} of {len(BUDGETS)}" + (
            f" (differ at {', '.join(map(str, differ))})" if differ else ""
        )
        lines.append(
            f"| {p['model']} | {p['rows']:,} | {p['width']} | {said} | "
            f"{p['cv_analyze_s']:.1f} s | {p['gcv_analyze_s']:.1f} s |"
        )
    lines += [
        "",
        "`toast.compress(model, calib, budget=4)`, each run its own process, one thread:",
        "",
        "| model | estimator | resolved | spans | wall | score on unseen data |",
        "|---|---|---|---|---:|---:|",
    ]
    for c in result["compress"]:
        metric = "test perplexity" if c["model"] == "smollm2" else "CLS cosine"
        lines.append(
            f"| {c['model']} | {c['estimator']} | {c['resolved']} | {c['spans']} | "
            f"{c['wall_s']:.1f} s | {metric} {c['score']:.4f} |"
        )
    lines += [
        "",
        f"{_describe(result['machine'])} Another job held about one core during these runs.",
        "",
    ]
    return "\n".join(lines)


def _describe(machine: dict) -> str:
    import _machine

    return _machine.describe(machine)


if __name__ == "__main__":
    main()
