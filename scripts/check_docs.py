"""The figures the README and ``benchmarks/README.md`` quote, checked against
the results files the code writes.

Each quoted passage sits between ``<!-- NAME -->`` and ``<!-- /NAME -->``
lines and is rendered from one committed results file:

- ``demo``: ``benchmarks/results/demo.json`` (``toast demo``'s ``result.json``);
- ``costs``: ``benchmarks/results/first_contact.json``
  (``benchmarks/bench_first_contact.py``: both quick-start commands on fresh clones);
- ``demo-llm``: ``benchmarks/results/demo_llm.json`` (``toast demo --llm``'s);
- ``peers``: ``benchmarks/results/peers.json`` (``benchmarks/bench_peers.py``,
  with the retained accuracy of ``accuracy.json``);
- ``accuracy``: ``benchmarks/results/accuracy.json`` (``benchmarks/bench_accuracy.py``).

The test suite runs the check (``tests/test_check_docs.py``) and compares
what the ViT demo prints now with its results file (``tests/cli/test_demo.py``);
the LLM demo takes minutes, so CI reruns both with ``--rerun-demos``.

    python scripts/check_docs.py                # exit 1 naming every passage that differs
    python scripts/check_docs.py --write        # rewrite the passages from the results files
    python scripts/check_docs.py --run-demos    # run both demos, write their results, then --write
    python scripts/check_docs.py --rerun-demos  # run both demos; exit 1 where a figure moved
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Quote:
    """A passage ``name`` quoted in ``docs``, rendered from ``source``."""

    name: str
    source: str
    render: Callable[[Path, Any], str]
    docs: tuple[str, ...]


def _benchmark(module: str) -> Any:
    """A benchmark script of this checkout as a module (its table functions;
    the results and docs may come from another ``--root``)."""
    folder = str(ROOT / "benchmarks")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(module)


def _pct(before: float, after: float) -> str:
    return f"{100 * (after - before) / before:+.1f}%".replace("-", "−")


def _about(seconds: float) -> str:
    """A wall time as quoted: to 10 s (it varies run to run; never compared)."""
    return f"{max(10, round(seconds, -1)):.0f}"


def render_demo(root: Path, r: dict[str, Any]) -> str:
    """The ViT demo's figures in words."""
    spans = " and ".join(f"`[{a}:{b}]`" for a, b in r["spans"])
    n = len(r["spans"])
    count = "one affine translator" if n == 1 else f"{n} affine translators"
    acc, params, macs = r["accuracy"], r["params"], r["mmacs"]
    checks = "; ".join(
        f"{c['metric']} {c['fitted']:.4f} fitted against {c['plain']:.4f} removed, "
        f"on {c['count']} held-out images"
        for c in r["checks"]
    )
    held_out = f"held-out check run ({checks})" if checks else "no held-out check"
    speed = r["speedup"]
    return (
        f"Printed here: blocks {spans} replaced by {count}, test accuracy "
        f"{acc['original']:.3f} → **{acc['compressed']:.3f}** ({acc['dropped']:.3f} dropping "
        f"the same blocks); {held_out}; parameters {params['original']:,} → "
        f"{params['compressed']:,} ({_pct(params['original'], params['compressed'])}), MACs "
        f"{macs['original']:.2f} M → {macs['compressed']:.2f} M per image "
        f"({_pct(macs['original'], macs['compressed'])}); {speed['q1']:.2f}–{speed['q3']:.2f}× "
        f"faster on 500 images (the middle half of 15 rounds timed in turns with the original)."
    )


def _span(values: list[float], unit: str, scale: float = 1.0) -> str:
    """Recorded wall times as a range: seconds to 10 s, minutes to the minute."""
    digits = -1 if unit == "s" else 0
    low, high = round(min(values) / scale, digits), round(max(values) / scale, digits)
    return f"about {low:.0f} {unit}" if low == high else f"{low:.0f}–{high:.0f} {unit}"


def render_costs(root: Path, runs: list[dict[str, Any]]) -> str:
    """What the quick start's two commands cost, over every recorded fresh clone."""
    ok = [r for r in runs if all(v == 0 for v in r["status"].values())]
    demo = json.loads((root / "benchmarks" / "results" / "demo.json").read_text())["seconds"]
    tests = [r for r in ok if "test_sh" in r["seconds"]]
    said = (
        f"`demo.sh` {_span([r['seconds']['demo_sh'] for r in ok], 's')} with every install, "
        f"the demo alone {_span([r['seconds']['demo'] for r in ok], 's')} (training the ViT; "
        f"{_about(demo['total'] - demo['model'])} s with it cached)"
    )
    if tests:
        said += (
            f", `test.sh` {_span([r['seconds']['test_sh'] for r in tests], 'min', 60)} "
            f"({tests[-1]['tests'].split(' in ')[0]})"
        )
    cpus = ok[-1]["machine"]["cpus"]
    return (
        f"Measured from fresh clones on this {cpus}-core machine ({len(ok)} "
        f"run{'s' if len(ok) > 1 else ''}, `python benchmarks/bench_first_contact.py`): {said}."
    )


def render_demo_llm(root: Path, r: dict[str, Any]) -> str:
    """The LLM demo's figures in words."""
    spans = ", ".join(f"`blocks[{a}:{b}]`" for a, b in r["spans"])
    ppl = r["perplexity"]
    saved = (
        "a standard checkpoint (plain `transformers` loads it)"
        if r["standard_checkpoint"]
        else "a toast save: the transform kept as a linear block in place of the cut, "
        "which measured better than the fold (`toast.load_pretrained`, or `transformers` "
        "with `trust_remote_code=True`)"
    )
    return (
        f"Printed here: {spans} removed, held-out perplexity {ppl['original']:.2f} → "
        f"**{ppl['compressed']:.2f}** (plain removal {ppl['plain_removal']:.2f}), KL "
        f"{r['kl']:.3f}, top-1 agreement {100 * r['agreement']:.1f}%; parameters "
        f"{r['params']['original']:,} → {r['params']['compressed']:,}; `model/` is {saved}; "
        f"about {_about(r['seconds']['total'])} s on 2 cores (about "
        f"{_about(r['seconds']['load'])} s loading the GGUF)."
    )


def render_peers(root: Path, record: dict[str, Any]) -> str:
    bench = _benchmark("bench_peers")
    accuracy = root / "benchmarks" / "results" / "accuracy.json"
    kept = bench.retained_accuracy(accuracy) if accuracy.exists() else None
    return str(bench.summary(record, kept))


def render_accuracy(root: Path, record: dict[str, Any]) -> str:
    return str(_benchmark("bench_accuracy").summary(record))


QUOTES = (
    Quote(
        "demo", "benchmarks/results/demo.json", render_demo, ("README.md", "benchmarks/README.md")
    ),
    Quote(
        "costs",
        "benchmarks/results/first_contact.json",
        render_costs,
        ("README.md", "benchmarks/README.md"),
    ),
    Quote(
        "demo-llm",
        "benchmarks/results/demo_llm.json",
        render_demo_llm,
        ("README.md", "benchmarks/README.md"),
    ),
    Quote(
        "peers",
        "benchmarks/results/peers.json",
        render_peers,
        ("README.md", "benchmarks/README.md"),
    ),
    Quote(
        "accuracy", "benchmarks/results/accuracy.json", render_accuracy, ("benchmarks/README.md",)
    ),
)


def _markers(root: Path) -> Any:
    return _benchmark("_markers")


def _expected(root: Path, quote: Quote) -> str:
    return quote.render(root, json.loads((root / quote.source).read_text()))


def check(root: Path = ROOT) -> list[str]:
    """Every quoted passage that differs from its results file, in words."""
    markers, problems = _markers(root), []
    for quote in QUOTES:
        expected = _expected(root, quote)
        for doc in quote.docs:
            try:
                found = markers.block((root / doc).read_text(), quote.name, doc)
            except markers.MarkerError as exc:
                problems.append(str(exc))
                continue
            if found != expected:
                problems.append(
                    f"{doc}: the '{quote.name}' passage differs from {quote.source}"
                    f"\n  quoted:   {found[:400]}\n  expected: {expected[:400]}\n"
                    "  (run `python scripts/check_docs.py --write` after rerunning what "
                    "writes the results file)"
                )
    return problems


def write(root: Path = ROOT) -> None:
    """Rewrites every quoted passage from its results file."""
    markers = _markers(root)
    for quote in QUOTES:
        expected = _expected(root, quote)
        for doc in quote.docs:
            path = root / doc
            path.write_text(markers.replace_block(path.read_text(), quote.name, expected, doc))


def run_demos(root: Path = ROOT, keep: bool = True) -> list[str]:
    """Runs both demos as a first ``toast demo --no-progress`` does; with
    ``keep`` writes their ``result.json`` as the results files, else
    returns every figure (timings aside) that differs from those files."""
    from toast.cli.demo import run_demo
    from toast.cli.demo_llm import run_llm_demo

    moved: list[str] = []
    with tempfile.TemporaryDirectory() as folder:
        # a cache of its own: the ViT trained as on a first run, timed
        run_demo(out=Path(folder) / "demo", cache=Path(folder) / "cache", progress=False)
        run_llm_demo(out=Path(folder) / "llm", progress=False)
        for quote, name in zip(QUOTES[:2], ("demo", "llm"), strict=True):
            written = Path(folder) / name / "result.json"
            if keep:
                shutil.copyfile(written, root / quote.source)
            else:
                moved += differences(
                    json.loads((root / quote.source).read_text()),
                    json.loads(written.read_text()),
                    quote.source,
                )
    return moved


def differences(committed: dict[str, Any], now: dict[str, Any], source: str) -> list[str]:
    """Each figure of a demo's ``result.json`` that differs from the committed
    one, timings aside (they vary run to run and are never compared)."""
    skip = {"seconds", "latency_ms", "speedup"}
    keys = sorted((set(committed) | set(now)) - skip)
    return [
        f"{source}: {key} is {now.get(key)!r} now, {committed.get(key)!r} committed"
        for key in keys
        if committed.get(key) != now.get(key)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to check")
    parser.add_argument("--write", action="store_true", help="rewrite the quoted passages")
    parser.add_argument(
        "--run-demos", action="store_true", help="rerun both demos and write their results first"
    )
    parser.add_argument(
        "--rerun-demos",
        action="store_true",
        help="rerun both demos and fail where a figure differs from its results file",
    )
    args = parser.parse_args(argv)
    if args.rerun_demos:
        moved = run_demos(args.root, keep=False)
        for line in moved:
            print(line, file=sys.stderr)
        if moved:
            print("check_docs: the demos print other figures than their results files",
                  file=sys.stderr)  # fmt: skip
            return 1
        print("check_docs: both demos print the figures of their results files")
    if args.run_demos:
        run_demos(args.root)
    if args.write or args.run_demos:
        write(args.root)
    problems = check(args.root)
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(f"check_docs: {sum(len(q.docs) for q in QUOTES)} quoted passages match their results")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
