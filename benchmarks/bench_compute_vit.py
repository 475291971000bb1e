"""What bf16 forwards do to TOAST's fit on a real ViT: DINOv2 ViT-S/14
compressed in float32, with its forwards under bf16 autocast, and cast to
bf16, side by side.

``toast.compress(model, calib, budget=n)`` (TOAST's default) on
``toast.zoo.dinov2_vits14`` (float32, 224 x 224: 256 patches and CLS) with
``--calibration`` crops of scikit-image's photographs (seed 0) in three
modes: ``float32`` (the default), ``autocast`` (``compute_dtype="bfloat16"``:
the float32 model's forwards under bf16 autocast) and ``bfloat16`` (the
model cast to bf16). Each result is then scored in float32 on ``--photos``
other crops (seed 2) that no run sees: the mean cosine of its CLS feature
(``pooler_output``) to the original's, and the spans it chose. Each run is
its own process with one thread, interleaved over ``--rounds`` rounds (the
median wall time is reported).

Usage::

    .venv/bin/python benchmarks/bench_compute_vit.py     # ~5 min here

Writes ``benchmarks/results/compute_vit.md`` and ``compute_vit.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

MODES = ("float32", "autocast", "bfloat16")
SIZE = 224


def one(mode: str, budget: int, calibration: int, photos: int, out: Path) -> None:
    """One compression in this process, scored against the original."""
    import torch

    import toast
    import toast.zoo
    from toast.data import natural_images

    torch.set_num_threads(1)
    original = toast.zoo.dinov2_vits14().eval()
    model = toast.zoo.dinov2_vits14().eval()
    if mode == "bfloat16":
        model = model.to(torch.bfloat16)
    images = natural_images(calibration, size=SIZE, seed=0)
    calib = [torch.from_numpy(images[k : k + 16]) for k in range(0, len(images), 16)]
    if mode == "bfloat16":
        calib = [b.to(torch.bfloat16) for b in calib]
    compute = "bfloat16" if mode == "autocast" else "auto"
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built, report = toast.compress(
            model, calib, budget=budget, progress=False, compute_dtype=compute
        )
    wall = time.perf_counter() - start
    test = torch.from_numpy(natural_images(photos, size=SIZE, seed=2))
    built = built.float().eval()
    with torch.inference_mode():
        a = torch.cat(
            [original(pixel_values=test[k : k + 16]).pooler_output for k in range(0, len(test), 16)]
        )
        b = torch.cat(
            [built(pixel_values=test[k : k + 16]).pooler_output for k in range(0, len(test), 16)]
        )
    cosine = float(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean())
    spans = [[s.start, s.stop] for s in report.spans]
    out.write_text(json.dumps({"mode": mode, "wall_s": wall, "cosine": cosine, "spans": spans}))


def _features(model, images):
    """The CLS features (``pooler_output``) of ``images``, 16 at a time."""
    import torch

    with torch.inference_mode():
        parts = [
            model(pixel_values=images[k : k + 16]).pooler_output for k in range(0, len(images), 16)
        ]
    return torch.cat(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=int, default=2)
    parser.add_argument("--calibration", type=int, default=64)
    parser.add_argument("--photos", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--record", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compute_vit.json"))
    args = parser.parse_args()
    if args.one:
        one(args.one, args.budget, args.calibration, args.photos, Path(args.record))
        return
    import _machine

    load = os.getloadavg()
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            with tempfile.TemporaryDirectory() as scratch:
                record = Path(scratch) / "record.json"
                cmd = [sys.executable, __file__, "--one", mode, "--record", str(record)]
                cmd += ["--budget", str(args.budget), "--calibration", str(args.calibration)]
                cmd += ["--photos", str(args.photos)]
                env = {**os.environ, "OMP_NUM_THREADS": "1"}
                done = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if done.returncode != 0:
                    raise SystemExit(f"{mode} failed:\n{done.stderr[-2000:]}")
                runs[mode].append(json.loads(record.read_text()))
                print(json.dumps(runs[mode][-1]), flush=True)
    rows = []
    for mode in MODES:
        first = runs[mode][0]
        rows.append(
            {
                "mode": mode,
                "wall_s": statistics.median(r["wall_s"] for r in runs[mode]),
                "cosine": first["cosine"],
                "spans": first["spans"],
                "same_every_round": all(r["spans"] == first["spans"] for r in runs[mode]),
            }
        )
    settings = {k: getattr(args, k) for k in ("budget", "calibration", "photos", "rounds")}
    result = {"rows": rows, "settings": settings, "machine": _machine.machine(load)}
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(_table(result))


def _table(result: dict) -> str:
    import _machine

    s = result["settings"]
    base = result["rows"][0]
    lines = [
        "# bf16 forwards and TOAST's fit on DINOv2 ViT-S/14 (`bench_compute_vit.py`)",
        "",
        f"`toast.compress(model, calib, budget={s['budget']})` on {s['calibration']} crops of "
        f"scikit-image's photographs; the result scored in float32 on {s['photos']} other "
        f"crops: the mean cosine of its CLS feature to the original's. Median wall time of "
        f"{s['rounds']} interleaved rounds, one thread, each run its own process.",
        "",
        "| compute | wall | speed-up | spans | CLS cosine to the original |",
        "|---|---:|---:|---|---:|",
    ]
    for r in result["rows"]:
        spans = ", ".join(f"[{a}:{b}]" for a, b in r["spans"])
        lines.append(
            f"| {r['mode']} | {r['wall_s']:.1f} s | {base['wall_s'] / r['wall_s']:.2f}x "
            f"| {spans} | {r['cosine']:.4f} |"
        )
    lines += ["", _machine.describe(result["machine"]), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
