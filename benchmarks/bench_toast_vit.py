"""Latency of ToaSt (dense SCWP + TCS) on a DeiT-S-shaped ViT on this CPU.

Model: ``ViTForImageClassification`` with DeiT-S sizes (D = 384, 6 heads of
64, 12 blocks, MLP 1536, patch 16, 224 × 224, 1000 classes), random weights
(latency does not depend on them), float32, SDPA attention (HF's default),
``torch.inference_mode()``.

Variants (each a deep copy of the same original):

- ``original``;
- ``SCWP-90`` — dense head pruning at ρ = 0.9 (d_k' = 6 of 64, block 0
  kept): the paper's "MHSA only";
- ``ToaSt (paper exec.)`` — SCWP-90 + the Table 11 TCS schedule, per-image
  scope, dense, ``hidden="all"``: fc1 computes all 1536 hidden channels
  and FC2 then keeps 10-20% of them, as Algorithm 1 does (the MAC count
  2.528 G describes this execution);
- ``ToaSt (kept hidden)`` — the same function with ``hidden="kept"`` (the
  default of ``enable_tcs``): fc1 is evaluated on the scored tokens
  first and then only for the kept hidden channels, so fewer MACs run than
  the paper counts (the "executed GMACs" column);
- ``ToaSt per-batch`` — ``hidden="kept"``, ``scope="batch"`` (the reference
  code's selection; results depend on the batch).

Timing: ``torch.set_num_threads(THREADS)`` (2 by default); for each batch
size, warm-up passes, then ``reps`` rounds in which every variant runs once
(round-robin, so load changes on the shared machine hit all variants
alike); medians and the inter-quartile range are reported, with the load
average before and after. Latency ratio = median(original) / median(variant).

TCS overhead: a separate profiled pass with ``handle.profile = True`` sums
the time of the TCS selection (token sample, CLS attention row, channel
scores, top-k; in ``hidden="kept"`` mode also fc1 on the scored tokens) and
forward hooks time every transformer block; overhead = selection / (sum of
all block times), the paper's Table 25 definition.

Peak memory: every (variant, batch) runs in a fresh subprocess that builds
the model, resets the kernel's RSS high-water mark (``/proc/self/clear_refs``),
runs two forward passes and reports ``VmHWM − VmRSS`` before them (MiB): the
inference working set on top of the weights.

Usage: ``python benchmarks/bench_toast_vit.py [--reps1 30] [--reps32 7]
[--threads 2] [--out benchmarks/results/toast_vit.md]``; ``--quick`` for a
smoke run.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers

from toast.hf.model.vit import vit_blocks
from toast.methods.heads.macs import toast_macs
from toast.methods.heads.schedules import get_schedule, tcs_keep
from toast.methods.heads.scwp import prune_heads
from toast.methods.heads.tcs import enable_tcs

VARIANTS = ["original", "SCWP-90", "ToaSt (paper exec.)", "ToaSt (kept hidden)", "ToaSt per-batch"]
SCHEDULE = "table11"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def deit_small() -> torch.nn.Module:
    cfg = transformers.ViTConfig(
        hidden_size=384,
        num_hidden_layers=12,
        num_attention_heads=6,
        intermediate_size=1536,
        patch_size=16,
        image_size=224,
        num_labels=1000,
    )
    torch.manual_seed(0)
    return transformers.ViTForImageClassification(cfg).eval()


def make_variant(original: torch.nn.Module, name: str):
    model = copy.deepcopy(original)
    handle = None
    if name == "original":
        return model, None
    prune_heads(model, 0.9, form="dense")
    if name == "ToaSt (paper exec.)":
        handle = enable_tcs(model, SCHEDULE, hidden="all")
    elif name == "ToaSt (kept hidden)":
        handle = enable_tcs(model, SCHEDULE, hidden="kept")
    elif name == "ToaSt per-batch":
        handle = enable_tcs(model, SCHEDULE, hidden="kept", scope="batch")
    return model, handle


def executed_gmacs(cfg, name: str) -> float:
    """MACs that actually run (ToaSt convention, batch 1)."""
    if name == "original":
        return toast_macs(cfg, head_sparsity=0.0).gmacs
    if name == "SCWP-90":
        return toast_macs(cfg, head_sparsity=0.9).gmacs
    report = toast_macs(cfg, schedule=SCHEDULE)
    if name == "ToaSt (paper exec.)":
        return report.gmacs
    sched = get_schedule(SCHEDULE)
    n, d, f = 197, 384, 1536
    scored = tcs_keep(196, 1 - sched.sample_ratio) + 1  # sampled patches + CLS
    saved = 0.0
    for b, blk in enumerate(report.blocks):
        if sched.fc2[b] > 0:
            k1, k2 = tcs_keep(d, sched.fc1[b]), tcs_keep(f, sched.fc2[b])
            saved += blk.fc1 - (n * k1 * k2 + scored * k1 * f)
    return (report.macs - saved) / 1e9


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def memory_child(name: str, batch: int, threads: int) -> None:
    torch.set_num_threads(threads)
    model, _ = make_variant(deit_small(), name)
    x = torch.randn(batch, 3, 224, 224)
    with torch.inference_mode():
        model(pixel_values=x[:1])
    before = _rss_kib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        reset = True
    except OSError:
        reset = False
    with torch.inference_mode():
        for _ in range(2):
            model(pixel_values=x)
    peak = _rss_kib("VmHWM")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(
        json.dumps(
            {"peak_mib": (peak - before) / 1024, "reset": reset, "weights_mib": weights / 2**20}
        )
    )


def measure_memory(name: str, batch: int, threads: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--memory-child", name, str(batch), "--threads", str(threads)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def time_round_robin(models: dict, batch: int, reps: int, warmup: int) -> dict[str, list[float]]:
    x = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    times = {name: [] for name in models}
    with torch.inference_mode():
        for _ in range(warmup):
            for m in models.values():
                m(pixel_values=x)
        order = list(models)
        for r in range(reps):
            rotated = order[r % len(order) :] + order[: r % len(order)]
            for name in rotated:
                t0 = time.perf_counter()
                models[name](pixel_values=x)
                times[name].append(time.perf_counter() - t0)
    return times


def overhead(model, handle, batch: int, reps: int) -> dict:
    """Selection time / all-block time (Table 25's overhead)."""
    blocks = vit_blocks(model).blocks
    spent = {"blocks": 0.0}
    starts = []
    hooks = []
    for b in blocks:
        hooks.append(
            b.block.register_forward_pre_hook(lambda m, a: starts.append(time.perf_counter()))
        )
        hooks.append(
            b.block.register_forward_hook(
                lambda m, a, o: spent.__setitem__(
                    "blocks", spent["blocks"] + time.perf_counter() - starts.pop()
                )
            )
        )
    x = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(2))
    handle.profile = True
    with torch.inference_mode():
        model(pixel_values=x)
        handle.reset_timings()
        spent["blocks"] = 0.0
        for _ in range(reps):
            model(pixel_values=x)
    handle.profile = False
    for h in hooks:
        h.remove()
    t = handle.timings
    return {
        "selection_s": t["selection"] / reps,
        "tcs_blocks_s": t["block"] / reps,
        "all_blocks_s": spent["blocks"] / reps,
        "share_of_blocks": t["selection"] / spent["blocks"],
        "share_of_tcs_blocks": t["selection"] / t["block"],
    }


def _q(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4) if len(values) >= 2 else [values[0]] * 3
    return q[0], statistics.median(values), q[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps1", type=int, default=30)
    ap.add_argument("--reps32", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/toast_vit.md")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--memory-child", nargs=2, metavar=("VARIANT", "BATCH"))
    args = ap.parse_args()
    if args.memory_child:
        memory_child(args.memory_child[0], int(args.memory_child[1]), args.threads)
        return
    if args.quick:
        args.reps1, args.reps32 = 5, 2
    torch.set_num_threads(args.threads)
    original = deit_small()
    cfg = original.config
    models, handles = {}, {}
    for name in VARIANTS:
        models[name], handles[name] = make_variant(original, name)
    gm = {name: executed_gmacs(cfg, name) for name in VARIANTS}
    paper_gm = {
        "original": 4.599,
        "SCWP-90": toast_macs(cfg, head_sparsity=0.9).gmacs,
        **{n: toast_macs(cfg, schedule=SCHEDULE).gmacs for n in VARIANTS[2:]},
    }
    result = {
        "machine": {
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "threads": torch.get_num_threads(),
            "attn": cfg._attn_implementation,
        },
        "load_before": os.getloadavg(),
        "batches": {},
    }
    print(f"torch threads {torch.get_num_threads()}, load {os.getloadavg()}", flush=True)
    for batch, reps, warmup in ((1, args.reps1, 3), (32, args.reps32, 1)):
        t0 = time.time()
        load0 = os.getloadavg()
        times = time_round_robin(models, batch, reps, warmup)
        load1 = os.getloadavg()
        base = statistics.median(times["original"])
        rows = {}
        for name in VARIANTS:
            lo, med, hi = _q(times[name])
            rows[name] = {"median_s": med, "q1_s": lo, "q3_s": hi, "ratio": base / med}
        for name in VARIANTS[2:]:
            rows[name]["overhead"] = overhead(models[name], handles[name], batch, max(2, reps // 3))
        for name in VARIANTS:
            rows[name]["memory"] = measure_memory(name, batch, args.threads)
        result["batches"][batch] = {
            "reps": reps,
            "load": [load0, load1],
            "wall_s": time.time() - t0,
            "rows": rows,
        }
        print(json.dumps(result["batches"][batch], indent=1), flush=True)
    result["load_after"] = os.getloadavg()
    result["gmacs_paper"] = paper_gm
    result["gmacs_executed"] = gm
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.write_text(render(result))
    print(render(result))


def render(r: dict) -> str:
    m = r["machine"]
    lines = [
        "# ToaSt on a DeiT-S-shaped ViT (CPU latency)",
        "",
        f"Generated by `benchmarks/bench_toast_vit.py`. {m['cpu']}, {m['cores']} cores, torch "
        f"{m['torch']} with **{m['threads']} threads**, transformers {m['transformers']}, "
        f"attention `{m['attn']}`, float32, random weights, `inference_mode`. Load average "
        f"(1/5/15 min) before: {', '.join(f'{v:.2f}' for v in r['load_before'])}; after: "
        f"{', '.join(f'{v:.2f}' for v in r['load_after'])} — the 2 cores are shared with "
        "other work, so variants run round-robin and medians are reported.",
        "",
    ]
    base_gm = r["gmacs_paper"]["original"]
    for batch, b in r["batches"].items():
        load = f"load {b['load'][0][0]:.2f} → {b['load'][1][0]:.2f}"
        lines += [
            f"## Batch {batch} ({b['reps']} rounds; {load})",
            "",
            "| variant | GMACs (paper conv.) | MAC ratio | executed GMACs | median latency (ms) "
            "| IQR (ms) | latency ratio | TCS selection / block time | peak extra RSS (MiB) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, row in b["rows"].items():
            ov = row.get("overhead")
            share = "—" if ov is None else f"{100 * ov['share_of_blocks']:.1f}%"
            gm_p, gm_x = r["gmacs_paper"][name], r["gmacs_executed"][name]
            lines.append(
                f"| {name} | {gm_p:.3f} | {base_gm / gm_p:.2f}× | {gm_x:.3f} | "
                f"{1e3 * row['median_s']:.1f} | {1e3 * row['q1_s']:.1f}–{1e3 * row['q3_s']:.1f} | "
                f"**{row['ratio']:.2f}×** | {share} | {row['memory']['peak_mib']:.0f} |"
            )
        lines.append("")
        for name, row in b["rows"].items():
            ov = row.get("overhead")
            if ov:
                lines.append(
                    f"- {name}: selection {1e3 * ov['selection_s']:.2f} ms per pass = "
                    f"{100 * ov['share_of_blocks']:.1f}% of all 12 blocks "
                    f"({1e3 * ov['all_blocks_s']:.1f} ms), "
                    f"{100 * ov['share_of_tcs_blocks']:.1f}% of the 5 TCS blocks."
                )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
