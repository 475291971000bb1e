"""Peak memory and time of one ``toast.search`` on SmolLM2-135M-Instruct
against its floor, the forward passes it must make.

The search is ``toast search $GGUF --data calib.txt --heldout held.txt
--target 0.2 --no-cache`` as the CLI runs it (batches of 8, 256 tokens,
8 candidates measured with throughput): calibration on the first
``--calibration-lines`` (400: 29,645 characters) English sentences of the
standard library's docstrings, held-out on the next ``--heldout-lines``
(150). It runs in a child process; this one polls the RssAnon of the child
and its children in ``/proc`` every 0.2 s, by phase (the child names its
phase in a file).

The floor, measured twice in the same child right after the search (the
mean): one forward pass over the
calibration batches, one over the held-out batches with the original, and
one over the held-out batches per measured candidate at its own size (the
original with as many blocks removed). Plain forwards in inference mode:
no hook, no statistic, no loss.

Usage: ``python benchmarks/bench_search_memory.py [--calibration-lines N]
[--heldout-lines N] [--max-measured N]``; writes
``benchmarks/results/search_memory.md`` (and ``.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _machine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
POLL_S = 0.2


def _texts(calibration_lines: int, heldout_lines: int, folder: Path) -> tuple[Path, Path]:
    from toast.data import stdlib_sentences

    sentences = stdlib_sentences(limit=None)
    calib, held = folder / "calib.txt", folder / "held.txt"
    calib.write_text("\n".join(sentences[:calibration_lines]) + "\n")
    end = calibration_lines + heldout_lines
    held.write_text("\n".join(sentences[calibration_lines:end]) + "\n")
    return calib, held


# --- the child: the search and its floor ------------------------------------


def _phase(folder: Path, name: str) -> None:
    (folder / "phase.tmp").write_text(name)
    os.replace(folder / "phase.tmp", folder / "phase")


def _forwards(model: Any, batches: Any) -> float:
    import torch

    start = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            model(**batch)
    return time.perf_counter() - start


def _smaller(model: Any, removed: int) -> Any:
    """The model with ``removed`` of its middle blocks left out, sharing
    its weights: a candidate's size for the floor's held-out pass."""
    from torch import nn

    from toast.frontier.build import shared_copy
    from toast.methods.base import find_layout

    layout = find_layout(model, None)
    copy, copied = shared_copy(model, layout)
    blocks = copied.stack.blocks
    start = (len(blocks) - removed) // 2
    kept = [b for i, b in enumerate(blocks) if not start <= i < start + removed]
    copy.model.layers = nn.ModuleList(kept)
    copy.config.num_hidden_layers = len(kept)
    for i, block in enumerate(kept):  # the KV cache indexes the blocks by position
        block.self_attn.layer_idx = i
    return copy


def _floor(model: Any, calib: Any, held: Any, removed: list[int]) -> dict[str, float]:
    floor = {"calibration": _forwards(model, calib), "original held-out": _forwards(model, held)}
    floor["candidates held-out"] = sum(_forwards(_smaller(model, r), held) for r in removed)
    floor["total"] = sum(floor.values())
    return floor


def child(folder: Path, calib_txt: Path, held_txt: Path, max_measured: int) -> None:
    import toast
    import toast.zoo
    from toast.hf.data.calibration import Calibration
    from toast.io.local import load_batches, load_model

    gguf = toast.zoo.smollm2_gguf()
    read = {"batch_size": 8, "max_length": 256}  # the CLI's defaults
    calib, held = load_batches(gguf, calib_txt, **read), load_batches(gguf, held_txt, **read)
    _phase(folder, "search")
    start = time.perf_counter()
    result = toast.search(
        Path(gguf),  # as the CLI passes it
        calib,
        held,
        target=0.2,
        max_measured=max_measured,
        cache=False,
        calibration=Calibration(max_samples=256, progress=False),
    )
    seconds = time.perf_counter() - start
    removed = [sum(b - a for a, b in m.candidate.spans) for m in result.measured]
    assert result.best is not None
    best = (result.best.candidate.label, result.best.measurement.quality)
    timings = dict(result.timings)
    del result  # the chosen model: the floor runs on the original alone
    said = {"search_s": seconds, "timings": timings, "chosen": best}
    (folder / "search.json").write_text(json.dumps(said))  # kept if the floor is cut short
    _phase(folder, "floor")
    model = load_model(gguf).eval()
    floors = [_floor(model, calib, held, removed) for _ in range(2)]
    out = {
        "search_s": seconds,
        "floors": floors,
        "measured": len(removed),
        "chosen": best,
        "load": list(os.getloadavg()),
        "timings": timings,
    }
    (folder / "child.json").write_text(json.dumps(out))


# --- the parent: RssAnon polled from outside -----------------------------------


def _tree(pid: int) -> list[int]:
    found = [pid]
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [q for c in f.read().split() for q in _tree(int(c))]
    except OSError:
        pass
    return found


def _rss_anon(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _poll(process: subprocess.Popen, folder: Path) -> dict[str, int]:
    peaks: dict[str, int] = {}
    while process.poll() is None:
        try:
            phase = (folder / "phase").read_text()
        except OSError:
            phase = "loading"
        used = sum(_rss_anon(p) for p in _tree(process.pid))
        if used > peaks.get(phase, 0):
            peaks[phase] = used
            (folder / "peaks.json").write_text(json.dumps(peaks))
        time.sleep(POLL_S)
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration-lines", type=int, default=400)
    parser.add_argument("--heldout-lines", type=int, default=150)
    parser.add_argument("--max-measured", type=int, default=8)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--rewrite", action="store_true", help="the report again from the JSON")
    args = parser.parse_args()
    if args.rewrite:
        _write(json.loads((RESULTS / "search_memory.json").read_text()))
        return
    if args.child:
        child(Path(args.child[0]), Path(args.child[1]), Path(args.child[2]), args.max_measured)
        return
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        calib, held = _texts(args.calibration_lines, args.heldout_lines, folder)
        command = [sys.executable, __file__, "--max-measured", str(args.max_measured)]
        process = subprocess.Popen([*command, "--child", str(folder), str(calib), str(held)])
        peaks = _poll(process, folder)
        if process.returncode:
            raise SystemExit(f"the search's process failed ({process.returncode})")
        found = json.loads((folder / "child.json").read_text())
        found["characters"] = len(calib.read_text())
    found.update(peaks=peaks, args=vars(args), machine=_machine.machine(load))
    # the measurements first: a report that fails to render loses nothing
    (RESULTS / "search_memory.json").write_text(json.dumps(found, indent=1))
    _write(found)


def _write(found: dict[str, Any]) -> None:
    floors = found["floors"]
    floor = sum(f["total"] for f in floors) / len(floors)
    ratio = found["search_s"] / floor
    peak = max(found["peaks"].values()) / 2**30
    search_peak = found["peaks"].get("search", 0) / 2**30
    args, timings = found["args"], found["timings"]
    latency = sum(v for k, v in timings.items() if k.endswith(": latency"))
    lines = [
        "# `toast.search` on SmolLM2-135M-Instruct: peak memory and time against its floor",
        "",
        f"`python benchmarks/bench_search_memory.py --calibration-lines "
        f"{args['calibration_lines']} --heldout-lines {args['heldout_lines']} --max-measured "
        f"{args['max_measured']}`: the search of `toast search $GGUF --data calib.txt --heldout "
        f"held.txt --target 0.2 --no-cache` ({found['characters']:,} characters of calibration "
        f"text), {found['measured']} candidates measured; chosen {found['chosen'][0]} "
        f"(held-out perplexity {found['chosen'][1]:.2f}).",
        "",
        "| quantity | value |",
        "|---|---:|",
        f"| peak RssAnon during the search (polled every {POLL_S} s) | {search_peak:.2f} GiB |",
        f"| peak RssAnon of the process (any phase) | {peak:.2f} GiB |",
        f"| search time | {found['search_s']:.0f} s |",
        *(
            f"| floor {name} (mean of {len(floors)}) | "
            f"{sum(f[name] for f in floors) / len(floors):.1f} s |"
            for name in ("calibration", "original held-out", "candidates held-out", "total")
        ),
        f"| search / floor | {ratio:.2f} |",
        "",
        f"Search phases (s): {_phases(timings)}",
        "",
        f"The paired latency rounds take {latency:.0f} s ({100 * latency / found['search_s']:.0f}% "
        f"of the search); the search less them is {(found['search_s'] - latency) / floor:.2f}× "
        "the floor.",
        "",
        _machine.describe(found["machine"]) + f" Load average at the end of the child: "
        f"{found['load'][0]:.2f}.",
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "search_memory.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "search_memory.json").write_text(json.dumps(found, indent=1) + "\n")
    print("\n".join(lines))


def _phases(timings: dict[str, float]) -> str:
    from toast.frontier.result import time_line

    return time_line(timings).removeprefix("Time (s): ")


if __name__ == "__main__":
    main()
