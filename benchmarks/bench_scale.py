"""Llama-3-8B's width and depth from disk within ``--max-memory 8GiB`` (issue 30).

A random-weight Llama with Llama-3-8B's width and depth (hidden 4,096, 32
blocks, 32 heads, 8 KV heads) and a narrow MLP (``--ffn``, 1,024 by default,
so that a CPU forward stays affordable), bfloat16, SmolLM2's tokenizer and
vocabulary, is generated shard by shard into ``--work`` once (kept for
reruns; :func:`bench_max_memory.generate`). Its 4 GiB would fit the
budget, so ``--path disk`` makes each phase take the block-by-block path
that Llama-3-8B's 16 GB would take. Each phase is then one CLI command, as
a user would type it, in its own process::

    toast compress CKPT --method replaceme --num-blocks 8 ... --max-memory 8GiB --path disk
    toast compress CKPT --method toast --budget 2 ... --max-memory 8GiB
    toast search CKPT --heldout 0.1 --target params=5% --max-blocks 2 ... --max-memory 8GiB

while :func:`_peak.run_polled` polls the anonymous resident memory of the
process and its children and a thread polls the disk: the used bytes of the
file system of the phase's ``TMPDIR`` (``statvfs``; the activation and row
buffers are unlinked files, which ``du`` cannot see) above their level at
the start, less what the output folder holds (its writing is not a buffer).
Other work writing to the same file system would show in that figure: the
load and the free space are recorded.

The calibration is small so that 2 cores finish: ``--samples`` packed
sequences of ``--max-length`` tokens per compress phase, ``--samples``
lines (one text each) for the search, which reads a text a line; TOAST's
and the search's error estimates need more token rows than the width,
4,096 (about 8,000 here).

Usage::

    .venv/bin/python benchmarks/bench_scale.py                        # every phase
    .venv/bin/python benchmarks/bench_scale.py --phases replaceme     # one

Writes ``benchmarks/results/scale.md`` and ``scale.json`` (phases measured
before are kept when a run measures others).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _machine import describe, machine  # noqa: E402
from _peak import run_polled  # noqa: E402
from bench_max_memory import generate, write_text  # noqa: E402

#: hidden, intermediate (narrow), layers, heads, kv heads: Llama-3-8B's but the MLP
WIDTH, LAYERS, HEADS, KV_HEADS = 4096, 32, 32, 8
SHARDS = 8
RESULTS = ROOT / "benchmarks" / "results"

#: Each phase's command after ``toast`` and the checkpoint, without data and output.
PHASES = {
    "replaceme": ["compress", "--method", "replaceme", "--num-blocks", "8"],
    "toast": ["compress", "--method", "toast", "--budget", "2"],
    "search": [
        "search",
        "--heldout",
        "0.1",
        "--target",
        "params=5%",
        "--max-blocks",
        "2",
        "--max-measured",
        "2",
        "--no-cache",
        "--no-latency",
    ],  # fmt: skip
}


class DiskPoller:
    """Peak disk a phase uses, polled every ``interval`` s in two ways:
    ``buffers``, the files open under ``folder`` (the phase's ``TMPDIR``)
    in any process, unlinked ones included (``/proc/*/fd``: ``du`` cannot
    see a file with no name), and named files under it; ``filesystem``,
    the used bytes of ``folder``'s file system above the start
    (``statvfs``) less what ``exclude`` (the output folder) holds, which
    also counts whatever else writes to that file system meanwhile."""

    def __init__(self, folder: Path, exclude: Path, interval: float = 0.5) -> None:
        self.folder, self.exclude, self.interval = folder, exclude, interval
        self.start = self._used()
        self.buffers = self.filesystem = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _used(self) -> int:
        st = os.statvfs(self.folder)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def _open_under(self) -> int:
        prefix, seen, total = f"{self.folder}/", set(), 0
        for fds in Path("/proc").glob("[0-9]*/fd"):
            try:
                entries = os.listdir(fds)
            except OSError:
                continue
            for fd in entries:
                try:
                    if not os.readlink(fds / fd).startswith(prefix):
                        continue
                    st = os.stat(fds / fd)
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
        return total + _allocated(self.folder)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.buffers = max(self.buffers, self._open_under())
            fs = self._used() - self.start - _allocated(self.exclude)
            self.filesystem = max(self.filesystem, fs)
            self._stop.wait(self.interval)

    def __enter__(self) -> DiskPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _allocated(folder: Path) -> int:
    """Bytes allocated to the named files under ``folder``."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                continue
    return total


#: Lines of the CLI's log worth keeping: timings, buffers, the path chosen, results.
_KEEP = re.compile(
    r"sequential path|buffer|peak memory|took|\ds$|\d s$|\d s[,;)]|error matrix|plan|"
    r"removed|spans?|chosen|candidate|wrote|statistics|estimator|GiB|keeping|Parameters|"
    r"warning|\| \[|stopped|replaced|\*\*",
    re.IGNORECASE,
)


def _log_lines(log: Path) -> list[str]:
    """The CLI's log without progress-bar redraws, lines kept by :data:`_KEEP`."""
    text = log.read_text(errors="replace").replace("\r", "\n")
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    kept = [x for x in lines if _KEEP.search(x) and "ETA" not in x]
    return kept[-40:]


def _tokens(log: Path) -> int:
    """Calibration tokens, as the activation buffer's line says (0 if absent)."""
    found = re.search(r"\(([\d,]+) tokens x", log.read_text(errors="replace"))
    return int(found.group(1).replace(",", "")) if found else 0


def run_phase(phase: str, ckpt: Path, calib: Path, work: Path, args) -> dict:
    """One phase's CLI command under the memory and disk pollers."""
    out = work / f"out-{phase}"
    shutil.rmtree(out, ignore_errors=True)
    tmp = work / f"tmp-{phase}"  # one per phase: phases may run at once
    tmp.mkdir(exist_ok=True)
    toast_cli = str(Path(sys.executable).with_name("toast"))
    sub, *options = PHASES[phase]
    cmd = [toast_cli, sub, str(ckpt), *options, "--data", str(calib), "--out", str(out)]
    cmd += ["--max-memory", args.max_memory, "--max-length", str(args.max_length)]
    cmd += ["--pack"] if sub == "compress" else []  # toast search reads a text a line
    cmd += ["--max-samples", str(args.samples[phase]), "--path", args.path]
    cmd += args.extra.get(phase, [])
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": str(args.threads)}
    log = work / f"{phase}.log"
    load = os.getloadavg()
    with DiskPoller(tmp, out) as disk:
        polled = run_polled(cmd, log=log, env=env, timeout=args.timeout)
    free = shutil.disk_usage(tmp).free
    return {
        "command": " ".join(["toast", *cmd[1:]]),
        "returncode": polled.returncode,
        "wall_s": round(polled.wall_s, 1),
        "peak_rss_anon_mib": round(polled.peak_mib),
        "peak_buffers_mib": round(disk.buffers / 2**20),
        "peak_filesystem_mib": round(disk.filesystem / 2**20),
        "output_mib": round(sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 2**20)
        if out.exists()
        else 0,
        "disk_free_gib": round(free / 2**30, 1),
        "load_before": load,
        "load_after": os.getloadavg(),
        "log": _log_lines(log),
        "tokens": _tokens(log),
        "timeline": [
            (round(t, 1), round(m))
            for t, m in polled.timeline[:: max(1, len(polled.timeline) // 200)]
        ],
    }


#: Shapes the formulas are evaluated for: hidden, MLP, blocks, KV width, vocabulary.
LLAMA3 = {
    "Llama-3-8B": (4096, 14336, 32, 1024, 128256),
    "Llama-3-70B": (8192, 28672, 80, 1024, 128256),
}
#: The interpreter, torch and transformers (toast.hf.capture.budget.SEQUENTIAL_ALLOWANCE).
BASE_BYTES = 512 << 20


def estimate(
    shape: tuple[int, ...],
    tokens: int,
    phase: str,
    statistics: int | None = None,
    batch: tuple[int, int] = (8, 128),
) -> dict:
    """Peak memory and buffer disk of ``phase`` on the sequential path, by
    formula, for ``shape`` = (hidden d, MLP, blocks L, KV width, vocabulary
    V), ``tokens`` calibration tokens T and batches of ``batch`` (rows,
    tokens), with the planner's own parts (a bound, not a fit):

    - memory = 0.5 GiB (the interpreter and libraries, 0.28 GiB measured,
      with room) + one float32 block + one batch's forward
      (:func:`toast.hf.capture.budget.forward_bytes`) + the parts outside
      the blocks and the statistics: ReplaceMe (4 candidate cuts at once)
      its 4 transforms kept (8 d² each) + the larger of the head with its
      logits and the pass's statistics (4 × 2 × 8 d² + a solve's 4 × 8 d²);
      TOAST the head + its ``statistics_bytes`` (``auto``: 1 GiB, or one
      pair's errors when wider) + 256 MiB of rows a replay joins; the
      search the head + 2 × its shared bound + 256 MiB, the bound being
      half of what 8 GiB leaves (``toast.frontier.source.plan_statistics``);
    - disk = the activation buffer 2 × T d × 4, and ReplaceMe's L_start and
      M of its 4 cuts (8 × T d × 4) or, for TOAST and the search, every
      state's rows once, (L + 1) × T d × 4: the block-by-block pass writes
      each state straight into the bounded moments' row buffer.
    """
    from types import SimpleNamespace

    from toast.core.chunked import JOIN_BYTES, pair_nbytes, resolve_bound
    from toast.hf.capture.budget import forward_bytes, logit_rows

    d, ffn, layers, kv, vocab = shape
    heads = d // 128
    config = SimpleNamespace(
        hidden_size=d, intermediate_size=ffn, num_attention_heads=heads,
        num_key_value_heads=kv // 128,
    )  # fmt: skip
    block = 4 * (2 * d * d + 2 * d * kv + 3 * d * ffn + 2 * d)
    forward = forward_bytes(config, *batch)
    rows, length = batch
    logits = 3 * logit_rows(rows, length, vocab) * length * vocab * 4
    outside = 4 * vocab * d + logits
    row = tokens * d * 4
    if phase == "replaceme":
        kept, stats = 4 * 8 * d * d, 4 * 2 * 8 * d * d + 4 * 8 * d * d
        memory = block + forward + kept + max(outside, stats)
        disk = 10 * row
    else:
        if phase == "toast":
            # a bound below one pair's needs is refused: the auto bound is the least
            stats = max(statistics or 0, resolve_bound("auto", d, 0)) + JOIN_BYTES
        else:
            room = (8 << 30) - block - forward - outside - JOIN_BYTES
            stats = 2 * max(room // 2, pair_nbytes(d, 0)) + JOIN_BYTES
        memory = block + forward + outside + stats
        disk = (layers + 3) * row
    return {"memory": BASE_BYTES + memory, "disk": disk, "held": block, "statistics": stats}


def _phase_args(text: str) -> dict[str, list[str]]:
    """``phase:--opt value,...;phase:...`` as {phase: [options]}."""
    found: dict[str, list[str]] = {}
    for part in filter(None, text.split(";")):
        phase, _, options = part.partition(":")
        found[phase.strip()] = options.split()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="/tmp/toast-bench-scale")
    parser.add_argument("--phases", default="replaceme,toast,search")
    parser.add_argument("--ffn", type=int, default=1024, help="MLP width (narrow)")
    parser.add_argument("--chars", type=int, default=40_000, help="calibration text")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument(
        "--samples",
        default="replaceme=16,toast=64,search=480",
        help="--max-samples per phase: packed sequences (compress), lines (search)",
    )
    parser.add_argument("--max-memory", default="8GiB")
    parser.add_argument(
        "--path",
        default="disk",
        choices=("auto", "disk"),
        help="disk: block by block as Llama-3-8B (16 GB) would be under 8 GiB; this "
        "narrow-MLP checkpoint alone would fit in memory",
    )
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the phases")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per phase")
    parser.add_argument(
        "--extra", default="", help="more options per phase: 'toast:--estimator cv;search:...'"
    )
    parser.add_argument("--render", action="store_true", help="only rewrite scale.md")
    args = parser.parse_args()
    if args.render:
        saved = json.loads((RESULTS / "scale.json").read_text())
        (RESULTS / "scale.md").write_text(_markdown(saved))
        return
    args.samples = {k: int(v) for k, v in (p.split("=") for p in args.samples.split(","))}
    args.extra = _phase_args(args.extra)
    work = Path(args.work)
    ckpt = work / f"llama-w{WIDTH}-ffn{args.ffn}"
    shape = (WIDTH, args.ffn, LAYERS, HEADS, KV_HEADS)
    if not ckpt.exists():
        start = time.perf_counter()
        info = generate(ckpt, shape, SHARDS)
        print(f"generated {info} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    calib = work / f"calib-{args.chars}.txt"
    if not calib.exists():
        write_text(calib, args.chars)
    load = os.getloadavg()
    for phase in filter(None, args.phases.split(",")):
        result = run_phase(phase, ckpt, calib, work, args)
        print(phase, {k: v for k, v in result.items() if k not in ("timeline", "log")}, flush=True)
        _save(phase, result, ckpt, shape, args, load)


def _save(phase: str, result: dict, ckpt: Path, shape: tuple[int, ...], args, load) -> None:
    """Adds ``phase`` to the results, read again now: another run may have
    added its phases meanwhile."""
    saved_path = RESULTS / "scale.json"
    saved = json.loads(saved_path.read_text()) if saved_path.exists() else {"phases": {}}
    saved["phases"][phase] = {**result, "samples": args.samples[phase]}
    saved.update(
        checkpoint=_checkpoint(ckpt, shape),
        settings={"max_length": args.max_length, "samples": args.samples, "chars": args.chars},
        machine=machine(load),
    )
    saved_path.write_text(json.dumps(saved, indent=1))
    (RESULTS / "scale.md").write_text(_markdown(saved))


def _checkpoint(ckpt: Path, shape: tuple[int, ...]) -> dict:
    config = json.loads((ckpt / "config.json").read_text())
    return {
        "shape": dict(zip(("hidden", "ffn", "layers", "heads", "kv_heads"), shape, strict=True)),
        "vocab": config["vocab_size"],
        "bytes": sum(f.stat().st_size for f in ckpt.glob("*.safetensors")),
        "shards": len(list(ckpt.glob("*.safetensors"))),
    }


def _markdown(r: dict) -> str:
    c, s = r["checkpoint"], r["settings"]
    lines = [
        "# Llama-3-8B's width and depth from disk within 8 GiB (`bench_scale.py`)",
        "",
        f"Random bf16 Llama, hidden {c['shape']['hidden']:,}, {c['shape']['layers']} blocks, "
        f"{c['shape']['heads']} heads, {c['shape']['kv_heads']} KV heads, MLP "
        f"{c['shape']['ffn']:,} (narrow), vocabulary {c['vocab']:,}: "
        f"{c['bytes'] / 2**30:.2f} GiB in {c['shards']} shards. Calibration: up to "
        f"{s['max_length']} tokens a sequence (`--max-samples` below: packed sequences for "
        "compress, lines for the search). "
        "Peak RssAnon of the process and its children polled from outside every 0.2 s; "
        "peak buffers: the files open under the phase's TMPDIR (unlinked ones too, from "
        "/proc/*/fd); file system peak: used bytes above the start less the output, which "
        "counts other writers too.",
        "",
        "| phase | samples | tokens | exit | wall | peak RssAnon | peak buffers "
        "| file system peak | output | load before / after |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in r["phases"].items():
        lines.append(
            f"| {name} | {p['samples']} | {p['tokens']:,} | {p['returncode']} | "
            f"{p['wall_s']:.0f} s | "
            f"{p['peak_rss_anon_mib']:,} MiB | {p['peak_buffers_mib']:,} MiB | "
            f"{p['peak_filesystem_mib']:,} MiB | "
            f"{p['output_mib']:,} MiB | {p['load_before'][0]:.1f} / {p['load_after'][0]:.1f} |"
        )
    lines += ["", describe(r["machine"]), "", *_formula_table(r)]
    for name, p in r["phases"].items():
        lines += [f"## {name}", "", f"`{p['command']}`", "", "```", *p["log"], "```", ""]
        lines += [p["note"], ""] if p.get("note") else []
    return "\n".join(lines)


def _formula_table(r: dict) -> list[str]:
    """The formulas of :func:`estimate` against the measured peaks, then
    evaluated for Llama-3-8B and 70B at this run's token counts."""
    from toast.hf.capture.budget import parse_size

    c = r["checkpoint"]["shape"]
    ours = (c["hidden"], c["ffn"], c["layers"], c["hidden"] * c["kv_heads"] // c["heads"])
    ours += (r["checkpoint"]["vocab"],)
    lines = [
        "## Formula against measured",
        "",
        "Sequential path (`estimate` in this script, the planner's parts): memory = 0.5 GiB "
        "+ one float32 block + one batch's forward (8 × 128 tokens) + ReplaceMe: 4 transforms "
        "(8 d² each) + max(head with logits, 12 × 8 d² of statistics); TOAST: head + "
        "`statistics_bytes` + 256 MiB; the search: head + 2 × its bound + 256 MiB, the bound "
        "half of what 8 GiB leaves. Buffers = ReplaceMe 10 T d × 4 B, TOAST and the search "
        "(2 L + 4) T d × 4 B (T tokens, L blocks: the states' rows wait twice).",
        "",
        "| model | phase | tokens | memory formula | measured RssAnon | buffers formula "
        "| measured buffers |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, p in r["phases"].items():
        given = re.search(r"--statistics-bytes (\S+)", p["command"])
        stats = parse_size(given.group(1)) if given else None
        e = estimate(ours, p["tokens"], name, stats)
        lines.append(
            f"| this checkpoint | {name} | {p['tokens']:,} | {e['memory'] / 2**30:.2f} GiB | "
            f"{p['peak_rss_anon_mib'] / 1024:.2f} GiB | {e['disk'] / 2**30:.2f} GiB | "
            f"{p.get('peak_buffers_mib', 0) / 1024:.2f} GiB |"
        )
        for model, shape in LLAMA3.items():
            e = estimate(shape, p["tokens"], name, stats)
            lines.append(
                f"| {model} | {name} | {p['tokens']:,} | {e['memory'] / 2**30:.2f} GiB | — | "
                f"{e['disk'] / 2**30:.2f} GiB | — |"
            )
    return [*lines, ""]


if __name__ == "__main__":
    main()
