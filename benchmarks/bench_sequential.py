"""Peak memory of ReplaceMe from a checkpoint on disk against the checkpoint's size.

Random-weight Llama checkpoints of about 0.5, 1.5 and 3 B parameters are
generated in bfloat16 into a temporary folder, shard by shard (each shard's
random tensors are made, written with safetensors and dropped, so the
generation never holds the model), then deleted at the end. For each size,
three phases run in FRESH Python processes, each reporting its peak RSS
(``VmHWM``, reset after importing torch, transformers and toast) above the
RSS it had then:

- ``sequential``: :func:`toast.methods.replaceme.from_disk.replaceme_from_disk`
  without output: the distance profile and the least-squares estimation,
  block by block from disk (cut: a quarter of the blocks);
- ``write``: writing the pruned checkpoint (kept blocks renumbered, T folded
  into the one down-projection) with the transform found by ``sequential``;
- ``in-memory`` (sizes up to ``--in-memory-up-to``): ``from_pretrained`` in
  bfloat16 and :func:`toast.methods.replaceme.replaceme` on the loaded model, for the wall time
  the sequential path is compared to.

Calibration is kept small (``--samples`` sequences of ``--tokens`` random
tokens, batches of 4): the machine this ran on has 2 cores.

Usage::

    .venv/bin/python benchmarks/bench_sequential.py                 # 0.5, 1.5, 3 B
    .venv/bin/python benchmarks/bench_sequential.py --sizes 0.5     # quick

Writes ``benchmarks/results/sequential.md`` and ``sequential.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 32000
#: name -> (hidden, intermediate, layers, heads, kv heads)
SIZES = {
    "0.5": (1280, 3584, 24, 20, 4),
    "1.5": (2048, 5632, 28, 16, 4),
    "3": (3072, 8192, 28, 24, 8),
}
SHARD_BYTES = 2**30


def _config(size: str):
    import transformers

    d, ffn, layers, heads, kv = SIZES[size]
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=d,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        dtype="bfloat16",
        architectures=["LlamaForCausalLM"],
    )


def generate(size: str, folder: Path) -> dict:
    """A random bfloat16 Llama checkpoint written shard by shard."""
    import torch
    import transformers
    from safetensors.torch import save_file

    config = _config(size)
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(config)
    shapes = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    groups: list[list[str]] = [[]]
    used = 0
    for key, shape in shapes.items():
        nbytes = 2 * _numel(shape)
        if groups[-1] and used + nbytes > SHARD_BYTES:
            groups.append([])
            used = 0
        groups[-1].append(key)
        used += nbytes
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    weight_map = {}
    for n, keys in enumerate(groups, 1):
        name = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        tensors = {k: _random(k, shapes[k], generator) for k in keys}
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        del tensors
        weight_map.update({k: name for k in keys})
    total = sum(2 * _numel(s) for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config.save_pretrained(folder)
    d, ffn, layers = SIZES[size][:3]
    block = sum(2 * _numel(s) for k, s in shapes.items() if k.startswith("model.layers.0."))
    return {
        "params": sum(_numel(s) for s in shapes.values()),
        "bytes": total,
        "block_bytes": block,
        "embedding_bytes": 2 * VOCAB * d,
        "down_numel": d * ffn,
        "hidden": d,
        "layers": layers,
    }


def _random(key: str, shape: tuple[int, ...], generator):
    import torch

    if key.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _data(samples: int, tokens: int):
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (samples, tokens), generator=g)
    return [
        {"input_ids": ids[i : i + 4], "attention_mask": torch.ones_like(ids[i : i + 4])}
        for i in range(0, samples, 4)
    ]


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> None:
    """Resets VmHWM to the current RSS (Linux ``clear_refs`` 5). ``ru_maxrss``
    cannot be used: it keeps the parent's high-water mark across fork/exec."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child(args: argparse.Namespace) -> None:
    """One phase in this fresh process; prints a JSON line."""
    import numpy as np
    import torch
    import transformers

    from toast.hf.capture.sequential import DiskModel
    from toast.methods.replaceme import replaceme
    from toast.methods.replaceme.disk import write_replaceme
    from toast.methods.replaceme.from_disk import replaceme_from_disk
    from toast.spans import Span

    torch.set_num_threads(2)
    data = _data(args.samples, args.tokens)
    baseline = _status_mib("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    folder = Path(args.folder)
    num_blocks = SIZES[args.size][2] // 4
    if args.phase == "sequential":
        report = replaceme_from_disk(folder, data, None, num_blocks=num_blocks, progress=False)
        span = report.spans[0]
        np.savez(args.state, start=span.start, stop=span.stop, t=report.transforms[0])
    elif args.phase == "write":
        saved = np.load(args.state)
        spans = [Span(int(saved["start"]), int(saved["stop"]), 0.0)]
        write_replaceme(DiskModel.open(folder), args.output, spans, [saved["t"]], progress=False)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        loaded = time.perf_counter() - start
        replaceme(model, data, num_blocks=num_blocks, progress=False)
    wall = time.perf_counter() - start
    peak = _status_mib("VmHWM")
    out = {"baseline_mib": baseline, "peak_above_mib": peak - baseline, "wall_s": wall}
    if args.phase == "in-memory":
        out["load_s"] = loaded
    print("RESULT " + json.dumps(out))


def _run_phase(phase: str, size: str, folder: Path, work: Path, args) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--phase", phase,
        "--size", size,
        "--folder", str(folder),
        "--state", str(work / f"{size}.npz"),
        "--output", str(work / f"pruned-{size}"),
        "--samples", str(args.samples),
        "--tokens", str(args.tokens),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{phase} {size} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f}"


def _table(rows: list[dict], args, load: list[float]) -> str:
    lines = [
        f"# ReplaceMe from disk: peak memory against checkpoint size ({platform.machine()}, "
        f"{os.cpu_count()} cores, load average at start "
        f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f})",
        "",
        f"Random bfloat16 Llama checkpoints; calibration {args.samples} x {args.tokens} "
        "random tokens (batches of 4; the machine has 2 cores); a quarter of the blocks cut; "
        "peak RSS above the process's RSS after imports.",
        "",
        "| params | checkpoint GiB | largest of block / embedding GiB | sequential calibration "
        "peak GiB | write peak GiB | sequential s | in-memory peak GiB | in-memory s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        mem = r.get("in-memory")
        lines.append(
            f"| {r['params'] / 1e9:.2f} B | {_gib(r['bytes'])} | "
            f"{_gib(max(r['block_bytes'], r['embedding_bytes']))} | "
            f"{r['sequential']['peak_above_mib'] / 1024:.2f} | "
            f"{r['write']['peak_above_mib'] / 1024:.2f} | {r['sequential']['wall_s']:.1f} | "
            + (
                f"{mem['peak_above_mib'] / 1024:.2f} | {mem['wall_s']:.1f} |"
                if mem
                else "not run | not run |"
            )
        )
    if len(rows) >= 3:  # two coefficients: fitted on fewer rows they mean nothing
        lines += ["", _extrapolation(rows)]
    for r in rows:
        if "repeat" in r:
            seq, mem = r["repeat"]["sequential"], r["repeat"]["in-memory"]
            med_seq, med_mem = statistics.median(seq), statistics.median(mem)
            lines += [
                "",
                f"{r['params'] / 1e9:.2f} B, calibration timed alternately "
                f"{len(seq)} times each: median sequential {med_seq:.1f} s, in-memory "
                f"{med_mem:.1f} s (load + calibrate), ratio {med_seq / med_mem:.2f} "
                f"(fastest: {min(seq):.1f} s / {min(mem):.1f} s = {min(seq) / min(mem):.2f}).",
            ]
    return "\n".join(lines) + "\n"


def _fit(columns: list[list[float]], ys: list[float]) -> list[float]:
    """Least-squares coefficients of ``y ≈ Σ c_i x_i`` (no intercept)."""
    import numpy as np

    return list(np.linalg.lstsq(np.array(columns).T, np.array(ys), rcond=None)[0])


def _extrapolation(rows: list[dict]) -> str:
    """Llama-3-70B by fits to the measurements. Calibration: the larger of
    block and embedding (the weights held) and 8 d² (ReplaceMe's float64
    d × d statistics and solve, which the in-memory path needs too). Write:
    the fold's working set, the down-projection twice in its dtype (read and
    result) plus T in float64, and a constant."""
    mib = 2**20
    held = [float(max(r["block_bytes"], r["embedding_bytes"])) for r in rows]
    square = [8.0 * r["hidden"] ** 2 for r in rows]
    calib = _fit([held, square], [r["sequential"]["peak_above_mib"] * mib for r in rows])
    working = [4.0 * r["down_numel"] + 8.0 * r["hidden"] ** 2 for r in rows]
    fold = _fit([[1.0] * len(rows), working], [r["write"]["peak_above_mib"] * mib for r in rows])
    d, ffn, vocab, kv = 8192, 28672, 128256, 1024
    block = 2 * (2 * d * d + 2 * d * kv + 3 * d * ffn + 2 * d)
    embedding = 2 * vocab * d
    calib_70b = calib[0] * max(block, embedding) + calib[1] * 8 * d * d
    write_70b = fold[0] + fold[1] * (4 * d * ffn + 8 * d * d)
    return (
        f"Llama-3-70B (80 blocks, width 8192, 140 GB in bfloat16) by the same formulas, "
        f"fitted to the rows above: calibration peak ≈ {calib[0]:.2f} x max(block, "
        f"embedding) + {calib[1]:.2f} x 8 d² = {calib[0]:.2f} x {_gib(max(block, embedding))} "
        f"GiB + {calib[1]:.2f} x {_gib(8 * d * d)} GiB = {_gib(calib_70b)} GiB (the "
        f"calibration states wait on disk: 2 x tokens x 8192 x 2 B); write peak ≈ "
        f"{_gib(fold[0])} GiB + {fold[1]:.2f} x (4 x 8192 x 28672 + 8 x 8192²) B = "
        f"{_gib(write_70b)} GiB."
    )


def _repeat(work: Path, args: argparse.Namespace, size: str, row: dict, folder: Path) -> None:
    """Sequential and in-memory calibration alternately ``--repeat`` times,
    so that other work on the machine weighs on both (medians reported)."""
    times: dict[str, list[float]] = {"sequential": [], "in-memory": []}
    for _ in range(args.repeat):
        for phase in times:
            times[phase].append(_run_phase(phase, size, folder, work, args)["wall_s"])
    row["repeat"] = times
    print(size, "repeat", times, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.5,1.5,3")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--in-memory-up-to", type=float, default=1.5)
    parser.add_argument("--workdir", default=None, help="where checkpoints are generated")
    parser.add_argument(
        "--repeat",
        type=int,
        default=0,
        help="then time sequential and in-memory calibration alternately this many times",
    )
    parser.add_argument("--from-json", help="only render the table of a results JSON")
    parser.add_argument("--phase", choices=["sequential", "write", "in-memory"])
    for name in ("size", "folder", "state", "output"):
        parser.add_argument(f"--{name}")
    args = parser.parse_args()
    if args.phase:
        child(args)
        return
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        print(_table(saved["rows"], argparse.Namespace(**saved["args"]), saved["load"]))
        return
    load = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="toast-bench-seq-", dir=args.workdir))
    rows = []
    try:
        for size in args.sizes.split(","):
            folder = work / f"llama-{size}"
            t0 = time.perf_counter()
            row = {"size": size, **generate(size, folder)}
            row["generate_s"] = time.perf_counter() - t0
            for phase in ("sequential", "write"):
                row[phase] = _run_phase(phase, size, folder, work, args)
                print(size, phase, row[phase], flush=True)
            if float(size) <= args.in_memory_up_to:
                row["in-memory"] = _run_phase("in-memory", size, folder, work, args)
                print(size, "in-memory", row["in-memory"], flush=True)
                if args.repeat:
                    _repeat(work, args, size, row, folder)
            rows.append(row)
            shutil.rmtree(folder)
            shutil.rmtree(work / f"pruned-{size}", ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = ROOT / "benchmarks" / "results"
    table = _table(rows, args, list(load))
    (results / "sequential.md").write_text(table)
    kept = {"samples": args.samples, "tokens": args.tokens, "repeat": args.repeat}
    saved = {"load": load, "args": kept, "rows": rows}
    (results / "sequential.json").write_text(json.dumps(saved, indent=2))
    print(table)


if __name__ == "__main__":
    main()
