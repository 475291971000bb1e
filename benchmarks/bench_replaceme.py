"""Peak memory of ReplaceMe calibration against the number of calibration samples.

ReplaceMe's least-squares transform needs only ``MᵀM`` and ``Mᵀ(L − Y)``
(d × d, float64), accumulated batch by batch, so the memory of LS
calibration should not grow with the calibration set; the cosine objective
keeps rows in a disk-backed buffer whose size is bounded by
``max_buffer_bytes``. This benchmark measures both.

Each measurement runs in a FRESH Python process (the peak RSS, ``ru_maxrss``,
is a high-water mark for the whole process): the process builds a random
Llama (d = 256, 6 blocks, FFN 704, vocabulary 2,000), warms up toast, torch
and the allocator with one small ReplaceMe run, records its RSS, then runs
``toast.methods.replaceme(model, loader, num_blocks=2, objective=...)`` over
``samples`` sequences of 128 random tokens (batches of 8, generated on the
fly from a seed on every pass, so the data itself is never held) and reports
the growth of the peak RSS over the recorded RSS. Holding the rows of the two
d-wide tensors the transform is fitted from (M and L − Y) in float32 would
take ``samples × 128 × 256 × 4 × 2`` bytes, printed for comparison.

Usage::

    .venv/bin/python benchmarks/bench_replaceme.py            # 100 and 1,600 samples
    .venv/bin/python benchmarks/bench_replaceme.py --sizes 200,3200

Writes ``benchmarks/results/replaceme.md`` and ``replaceme.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import textwrap
import time
from pathlib import Path

SEQ, DIM = 128, 256

_CHILD = textwrap.dedent(
    """
    import json, os, resource, sys, time
    import torch, transformers, toast

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    samples, objective, buffer = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    SEQ, DIM = 128, 256
    cfg = transformers.LlamaConfig(vocab_size=2000, hidden_size=DIM, intermediate_size=704,
                                   num_hidden_layers=6, num_attention_heads=8,
                                   num_key_value_heads=4, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()

    class Batches:
        # re-iterable: every pass regenerates the same batches from the seed
        def __init__(self, n):
            self.n = n
        def __iter__(self):
            gen = torch.Generator().manual_seed(1)
            for start in range(0, self.n, 8):
                size = min(8, self.n - start)
                ids = torch.randint(3, 2000, (size, SEQ), generator=gen)
                yield {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    options = {"objective": objective, "progress": False, "max_buffer_bytes": buffer,
               "epochs": 1}
    import copy
    warm = copy.deepcopy(model)
    toast.compress(warm, Batches(16), method="replaceme", num_blocks=2, **options)  # warm-up
    before = rss_mib()
    start = time.perf_counter()
    _, report = toast.compress(
        model, Batches(samples), method="replaceme", num_blocks=2, **options
    )
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"samples": samples, "objective": objective, "rows": report.rows,
                      "rows_kept": report.rows_kept, "buffer_bytes": report.buffer_bytes,
                      "before_mib": before, "peak_mib": peak, "growth_mib": peak - before,
                      "seconds": seconds, "cut": [report.spans[0].start, report.spans[0].stop]}))
    """
)


def measure(samples: int, objective: str, buffer: int) -> dict:
    """One ReplaceMe calibration in a fresh process; its peak RSS growth."""
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(samples), objective, str(buffer)],
        check=True,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def held_mib(samples: int) -> float:
    """MiB that holding M and L − Y of every row in float32 would take."""
    return samples * SEQ * DIM * 4 * 2 / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1600", help="calibration samples (100,1600)")
    parser.add_argument(
        "--buffer-mib", type=int, default=16, help="cosine buffer limit in MiB (16)"
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    buffer = args.buffer_mib * 2**20
    results = []
    for objective in ("ls", "cosine"):
        for samples in sizes:
            t = time.perf_counter()
            r = measure(samples, objective, buffer)
            r["held_mib"] = held_mib(samples)
            results.append(r)
            print(
                f"{objective:>6} {samples:>5} samples: {r['rows']:>7,} rows, peak RSS growth "
                f"{r['growth_mib']:.1f} MiB (holding the rows: {r['held_mib']:.0f} MiB), "
                f"{time.perf_counter() - t:.0f} s",
                flush=True,
            )
    machine = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch_threads": int(os.environ.get("BENCH_THREADS", "1")),
    }
    lines = [
        "# ReplaceMe calibration memory",
        "",
        "Measured with `python benchmarks/bench_replaceme.py` (each row a fresh process; see "
        "the script's docstring). Random Llama, d = 256, 6 blocks, 2 removed; sequences of "
        f"{SEQ} tokens in batches of 8; cosine buffer limit {args.buffer_mib} MiB, 1 epoch.",
        f"Machine: {machine['platform']}, {machine['cpus']} CPUs, Python {machine['python']}, "
        f"{machine['torch_threads']} torch thread(s).",
        "",
        "| objective | samples | token rows | rows kept | peak RSS growth MiB | "
        "holding M and L − Y would take MiB | cosine buffer | s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        cosine = r["objective"] == "cosine"
        kept = f"{r['rows_kept']:,}" if cosine else "—"
        buf = f"{r['buffer_bytes'] / 2**20:.1f} MiB" if cosine else "—"
        lines.append(
            f"| {r['objective']} | {r['samples']:,} | {r['rows']:,} | {kept} | "
            f"{r['growth_mib']:.1f} | {r['held_mib']:.0f} | {buf} | {r['seconds']:.1f} |"
        )
    ls = [r for r in results if r["objective"] == "ls"]
    lines += [
        "",
        f"LS: {ls[-1]['samples'] // ls[0]['samples']}x the samples changes the peak RSS growth "
        f"by {ls[-1]['growth_mib'] - ls[0]['growth_mib']:+.1f} MiB, where holding the rows "
        f"would add {ls[-1]['held_mib'] - ls[0]['held_mib']:.0f} MiB.",
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "replaceme.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out / "replaceme.json").write_text(
        json.dumps({"machine": machine, "results": results}, indent=2) + "\n", encoding="utf-8"
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
