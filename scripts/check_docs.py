"""The figures the README and ``benchmarks/README.md`` quote, checked against
the results files the code writes.

Each quoted passage sits between ``<!-- NAME -->`` and ``<!-- /NAME -->``
lines and is rendered from one committed results file:

- ``demo``: ``benchmarks/results/demo.json`` (``toast demo``'s ``result.json``);
- ``costs``: ``benchmarks/results/first_contact.json``
  (``benchmarks/bench_first_contact.py``: both quick-start commands on fresh clones);
- ``demo-llm``: ``benchmarks/results/demo_llm.json`` (``toast demo --llm``'s);
- ``peers``: ``benchmarks/results/peers.json`` (``benchmarks/bench_peers.py``,
  with the retained accuracy of ``accuracy_wiki.json``);
- ``accuracy`` and ``accuracy-leads``: ``benchmarks/results/accuracy_wiki.json``
  (``benchmarks/bench_accuracy.py --join``: every method calibrated on Wikipedia
  paragraphs), its retained shares and each row's difference to the default;
- ``accuracy-docstrings``: ``benchmarks/results/accuracy.json`` (calibrated on
  Python's docstrings);
- ``highlights``: the README's bullet list of benchmark figures, each bullet
  from the results file of the script it names: ``real_vit.json``,
  ``fidelity.json``, ``search-patch-ridge.json`` (``bench_search.py``'s rerun
  with the ``patch_ridge`` plans), ``fits.json``, ``max_memory.json``,
  ``scale.json``, ``toast_vit.json`` and ``core.json`` (``make bench``).

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
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results"
DEMO = f"{RESULTS}/demo.json"
FIRST_CONTACT = f"{RESULTS}/first_contact.json"


@dataclass(frozen=True)
class Quote:
    """A passage ``name`` quoted in ``docs``, rendered from ``source`` (and
    from the results files ``also``, which ``render`` reads itself)."""

    name: str
    source: str
    render: Callable[[Path, Any], str]
    docs: tuple[str, ...]
    also: tuple[str, ...] = ()

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.source, *self.also)


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
    runs = [r["speedup"], *_recorded_speedups(root)]
    low, high = min(s["median"] for s in runs), max(s["median"] for s in runs)
    speed = f"about {low:.1f}×" if f"{low:.1f}" == f"{high:.1f}" else f"{low:.2f}–{high:.2f}×"
    return (
        f"Printed here: blocks {spans} replaced by {count}, test accuracy "
        f"{acc['original']:.3f} → **{acc['compressed']:.3f}** ({acc['dropped']:.3f} dropping "
        f"the same blocks); {held_out}; parameters {params['original']:,} → "
        f"{params['compressed']:,} ({_pct(params['original'], params['compressed'])}), MACs "
        f"{macs['original']:.2f} M → {macs['compressed']:.2f} M per image "
        f"({_pct(macs['original'], macs['compressed'])}); {speed} faster on 500 images (median "
        f"of 15 rounds timed in turns with the original; {len(runs)} runs)."
    )


def _recorded_speedups(root: Path) -> list[dict[str, float]]:
    """The demo's speed-ups in the fresh clones of ``first_contact.json``."""
    path = root / FIRST_CONTACT
    runs = json.loads(path.read_text()) if path.exists() else []
    return [demo["speedup"] for run in runs for demo in run.get("demos", [])]


def _span(values: list[float], unit: str, scale: float = 1.0) -> str:
    """Recorded wall times as a range: seconds to 10 s, minutes to the minute."""
    digits = -1 if unit == "s" else 0
    low, high = round(min(values) / scale, digits), round(max(values) / scale, digits)
    return f"about {low:.0f} {unit}" if low == high else f"{low:.0f}–{high:.0f} {unit}"


def render_costs(root: Path, runs: list[dict[str, Any]]) -> str:
    """What the quick start's two commands cost, over every recorded fresh clone."""
    ok = [r for r in runs if all(v == 0 for v in r["status"].values())]
    demo = json.loads((root / DEMO).read_text())["seconds"]
    tests = [r for r in ok if "test_sh" in r["seconds"]]
    said = (
        f"`demo.sh` {_span([r['seconds']['demo_sh'] for r in ok], 's')} with every install, "
        # the recorded runs trained the digits ViT; it ships trained since (toast.zoo)
        f"the demo alone {_span([r['seconds']['demo'] for r in ok], 's')} (training the ViT, "
        f"which now ships trained: about {_about(demo['total'])} s)"
    )
    if tests:
        last = re.match(r"(.*?)(?:, \d+ warnings?)? in ([\d.]+)s", tests[-1]["tests"])
        if last is None:
            raise ValueError(f"first_contact.json: no pytest summary in {tests[-1]['tests']!r}")
        said += (
            f", `test.sh` {_span([r['seconds']['test_sh'] for r in tests], 'min', 60)} with "
            f"the test extras' installs (the last run: pytest {float(last[2]) / 60:.1f} min, "
            f"{last[1]})"
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


#: The accuracy table: every method calibrated on Wikipedia paragraphs, the
#: papers' kind of text (``bench_accuracy.py --join``; benchmarks/README.md)
ACCURACY = "benchmarks/results/accuracy_wiki.json"


def render_peers(root: Path, record: dict[str, Any]) -> str:
    bench = _benchmark("bench_peers")
    accuracy = root / ACCURACY
    kept = bench.retained_accuracy(accuracy) if accuracy.exists() else None
    return str(bench.summary(record, kept))


def render_accuracy(root: Path, record: dict[str, Any]) -> str:
    return str(_benchmark("bench_accuracy").summary(record))


def render_leads(root: Path, record: dict[str, Any]) -> str:
    return str(_benchmark("bench_accuracy").leads(record))


# The README's bullet list of benchmark figures ("highlights"): one bullet a
# results file (two for the memory bullet), every figure read from it.

_HIGHLIGHTS = {
    name: f"{RESULTS}/{name}.json"
    for name in (
        "real_vit",
        "fidelity",
        "search-patch-ridge",
        "fits",
        "max_memory",
        "scale",
        "toast_vit",
        "core",
    )
}
_NAMES = {"toast": "TOAST", "replaceme": "ReplaceMe", "plain": "plain removal"}


def _result(root: Path, name: str) -> Any:
    return json.loads((root / _HIGHLIGHTS[name]).read_text())


def _find(rows: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """The first row with these fields."""
    for row in rows:
        if all(row.get(k) == v for k, v in fields.items()):
            return row
    raise ValueError(f"no row with {fields}")


def _budget(command: str) -> str:
    """The ``--max-memory`` of a command line, as ``8 GiB``."""
    found = re.search(r"--max-memory\s+([\d.]+)\s*([KMGT]i?B)", command)
    if found is None:
        raise ValueError(f"no --max-memory in {command!r}")
    return f"{found[1]} {found[2]}"


def _vit_bullet(r: dict[str, Any]) -> str:
    """``bench_real_vit.py``: the search's choice at the first target (from
    its family's row; the search row times the same model again), the speed-up
    at the largest batch, against the original and the other families."""
    rows = r["rows"]
    # one search per calibration seed: the first seed's
    search = next(x for x in rows if x["row"].startswith("search"))
    target, chosen = search["target"], search["setting"].split(": ", 1)[1]
    # a setting no row has (another schedule than the rows'): the search's own row
    row = next(
        (x for x in rows if x["target"] == target and f"{x['row']} {x['setting']}" == chosen),
        search,
    )
    original = _find(rows, row="original")
    spans, heads = (_find(rows, target=target, row=n) for n in ("TOAST spans", "ToaSt heads"))
    batch = max(row["speedup"], key=int)
    if row is search:
        what = f"{chosen} (`toast.search`'s choice)"
    else:
        method = "token merging" if row["row"] == "ToMe" else row["row"]
        what = f"{method} (`toast.search`'s choice, {row['setting'].replace('=', ' = ')})"
    return (
        f"the pretrained {r['model'].split(' (')[0]} with {target} fewer linear-layer MACs: "
        f"{what} keeps cosine "
        f"**{row['photos_cosine']:.4f}** to the original's CLS feature and a digits probe at "
        f"{row['digits_probe']:.3f} (original {original['digits_probe']:.3f}), "
        f"{row['speedup'][batch]:.2f}× faster at batch {batch}; "
        f"TOAST spans {spans['photos_cosine']:.3f}, "
        f"ToaSt heads {heads['photos_cosine']:.3f} (`bench_real_vit.py`)"
    )


def _fidelity_bullet(r: dict[str, Any]) -> str:
    """``bench_fidelity.py``: the test split; the cut is the perplexity search's."""
    test = r["test"]
    key = next(k for k in test if k.startswith("toast.search, perplexity: "))
    method, cut = key.split(": ", 2)[1:]
    form, span = cut.split(" ", 1)
    toast = test[key]
    replaceme = next(v for k, v in test.items() if k.startswith("ReplaceMe"))
    return (
        f"SmolLM2 at {100 * r['target']:.0f}% fewer parameters: {_NAMES.get(method, method)} "
        f"{form} `{span}` perplexity **{toast['perplexity']:.2f}** (KL {toast['kl']:.3f}) "
        f"against plain removal's {test['plain removal']['perplexity']:.2f} and ReplaceMe's own "
        f"cut {replaceme['perplexity']:.2f} (`bench_fidelity.py`)"
    )


def _search_bullet(r: dict[str, Any]) -> str:
    """``bench_search.py`` (its ``patch_ridge`` rerun): SmolLM2's held-out split."""
    run = next(x for x in r["results"] if x["model"].startswith("SmolLM2"))
    held = run["heldout"]
    by_hand = min(v for k, v in held.items() if k not in ("original", "search"))
    method, cut = run["chosen"].split(": ", 1)
    form, span = cut.split(" ", 1)
    return (
        f"`toast.search` at a {100 * r['target']:.0f}% parameter target on SmolLM2-135M: "
        f"held-out perplexity **{held['search']:.2f}** ({_NAMES.get(method, method)} `{form}` "
        f"`{span}`) against the original's {held['original']:.2f} and the best method by hand's "
        f"{by_hand:.2f}; Spearman correlation of predicted error with measured quality loss "
        f"{run['spearman']:+.2f} (`python benchmarks/bench_search.py "
        "--out benchmarks/results/search-patch-ridge.json`)"
    )


def _fits_bullet(r: dict[str, Any]) -> str:
    """``bench_fits.py``: the summary over the windows of the first row's width."""
    summary, (start, stop) = r["summary"], r["rows"][0]["span"]
    plain, paper = summary["default <= plain"], summary["default <= paper LS"]
    windows = summary["windows"]
    said = (
        f"≤ plain removal and ≤ the paper's LS on {plain} of {windows}"
        if plain == paper
        else f"≤ plain removal on {plain} and ≤ the paper's LS on {paper} of {windows}"
    )
    return (
        f"every {stop - start}-block window of SmolLM2: toast's default ReplaceMe fit is {said} "
        "windows (`python benchmarks/bench_fits.py`)"
    )


def _memory_bullet(m: dict[str, Any], s: dict[str, Any]) -> str:
    """``bench_max_memory.py`` and ``bench_scale.py``: peak RssAnon of each run."""
    params = re.search(r"Parameters: ([\d,]+)", "\n".join(m["log_tail"]))
    if params is None:
        raise ValueError("max_memory.json: no 'Parameters:' line in its log_tail")
    phases = [s["phases"][name] for name in ("search", "replaceme", "toast")]
    budgets = " / ".join(dict.fromkeys(_budget(p["command"]) for p in phases))
    peaks = " / ".join(f"{p['peak_rss_anon_mib'] / 1024:.1f}" for p in phases)
    return (
        "from disk within `--max-memory` (what toast allocates; the interpreter with torch "
        "comes on top), peak anonymous memory polled from outside: ReplaceMe on "
        f"a {int(params[1].replace(',', '')) / 1e9:.2f} B bf16 Llama at "
        f"`--max-memory {_budget(m['command'])}`, **{m['peak_rss_anon_mib']:,} MiB** in all on "
        f"{m['chars']:,} characters (`python benchmarks/bench_max_memory.py`); "
        "search, ReplaceMe and TOAST at "
        f"Llama-3-8B's width and depth under {budgets}, **{peaks} GiB** "
        "(`python benchmarks/bench_scale.py`; Llama-3 formulas in [large models]"
        "(docs/large-models.md#llama-3-at-scale-peak-memory-and-disk-by-formula))"
    )


def _toast_vit_bullet(r: dict[str, Any]) -> str:
    """``bench_toast_vit.py``: ToaSt as toast runs it, at the largest batch."""
    batch = max(r["batches"], key=int)
    ratio = r["batches"][batch]["rows"]["ToaSt (kept hidden)"]["ratio"]
    return (
        f"ToaSt on a DeiT-S shape: **{ratio:.2f}×** faster at batch {batch} "
        "(`python benchmarks/bench_toast_vit.py`)"
    )


def _core_bullet(r: dict[str, Any]) -> str:
    """``make bench`` (``bench_core.py``): the error matrix at the most rows."""
    run = max(r["results"], key=lambda x: x["rows"])
    e = run["error_matrix"]
    return (
        f"the core's all-pairs error matrix at {run['rows']:,} rows: "
        f"**{e['time_ratio_ref_over_ours']:.1f}×** faster than `torch.linalg.lstsq` per pair in "
        f"**{e['peak_ratio_ours_over_ref']:.3f}** of its memory (`make bench`)"
    )


def render_highlights(root: Path, vit: dict[str, Any]) -> str:
    """The README's bullet list of benchmark figures, one bullet a line."""
    bullets = [
        _vit_bullet(vit),
        _fidelity_bullet(_result(root, "fidelity")),
        _search_bullet(_result(root, "search-patch-ridge")),
        _fits_bullet(_result(root, "fits")),
        _memory_bullet(_result(root, "max_memory"), _result(root, "scale")),
        _toast_vit_bullet(_result(root, "toast_vit")),
        _core_bullet(_result(root, "core")),
    ]
    return ";\n".join(f"- {b}" for b in bullets) + "."


QUOTES = (
    Quote(
        "demo",
        DEMO,
        render_demo,
        ("README.md", "benchmarks/README.md"),
        also=(FIRST_CONTACT,),
    ),
    Quote(
        "costs",
        FIRST_CONTACT,
        render_costs,
        ("README.md", "benchmarks/README.md"),
        also=(DEMO,),
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
        also=(ACCURACY,),
    ),
    Quote("accuracy", ACCURACY, render_accuracy, ("benchmarks/README.md",)),
    Quote("accuracy-leads", ACCURACY, render_leads, ("benchmarks/README.md",)),
    Quote(
        "accuracy-docstrings",
        "benchmarks/results/accuracy.json",
        render_accuracy,
        ("benchmarks/README.md",),
    ),
    Quote(
        "highlights",
        _HIGHLIGHTS["real_vit"],
        render_highlights,
        ("README.md",),
        also=tuple(path for name, path in _HIGHLIGHTS.items() if name != "real_vit"),
    ),
)


def _markers(root: Path) -> Any:
    return _benchmark("_markers")


def _expected(root: Path, quote: Quote) -> str:
    return quote.render(root, json.loads((root / quote.source).read_text()))


def _first_difference(found: str, expected: str) -> tuple[str, str]:
    """The first line where a passage differs from what it should say."""
    for quoted, said in zip_longest(found.splitlines(), expected.splitlines(), fillvalue=""):
        if quoted != said:
            return quoted, said
    return found, expected


def _missing(root: Path, quote: Quote) -> list[str]:
    return [source for source in quote.sources if not (root / source).is_file()]


def check(root: Path = ROOT) -> list[str]:
    """Every quoted passage that differs from its results files, in words."""
    markers, problems = _markers(root), []
    for quote in QUOTES:
        missing = _missing(root, quote)
        if missing:
            problems.append(
                f"the '{quote.name}' passage ({', '.join(quote.docs)}) cannot be checked: "
                f"no results file {', '.join(missing)} (commit it, or rerun what writes it)"
            )
            continue
        expected = _expected(root, quote)
        for doc in quote.docs:
            try:
                found = markers.block((root / doc).read_text(), quote.name, doc)
            except markers.MarkerError as exc:
                problems.append(str(exc))
                continue
            if found != expected:
                quoted, said = _first_difference(found, expected)
                problems.append(
                    f"{doc}: the '{quote.name}' passage differs from "
                    f"{', '.join(quote.sources)}"
                    f"\n  quoted:   {quoted[:400]}\n  expected: {said[:400]}\n"
                    "  (run `python scripts/check_docs.py --write` after rerunning what "
                    "writes the results file)"
                )
    return problems


def write(root: Path = ROOT) -> None:
    """Rewrites every quoted passage from its results files (those whose
    results files are all there; ``check`` names the others)."""
    markers = _markers(root)
    for quote in QUOTES:
        if _missing(root, quote):
            continue
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
        sources = {quote.name: quote.source for quote in QUOTES}
        for name, folder_name in (("demo", "demo"), ("demo-llm", "llm")):
            source = sources[name]
            written = Path(folder) / folder_name / "result.json"
            if keep:
                shutil.copyfile(written, root / source)
            else:
                moved += differences(
                    json.loads((root / source).read_text()), json.loads(written.read_text()), source
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
