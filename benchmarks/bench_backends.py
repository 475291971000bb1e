"""Where ``backend="auto"`` should form the sums on the CPU: the C core
against :class:`toast.hf.capture.torch_moments.TorchMoments`, update alone.

Each shape gets four batches of 16 × 128 float32 rows per state with a
padding mask keeping ~80% of them (as a capture pass feeds them), float64
products, all pairs; the torch side includes its one conversion to
:class:`toast.Moments`. Both run in one process, in 5 interleaved rounds
after a warm-up (medians). Writes ``results/backends.{json,md}``.

    .venv/bin/python benchmarks/bench_backends.py      # ~1 min on 2 cores
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch
from _machine import describe, machine

import toast
from toast.hf.capture.torch_moments import TorchMoments

ROOT = Path(__file__).resolve().parent
SHAPES = [(13, 64), (13, 128), (7, 256), (7, 384), (13, 768), (2, 576)]
ROUNDS = 5


def one(S: int, d: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    batches = [[torch.randn(16, 128, d, generator=gen) for _ in range(S)] for _ in range(4)]
    mask = torch.rand(16, 128, generator=gen) < 0.8

    def core() -> None:
        m = toast.Moments(S, d)
        for b in batches:
            m.update(b, mask=mask)

    def with_torch() -> None:
        m = TorchMoments(S, d)
        for b in batches:
            m.update(b, mask=mask)
        m.to_moments()

    calls = {"c": core, "torch": with_torch}
    for call in calls.values():
        call()
    seconds: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(ROUNDS):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    return {"S": S, "d": d, **med, "torch_over_c": med["torch"] / med["c"]}


def main() -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    before = os.getloadavg()
    rows = [one(S, d) for S, d in SHAPES]
    m = machine(before)
    lines = [
        "# C core against TorchMoments on the CPU (update alone)",
        "",
        f"4 batches of 16 × 128 float32 rows per state, ~80% kept by a mask, float64, "
        f"median of {ROUNDS} interleaved rounds.",
        "",
        "| states × width | C s | torch s | torch / C |",
        "|---|---:|---:|---:|",
        *(
            f"| {r['S']} × {r['d']} | {r['c']:.3f} | {r['torch']:.3f} | {r['torch_over_c']:.2f} |"
            for r in rows
        ),
        "",
        describe(m),
    ]
    out = Path(ROOT / "results")
    (out / "backends.json").write_text(
        json.dumps({"rows": rows, "machine": m}, indent=1), encoding="utf-8"
    )
    (out / "backends.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
