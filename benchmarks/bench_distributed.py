"""Several processes against one: `toast.compress` on SmolLM2 under
`torchrun` with 2 gloo ranks (one thread each) beside one process with
one thread and with two, side by side.

Each run is its own process tree on ``bench_fidelity.py``'s data (32
calibration sequences of 256 tokens): TOAST's default (``budget=4``) and
ReplaceMe's (``method="replaceme", num_blocks=4``). The wall time is the
compression's alone (the model loaded before the clock starts; ranks meet
at a barrier first); the model each run returns is kept, and the largest
relative difference of any weight from the one-process, one-thread run's
is reported, with peak anonymous memory of the whole tree, polled from
outside. Rounds are interleaved; medians reported.

Usage::

    .venv/bin/python benchmarks/bench_distributed.py [--rounds 2]

Writes ``benchmarks/results/distributed.md`` and ``distributed.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _peak import run_polled  # noqa: E402

RUNS = {
    "toast": {"budget": 4},
    "replaceme": {"method": "replaceme", "num_blocks": 4},
}
#: (label, processes, threads per process)
SETUPS = (
    ("1 process, 1 thread", 1, 1),
    ("1 process, 2 threads", 1, 2),
    ("2 ranks x 1 thread", 2, 1),
)


def worker(name: str, threads: int, out: Path) -> None:
    """One run in this process (a rank when torchrun started it)."""
    import bench_fidelity
    import torch
    import torch.distributed as dist

    import toast

    torch.set_num_threads(threads)
    ranked = "RANK" in os.environ
    if ranked:
        dist.init_process_group("gloo")
    model, _, calib, _, _ = bench_fidelity.data()
    model = model.float().eval()
    if ranked:
        dist.barrier()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built, _ = toast.compress(model, calib, progress=False, **RUNS[name])
    wall = time.perf_counter() - start
    rank = dist.get_rank() if ranked else 0
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in built.state_dict().items()}, out)
        out.with_suffix(".json").write_text(json.dumps({"wall_s": wall}))
    if ranked:
        dist.barrier()
        dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(name: str, processes: int, threads: int, out: Path) -> dict[str, Any]:
    here = [__file__, "--worker", name, "--threads", str(threads), "--out", str(out)]
    if processes == 1:
        cmd = [sys.executable, *here]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
               str(processes), "--master-addr", "127.0.0.1", "--master-port",
               str(_port()), *here]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "GLOO_SOCKET_IFNAME": "lo"}
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    polled = run_polled(cmd, env=env, log=out.with_suffix(".log"))
    if polled.returncode != 0:
        raise SystemExit(
            f"{name} {processes}x{threads} failed:\n{out.with_suffix('.log').read_text()[-3000:]}"
        )
    record = json.loads(out.with_suffix(".json").read_text())
    record["peak_rss_anon_mib"] = round(polled.peak_mib)
    return record


def _difference(a: Path, b: Path) -> float:
    import torch

    x, y = torch.load(a), torch.load(b)
    if sorted(x) != sorted(y):
        return float("inf")
    worst = 0.0
    for k, v in x.items():
        v, w = v.double(), y[k].double()
        scale = float(v.abs().max()) or 1.0
        worst = max(worst, float((v - w).abs().max()) / scale)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--render", action="store_true", help="only rewrite distributed.md")
    args = parser.parse_args()
    if args.render:
        saved = ROOT / "benchmarks" / "results" / "distributed.json"
        saved.with_suffix(".md").write_text(_table(json.loads(saved.read_text())))
        return
    if args.worker:
        worker(args.worker, args.threads, Path(args.out))
        return
    import _machine

    load = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.runs:
            walls: dict[str, list[float]] = {label: [] for label, _, _ in SETUPS}
            peaks: dict[str, int] = {}
            files: dict[str, Path] = {}
            for round_ in range(args.rounds):
                for label, processes, threads in SETUPS:
                    out = Path(scratch) / f"{name}-{processes}x{threads}-{round_}.pt"
                    record = _run(name, processes, threads, out)
                    walls[label].append(record["wall_s"])
                    peaks[label] = max(peaks.get(label, 0), record["peak_rss_anon_mib"])
                    files[label] = out
                    print(name, label, f"{record['wall_s']:.1f} s", flush=True)
            base = statistics.median(walls[SETUPS[0][0]])
            for label, processes, threads in SETUPS:
                wall = statistics.median(walls[label])
                rows.append({
                    "run": name, "setup": label, "processes": processes, "threads": threads,
                    "wall_s": wall, "walls_s": walls[label], "speedup": base / wall,
                    "peak_rss_anon_mib": peaks[label],
                    "max_rel_difference": _difference(files[SETUPS[0][0]], files[label]),
                })  # fmt: skip
    result = {"rows": rows, "rounds": args.rounds, "machine": _machine.machine(load)}
    out = ROOT / "benchmarks" / "results" / "distributed.json"
    out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(_table(result))


def _table(result: dict) -> str:
    import _machine

    lines = [
        "# Several processes against one (`bench_distributed.py`)",
        "",
        "SmolLM2-135M-Instruct, 32 calibration sequences of 256 tokens; wall time of the",
        f"compression alone, median of {result['rounds']} interleaved round(s); weights against",
        "the one-process, one-thread run's (largest difference over a tensor's largest value).",
        "",
        "| run | setup | wall | speed-up | peak RssAnon (all processes) | weights vs one process |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['run']} | {r['setup']} | {r['wall_s']:.1f} s | {r['speedup']:.2f}x | "
            f"{r['peak_rss_anon_mib']:,} MiB | {r['max_rel_difference']:.1e} |"
        )
    lines += ["", _machine.describe(result["machine"]), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
