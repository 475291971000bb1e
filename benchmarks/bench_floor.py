"""How far each toast run is from its forward floor: wall time against the
forward passes it makes, timed alone in the same run, with peak anonymous
memory polled from outside.

A depth prune's unavoidable cost is forward passes: the calibration pass
and the held-out passes it measures. Everything else (statistics, solves,
buffers, bookkeeping) is overhead. For each run on SmolLM2-135M-Instruct
(``bench_fidelity.py``'s data: 32 calibration sequences of 256 tokens, 16
held out for the search's selection) a ledger of forward hooks counts every
call of a block and of the head by input shape (global hooks: the copies a
run measures candidates on count too), keeping the first call's inputs of
each shape. After the run, an untouched copy of block 0 and of
the head replays each shape's inputs alone (median of 3); the floor is
the sum over shapes of calls x that time: the forwards the run made,
timed with nothing else. The same calls are also timed as the run makes
them (``in_run_s``, between global hooks): a change of the machine's
speed between the run and the replay moves the floor, not that. Blocks
are timed as block 0 (every block of a decoder costs the same);
translators and the statistics are overhead.

The result is measured in float32 on the test split (16 x 256 tokens
nobody selects on), whatever the run computed in: what bf16 forwards do
to the fit.

Runs: ``toast.compress`` with TOAST's default (``budget=n``), ReplaceMe's
and LinearPatch's defaults (``method=..., num_blocks=n``) and
``toast.search`` at ``n`` blocks' parameters, in each compute mode of
``--dtypes``:

- ``float32``: the model as loaded (float32), toast's default;
- ``bfloat16``: the model cast to bf16 (what a bf16 checkpoint loaded in
  memory computes in);
- ``autocast``: the float32 model with ``compute_dtype="bfloat16"`` (its
  forwards under bf16 autocast, its weights and the result float32);
- ``disk-float32`` / ``disk-bfloat16``: SmolLM2 saved as a bf16
  checkpoint and compressed block by block from the folder
  (``sequential=True``) with that ``compute_dtype`` (``"auto"`` picks one of
  the two by measurement: :func:`toast.hf.capture.compute.native_matmul`).
  No floor is replayed for these (the blocks load one at a time); the
  search is not run from disk here, and LinearPatch has no disk path.

toast keeps its statistics in float64 in every mode. Each run is its own
process, polled every 0.2 s for anonymous resident memory (the
interpreter, torch and the model included).

Usage::

    python benchmarks/bench_floor.py [--size 4] [--runs toast replaceme search] \\
        [--dtypes float32 bfloat16 autocast disk-float32 disk-bfloat16] [--threads 1]

Writes ``benchmarks/results/floor.md`` and ``floor.json``.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _peak import run_polled  # noqa: E402

RUNS = ("toast", "replaceme", "linearpatch", "search")
LABELS = {
    "toast": "toast.compress default (TOAST)",
    "replaceme": "toast.compress, method='replaceme'",
    "linearpatch": "toast.compress, method='linearpatch'",
    "search": "toast.search at the same parameters",
}


def _detached(value: Any) -> Any:
    """A copy of a forward's inputs that later calls cannot change (a cache
    object is dropped: replays never read one)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return None  # a cache or another object a block forward only passes along


class Ledger:
    """Counts the calls of every module ``counts(module)`` accepts (one
    kind: their costs are equal) by the shape of their first input: a
    global hook, so the copies a run builds (the search measures each
    candidate on a copy of the model) are counted as the model's own
    modules are. The first call's inputs of each shape are kept from
    ``modules``, the model's own (a hook that sees keyword arguments)."""

    def __init__(self, counts: Callable[[Any], bool], modules: list, kind: str) -> None:
        import torch

        self.kind, self.counts, self.calls, self.inputs = kind, counts, {}, {}
        #: seconds the counted calls took as the run made them (timed between
        #: global hooks, which run before a module's own: a capture pass
        #: ending at its last state stops after them)
        self.spent = 0.0
        self._started: dict[int, float] = {}
        hooks = torch.nn.modules.module
        self.handles = [
            hooks.register_module_forward_pre_hook(self._count),
            hooks.register_module_forward_hook(self._done),
        ]
        self.handles += [m.register_forward_pre_hook(self._keep, with_kwargs=True) for m in modules]

    def _count(self, module: Any, args: tuple) -> None:
        if self.counts(module) and args:
            shape = tuple(args[0].shape)
            self.calls[shape] = self.calls.get(shape, 0) + 1
            self._started[id(module)] = time.perf_counter()

    def _done(self, module: Any, args: tuple, output: Any) -> None:
        start = self._started.pop(id(module), None)
        if start is not None:
            self.spent += time.perf_counter() - start

    def _keep(self, module: Any, args: tuple, kwargs: dict) -> None:
        first = args[0] if args else kwargs.get("hidden_states")
        shape = tuple(first.shape)
        if shape not in self.inputs:
            self.inputs[shape] = (_detached(args), _detached(kwargs))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()

    def floor(self, module: Any, rounds: int = 3) -> tuple[float, int]:
        """Seconds ``module`` takes on every call counted, each shape's
        inputs replayed alone (median of ``rounds``), and the calls. A shape
        only a copy ran is priced at the replayed shapes' cost per row."""
        import torch

        timed = {}
        for shape, (args, kwargs) in self.inputs.items():
            kwargs = {k: v for k, v in kwargs.items() if not k.startswith("past_key_value")}
            times = []
            with torch.no_grad():
                for _ in range(rounds):
                    start = time.perf_counter()
                    module(*args, **kwargs)
                    times.append(time.perf_counter() - start)
            timed[shape] = statistics.median(times)
        rows = {shape: math.prod(shape[:-1]) for shape in self.calls}
        per_row = sum(timed.values()) / max(sum(math.prod(s[:-1]) for s in timed), 1)
        total = sum(
            count * timed.get(shape, per_row * rows[shape]) for shape, count in self.calls.items()
        )
        return total, sum(self.calls.values())


DTYPES = ("float32", "bfloat16", "autocast", "disk-float32", "disk-bfloat16")


def _run(
    name: str, model: Any, calib: Any, selection: Any, size: int, compute: str
) -> Callable[[], Any]:
    import toast

    options = {"progress": False, "compute_dtype": compute}
    if name == "toast":
        return lambda: toast.compress(model, calib, method="toast", budget=size, **options)
    if name in ("replaceme", "linearpatch"):
        return lambda: toast.compress(model, calib, method=name, num_blocks=size, **options)
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    target = size * block / toast.count_params(model) - 1e-6

    def search() -> Any:
        with tempfile.TemporaryDirectory() as cache:
            return toast.search(
                model, calib, selection, target=target, cache=cache, latency=False, **options
            )

    return search


def _from_disk(name: str, model: Any, calib: Any, size: int, compute: str) -> tuple[Any, float]:
    """``name`` from SmolLM2 saved as a bf16 checkpoint, block by block in
    ``compute``: the pruned model loaded in float32, and the wall time."""
    import torch

    import toast

    if name == "search":
        raise SystemExit("the search is not run from disk by this benchmark")
    key = "budget" if name == "toast" else "num_blocks"  # ReplaceMe's and LinearPatch's name
    with tempfile.TemporaryDirectory() as scratch:
        source, out = Path(scratch) / "source", Path(scratch) / "out"
        model.to(torch.bfloat16).save_pretrained(source)
        del model
        start = time.perf_counter()
        toast.compress(
            source, calib, output=out, method=name, sequential=True, progress=False,
            compute_dtype=compute, **{key: size},
        )  # fmt: skip
        wall = time.perf_counter() - start
        return toast.load_model(out).float().eval(), wall


def one(name: str, size: int, dtype: str, threads: int, out: Path) -> None:
    """One run in this process: its wall time, the forwards it made and
    their floor, written to ``out``."""
    import bench_fidelity
    import torch

    torch.set_num_threads(threads)
    model, _, calib, selection, test = bench_fidelity.data()
    from toast.hf.evaluate.quality import Evaluator

    record: dict[str, Any] = {"run": name, "dtype": dtype, "size": size, "threads": threads}
    if dtype.startswith("disk-"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            built, record["wall_s"] = _from_disk(name, model, calib, size, dtype[5:])
        record["test_perplexity"] = Evaluator(test, progress=False).measure(built)
        out.write_text(json.dumps(record))
        return
    compute = "bfloat16" if dtype == "autocast" else "auto"
    model = model.to(torch.bfloat16 if dtype == "bfloat16" else torch.float32).eval()
    block, head = copy.deepcopy(model.model.layers[0]), copy.deepcopy(model.lm_head)
    block_type, head_shape = type(model.model.layers[0]), tuple(model.lm_head.weight.shape)
    blocks = Ledger(lambda m: type(m) is block_type, list(model.model.layers), "block")
    heads = Ledger(
        lambda m: isinstance(m, torch.nn.Linear) and tuple(m.weight.shape) == head_shape,
        [model.lm_head],
        "head",
    )
    run = _run(name, model, calib, selection, size, compute)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = run()
    record["wall_s"] = time.perf_counter() - start
    blocks.close()
    heads.close()
    # the floor in the run's own compute mode
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "autocast")
    with autocast:
        block_s, block_calls = blocks.floor(block)
        head_s, head_calls = heads.floor(head)
    built = found.model if hasattr(found, "model") else found[0]
    # the result measured in float32 whatever it computed in: what the dtype did to the fit
    record["test_perplexity"] = Evaluator(test, progress=False).measure(built.float().eval())
    record.update(
        floor_s=block_s + head_s,
        block_floor_s=block_s,
        head_floor_s=head_s,
        block_calls=block_calls,
        head_calls=head_calls,
        block_shapes=len(blocks.calls),
        in_run_s=blocks.spent + heads.spent,
    )
    out.write_text(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=4, help="blocks removed (of 30)")
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=["float32"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of every row, interleaved (round 1 of every row, then round 2...); the "
        "table gives each row's medians and the range of its ratios",
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "floor.json"))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--record", help=argparse.SUPPRESS)
    parser.add_argument(
        "--note", default="", help="what the table should say about the run (its conditions)"
    )
    parser.add_argument("--render", action="store_true", help="only rewrite floor.md")
    args = parser.parse_args()
    if args.render:
        saved = json.loads(Path(args.out).read_text())
        saved["note"] = args.note or saved.get("note", "")
        Path(args.out).write_text(json.dumps(saved, indent=1))
        Path(args.out).with_suffix(".md").write_text(_table(saved))
        return
    if args.one:
        one(args.one, args.size, args.dtype, args.threads, Path(args.record))
        return
    import _machine

    load = os.getloadavg()
    rows = []
    for _, dtype, name in itertools.product(range(args.rounds), args.dtypes, args.runs):
        if name in ("search", "linearpatch") and dtype.startswith("disk-"):
            continue  # no disk path (LinearPatch), or not run from disk here (the search)
        with tempfile.TemporaryDirectory() as scratch:
            record = Path(scratch) / "record.json"
            cmd = [sys.executable, __file__, "--one", name, "--size", str(args.size)]
            cmd += ["--dtype", dtype, "--threads", str(args.threads), "--record", str(record)]
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
            polled = run_polled(cmd, env=env, log=Path(scratch) / "log")
            if polled.returncode != 0 or not record.exists():
                tail = (Path(scratch) / "log").read_text()[-2000:]
                raise SystemExit(f"{name} ({dtype}) failed ({polled.returncode}):\n{tail}")
            row = json.loads(record.read_text())
        row["peak_rss_anon_mib"] = round(polled.peak_mib)
        rows.append(row)
        print(json.dumps(row), flush=True)
    import torch

    from toast.hf.capture.compute import native_matmul

    torch.set_num_threads(args.threads)
    result = {
        "rows": _medians(rows) if args.rounds > 1 else rows,
        "rounds": args.rounds,
        "every_round": rows,
        "machine": _machine.machine(load),
        "bf16_native": native_matmul(torch.bfloat16),
        "threads": args.threads,
        "note": args.note,
    }
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(_table(result))


def _medians(rows: list[dict]) -> list[dict]:
    """One row per run and dtype: the medians of its rounds' times, the
    ratios' medians and ranges (each round's ratio against its own floor)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["run"], r["dtype"]), []).append(r)
    out = []
    for same in groups.values():
        row = dict(same[0])
        for key in ("wall_s", "floor_s", "block_floor_s", "head_floor_s", "in_run_s"):
            if key in row:
                row[key] = statistics.median(r[key] for r in same)
        row["peak_rss_anon_mib"] = max(r["peak_rss_anon_mib"] for r in same)
        for key, over in (("floor_ratios", "floor_s"), ("run_ratios", "in_run_s")):
            if over in row:
                row[key] = [r["wall_s"] / r[over] for r in same]
        row["test_perplexities"] = [r["test_perplexity"] for r in same]
        row["rounds"] = len(same)
        out.append(row)
    return out


def _ratio(r: dict, key: str, over: str) -> str:
    """``wall / over`` of a row: its rounds' median ratio and range, or the one ratio."""
    ratios = r.get(key)
    if not ratios:
        return f"{r['wall_s'] / r[over]:.2f}x"
    low, high = min(ratios), max(ratios)
    return f"{statistics.median(ratios):.2f}x ({low:.2f}–{high:.2f})"


def _table(result: dict) -> str:
    import _machine

    lines = [
        "# Wall time against the forward floor (`bench_floor.py`)",
        "",
        "SmolLM2-135M-Instruct (30 blocks), 32 calibration sequences of 256 tokens; the floor",
        "is every block and head call the run made, replayed alone (median of 3) after the run;",
        "*as run* is the same calls timed while the run made them (between hooks), which a",
        "change of this machine's speed between the run and the replay does not move.",
        "",
        "| run | dtype | blocks removed | wall | forward floor | wall / floor | forwards as run "
        "| wall / as run | block calls | head calls | peak RssAnon | test perplexity (float32) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        if "floor_s" in r:
            floor = f"{r['floor_s']:.1f} s | {_ratio(r, 'floor_ratios', 'floor_s')}"
            spent = r.get("in_run_s")
            ran = f"{spent:.1f} s | {_ratio(r, 'run_ratios', 'in_run_s')}" if spent else "— | —"
            floor += f" | {ran}"
            calls = f"{r['block_calls']:,} | {r['head_calls']:,}"
        else:
            floor, calls = "— | — | — | —", "— | —"
        lines.append(
            f"| {LABELS[r['run']]} | {r['dtype']} | {r['size']} | {r['wall_s']:.1f} s "
            f"| {floor} | {calls} | {r['peak_rss_anon_mib']:,} MiB | {r['test_perplexity']:.3f} |"
        )
    rounds = result.get("rounds", 1)
    if rounds > 1:
        lines += [
            "",
            f"{rounds} rounds, interleaved (every row once, then again): times are medians, "
            "each ratio the median of the rounds' ratios (each round against its own floor) "
            "with their range; peak memory the largest.",
        ]
    lines += ["", *_ratios(result["rows"])]
    native = result.get("bf16_native")
    if native is not None:
        lines += [
            "",
            f"bf16 matmuls {'native' if native else 'not native'} on this CPU "
            "(`toast.hf.capture.compute.native_matmul`); each run in its own process with "
            f"OMP_NUM_THREADS={result.get('threads', 1)} (the machine line below is the parent's).",
        ]
    lines += ["", _machine.describe(result["machine"]), ""]
    if result.get("note"):
        lines += [result["note"], ""]
    return "\n".join(lines)


def _ratios(rows: list[dict]) -> list[str]:
    """Each 16-bit mode against float32 of the same run: speed-up end to end
    and the relative change of test perplexity."""
    base = {r["run"]: r for r in rows if r["dtype"] == "float32"}
    disk = {r["run"]: r for r in rows if r["dtype"] == "disk-float32"}
    lines = []
    for r in rows:
        ref = (disk if r["dtype"] == "disk-bfloat16" else base).get(r["run"])
        if ref is None or r is ref or r["dtype"] in ("float32", "disk-float32"):
            continue
        change = r["test_perplexity"] / ref["test_perplexity"] - 1
        lines.append(
            f"- {LABELS[r['run']]}, {r['dtype']} against {ref['dtype']}: "
            f"{ref['wall_s'] / r['wall_s']:.2f}x faster end to end, test perplexity "
            f"{change:+.2%}."
        )
    return lines


if __name__ == "__main__":
    main()
