"""toast against the strongest training-free depth pruning, side by side on
a real LLM: SmolLM2-135M-Instruct (30 blocks) with 2, 4, 6 and 8 blocks
removed.

Rows, each peer as published (facts from the papers; settings noted where
these cores force a smaller calibration):

- UIDL (Gromov et al., arXiv 2403.17887): the window of smallest angular
  distance on the last token, removed (no healing);
- ShortGPT (arXiv 2403.03853): the blocks of lowest Block Influence
  ``1 − cos(x_in, x_out)``, removed (any blocks, not a window);
- SLEB (arXiv 2402.09025): greedily the block whose removal hurts
  calibration perplexity least, removed, one at a time;
- ReplaceMe (arXiv 2505.02819), LS and cosine with the paper's protocol
  (:meth:`toast.methods.replaceme.ReplaceMeConfig.paper`);
- LinearPatch (arXiv 2505.24680): the most similar window (cosine) and
  ``H diag(d) Hᵀ`` in its place;
- Ghosted Layers (arXiv 2605.15491): LLM-Streamline's window (highest mean
  token cosine between its input and output) replaced by ``h ↦ h W``,
  ``W = I + (XᵀX + εI)⁻¹ Xᵀ(Y − X)``, ε = 1e-6, float64
  (:meth:`toast.methods.translate.config.ToastConfig.ghosted`);
- Prune&Comp (arXiv 2507.18212): iteratively the block of lowest Block
  Influence removed and the magnitude gap it leaves folded into weights as
  a scalar (:func:`toast.methods.prunecomp.prune_and_comp`);

then toast's defaults (``toast.compress(model, data, budget=n)``, TOAST;
``toast.replaceme(model, data, num_blocks=n)``), toast's Hadamard-basis
fits (``translator="patch_ridge"``; LinearPatch's form fitted by least
squares at ReplaceMe's default cut and folded, ``structure="rotated_diagonal"``,
and least squares shrunk towards it, ``"patch_ridge"``)
and ``toast.search``'s choice at the
parameter count of toast's default (``n`` blocks removed, its translator
added: compared at equal size). Columns: perplexity, mean KL to
the original per token and top-1 agreement on a test split nobody selects
on, parameters, and forward tokens/s relative to the original (one batch
of 4 × 256 tokens, 3 interleaved rounds, median). ReplaceMe's default and
the search are also measured on the search's selection split, where the
search measured its own ReplaceMe cuts, and so is toast's default (the
split the search chooses on).

Data as ``bench_fidelity.py``: stdlib docstring sentences packed into
sequences of 256 tokens, 32 to calibrate (every method, the papers use 128
× 2,048), 16 held out for the search's selection, 16 to test. SLEB
measures its 212 candidate removals (up to 8 of 30 blocks) on the first
4 calibration sequences only.

Usage: ``python benchmarks/bench_peers.py [--sizes 2 4 6 8] [--rows ...]
[--out benchmarks/results/peers.json]``; a row that fails is recorded
with its error and the run goes on. Results are written after every row.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _machine  # noqa: E402
import bench_fidelity  # noqa: E402
from _markers import replace_block  # noqa: E402

import toast  # noqa: E402
import toast.zoo  # noqa: E402
from toast.hf.data.calibration import Calibration  # noqa: E402
from toast.hf.evaluate.quality import Evaluator  # noqa: E402
from toast.methods.prunecomp import prune_and_comp  # noqa: E402
from toast.methods.replaceme import ReplaceMeConfig  # noqa: E402
from toast.methods.translate.config import ToastConfig  # noqa: E402

SIZES = (2, 4, 6, 8)
SIZES_ASKED: list[int] = list(SIZES)
SLEB_BATCHES = 1  # of 4 sequences
_COLUMNS = (
    ("perplexity", "perplexity ↓", ".2f"),
    ("kl", "KL ↓", ".4f"),
    ("agreement", "top-1 ↑", ".4f"),
)


def _data() -> tuple[Any, Any, Any, Any]:
    """The model and bench_fidelity.py's calibration, selection and test splits."""
    model, _, calib, selection, test = bench_fidelity.data()
    return model, calib, selection, test


Row = Callable[[torch.nn.Module, Any, Any, int], tuple[torch.nn.Module, str]]


def _what(report: Any) -> str:
    """The blocks a report says were cut."""
    spans = getattr(report, "spans", None) or []
    return " ".join(f"[{s.start}:{s.stop}]" for s in spans)


def _compress(method: str, **fixed: Any) -> Row:
    """``toast.compress`` with ``method`` removing ``n`` blocks (``budget``
    for TOAST, ``num_blocks`` otherwise) and ``fixed`` options."""
    size = "budget" if method == "toast" else "num_blocks"

    def row(model: torch.nn.Module, calib: Any, selection: Any, n: int):
        out, report = toast.compress(
            model, calib, method=method, progress=False, **{size: n}, **fixed
        )
        return out, _what(report)

    return row


def _replaceme_paper(**fields: Any) -> Row:
    """ReplaceMe with the paper's protocol (and ``fields``)."""

    def row(model: torch.nn.Module, calib: Any, selection: Any, n: int):
        config = ReplaceMeConfig.paper(num_blocks=n, progress=False, **fields)
        out, report = toast.compress(model, calib, method="replaceme", config=config)
        return out, _what(report)

    return row


def _ghosted(model: torch.nn.Module, calib: Any, selection: Any, n: int):
    """Ghosted Layers as published: LLM-Streamline's cosine window, ``W = I +
    M`` fitted by ε-ridge least squares in float64, every row, no bias."""
    config = ToastConfig.ghosted(n, progress=False)
    out, report = toast.compress(model, calib, method="toast", config=config)
    return out, _what(report)


def _prunecomp(model: torch.nn.Module, calib: Any, selection: Any, n: int):
    """Prune&Comp as published: ``n`` rounds of lowest Block Influence removed
    and its magnitude gap folded (``n`` passes over the calibration data)."""
    out, result = prune_and_comp(model, calib, n, Calibration(progress=False))
    scales = " ".join(f"{a:.3f}" for a in result.scales)
    return out, f"removed {result.removed} (in order), α {scales}, folded {result.fold}"


def _sublayers(model: torch.nn.Module, calib: Any, selection: Any, n: int):
    """Sub-layer pruning of at least ``n`` blocks' parameters: the fewest MLP
    sub-layers (the larger part of a block) that remove as many, chosen by
    score (toast's ``method="sublayer"``, FinerCut-style)."""
    layer = model.model.layers[0]
    block = sum(p.numel() for p in layer.parameters())
    mlp = sum(p.numel() for p in layer.mlp.parameters())
    mlp += sum(p.numel() for p in layer.post_attention_layernorm.parameters())
    k = math.ceil(n * block / mlp)
    out, report = toast.compress(
        model, calib, method="sublayer", num_sublayers=k, kind="mlp", progress=False
    )
    removed = " ".join(f"{r.kind}@{r.block}" for r in report.removed)
    return out, f"{k} MLPs: {removed}"


_SLEB_ORDER: list[int] = []
#: blocks → parameters of toast.compress's default (the search's target)
DEFAULT_PARAMS: dict[int, int] = {}
DEFAULT_ROW = "toast.compress default (TOAST)"
#: (blocks, family) → the best selection-split perplexity the search measured, its label
SEARCH_BEST: dict[tuple[int, str], tuple[float, str]] = {}


def _sleb(model: torch.nn.Module, calib: Any, selection: Any, n: int):
    """SLEB's greedy removal: its choices do not depend on how many follow,
    so the order is measured once, up to the largest size asked, and each
    size removes its prefix (the same blocks ``selection="sleb"`` gives)."""
    from toast.hf.model.blocks import find_blocks
    from toast.methods.selection import runs, sleb

    if len(_SLEB_ORDER) < n:
        stack = find_blocks(model)
        # SLEB measures every remaining block at every step (212 passes up to 8
        # blocks of 30): on these cores its perplexity is measured on the first
        # 4 calibration sequences (1,024 tokens), an eighth of the others' data
        scoring = list(calib)[:SLEB_BATCHES]
        _SLEB_ORDER[:] = sleb(model, scoring, stack, max(SIZES_ASKED)).order
    spans = runs(_SLEB_ORDER[:n])
    out, report = toast.compress(model, calib, method="remove", spans=spans, progress=False)
    return out, _what(report) + f" (order {_SLEB_ORDER[:n]})"


def _search(model: torch.nn.Module, calib: Any, selection: Any, n: int):
    """``toast.search``'s measured choice at the parameter count of toast's
    default at ``n`` blocks (``n`` blocks removed and the translator added:
    the search is compared with the default at equal size), or at ``n``
    blocks' parameters when the default has not been measured."""
    total = toast.count_params(model)
    if n in DEFAULT_PARAMS:
        target = (total - DEFAULT_PARAMS[n]) / total - 1e-9
    else:
        block = sum(p.numel() for p in model.model.layers[0].parameters())
        target = n * block / total - 1e-6
    with tempfile.TemporaryDirectory() as cache:
        result = toast.search(
            model, calib, selection, target=target, cache=cache, latency=False, progress=False
        )
    # what each family's best measured candidate scored on the selection split
    for m in result.measured:
        family, quality = m.candidate.family, m.measurement.quality
        if quality < SEARCH_BEST.get((n, family), (math.inf, ""))[0]:
            SEARCH_BEST[(n, family)] = (quality, m.candidate.label)
    return result.model, result.best.candidate.label


#: Every row by name: peers as published first, then toast.
ROWS: dict[str, Row] = {
    "UIDL: angular window, removed": _replaceme_paper(objective="identity"),
    "ShortGPT: Block Influence, removed": _compress("remove", selection="block_influence"),
    "SLEB: measured greedy removal": _sleb,
    "ReplaceMe LS (paper)": _replaceme_paper(),
    "ReplaceMe cosine (paper)": _replaceme_paper(objective="cosine"),
    "LinearPatch (paper)": _compress("linearpatch"),
    "Ghosted Layers (paper)": _ghosted,
    "Prune&Comp (paper)": _prunecomp,
    "toast.replaceme default": _compress("replaceme"),
    "toast.compress default (TOAST)": _compress("toast"),
    "TOAST, patch_ridge": _compress("toast", translator="patch_ridge"),
    "ReplaceMe cut, LinearPatch form folded": _compress("replaceme", structure="rotated_diagonal"),
    "ReplaceMe cut, patch_ridge folded": _compress("replaceme", structure="patch_ridge"),
    "sub-layer pruning: MLPs by score": _sublayers,
    "toast.search": _search,
}
#: The order rows are measured in: SLEB's greedy order (its 212 passes) last.
MEASURE_ORDER = [name for name in ROWS if name != "SLEB: measured greedy removal"] + [
    "SLEB: measured greedy removal"
]


def _tokens_per_second(model: torch.nn.Module, batches: list, rounds: int = 3) -> float:
    """Forward tokens per second over ``batches`` (one warm-up, median)."""
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    times = []
    with torch.inference_mode():
        for k in range(rounds + 1):
            start = time.perf_counter()
            for b in batches:
                model(**b, use_cache=False)
            if k:
                times.append(time.perf_counter() - start)
    return tokens / statistics.median(times)


def _speed(model: torch.nn.Module, original: torch.nn.Module, batches: list) -> float:
    """Tokens/s of ``model`` over the original's, interleaved rounds, median ratio."""
    ratios = [
        _tokens_per_second(model, batches, 1) / _tokens_per_second(original, batches, 1)
        for _ in range(3)
    ]
    return statistics.median(ratios)


def _measure_row(name: str, n: int, context: dict[str, Any]) -> dict[str, Any]:
    model, calib, selection = context["model"], context["calib"], context["selection"]
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built, what = ROWS[name](copy.deepcopy(model), calib, selection, n)
    seconds = time.perf_counter() - start
    if name == DEFAULT_ROW:
        DEFAULT_PARAMS[n] = toast.count_params(built)
    context["evaluator"].measure(built, f"{name} n={n}")
    measured = {k: context["evaluator"].last[k] for k, _, _ in _COLUMNS}
    # the split the search selects on, for comparing ReplaceMe's default cut with the
    # search's best ReplaceMe cut (the other rows skip it: these cores are the limit)
    selection_ppl = math.nan
    if name in ("toast.replaceme default", DEFAULT_ROW, "toast.search"):
        selection_ppl = context["selection_evaluator"].measure(built, f"{name} n={n}")
    return {
        "row": name,
        "blocks": n,
        "what": what,
        "params": toast.count_params(built),
        "seconds": seconds,
        "speed": _speed(built, model, context["speed_batches"]),
        **measured,
        "selection_perplexity": selection_ppl,
        "search_best": {
            family: {"perplexity": q, "label": label}
            for (size, family), (q, label) in SEARCH_BEST.items()
            if size == n and name == "toast.search"
        },
    }


def run(
    sizes: list[int], rows: list[str], out: Path, append: bool = False, redo: bool = False
) -> dict[str, Any]:
    model, calib, selection, test = _data()
    evaluator = Evaluator(test, progress=False)
    evaluator.measure(model, "original")
    selection_evaluator = Evaluator(selection, progress=False)
    selection_evaluator.measure(model, "original")
    context = {
        "model": model,
        "calib": calib,
        "selection": selection,
        "evaluator": evaluator,
        "selection_evaluator": selection_evaluator,
        "speed_batches": list(test)[:1],
    }
    record: dict[str, Any] = {
        "machine": _machine.machine(os.getloadavg()),
        "original": {
            "params": toast.count_params(model),
            **{k: evaluator.last[k] for k, _, _ in _COLUMNS},
        },
        "rows": [],
    }
    if append and out.exists():  # keep an earlier run's measured rows; measure the rest
        earlier = json.loads(out.read_text())
        record["rows"] = [r for r in earlier["rows"] if "error" not in r]
        _SLEB_ORDER[:] = earlier.get("sleb_order", [])
        for r in record["rows"]:
            if r["row"] == DEFAULT_ROW:
                DEFAULT_PARAMS[r["blocks"]] = r["params"]
        if redo:  # measure the asked rows at the asked sizes again, keep the rest
            record["rows"] = [
                r for r in record["rows"] if not (r["row"] in rows and r["blocks"] in sizes)
            ]
    done = {(r["row"], r["blocks"]) for r in record["rows"]}
    for n in sizes:
        for name in rows:
            if (name, n) in done:
                continue
            print(f"== {name}, {n} blocks", flush=True)
            try:
                found = _measure_row(name, n, context)
            except Exception as exc:  # a row's failure is a result too
                traceback.print_exc()
                found = {"row": name, "blocks": n, "error": f"{type(exc).__name__}: {exc}"}
            print(found, flush=True)
            record["rows"].append(found)
            record["sleb_order"] = list(_SLEB_ORDER)
            out.write_text(json.dumps(record, indent=1, default=str))
    return record


def _table(record: dict[str, Any]) -> str:
    head = "| blocks | method | cut | params | " + " | ".join(c for _, c, _ in _COLUMNS)
    lines = [head + " | tokens/s × |", "|---:|---|---|---:|" + "---:|" * (len(_COLUMNS) + 1)]
    o = record["original"]
    cells = " | ".join(f"{o[k]:{spec}}" for k, _, spec in _COLUMNS)
    lines.append(f"| 0 | original | | {o['params']:,} | {cells} | 1.00 |")
    order = list(ROWS)
    for r in sorted(record["rows"], key=lambda r: (r["blocks"], order.index(r["row"]))):
        if "error" in r:
            lines.append(f"| {r['blocks']} | {r['row']} | {r['error']} | | | | | |")
            continue
        cells = " | ".join(f"{r[k]:{spec}}" for k, _, spec in _COLUMNS)
        lines.append(
            f"| {r['blocks']} | {r['row']} | {r['what']} | {r['params']:,} | {cells} | "
            f"{r['speed']:.2f} |"
        )
    return "\n".join(lines)


def _selection(rows: dict[str, dict[str, Any]], name: str) -> str:
    value = rows.get(name, {}).get("selection_perplexity", math.nan)
    return "—" if value is None or math.isnan(value) else f"{value:.2f}"


def selection_table(record: dict[str, Any]) -> str:
    """The split the search chooses on: toast's defaults against the
    search's choice and its best ReplaceMe cut (must-holds 2 and 4)."""
    rows = [r for r in record["rows"] if "error" not in r]
    lines = [
        "| blocks | toast.compress default | toast.search's choice | toast.replaceme default "
        "| search's best ReplaceMe cut |",
        "|---:|---:|---:|---:|---:|",
    ]
    for n in sorted({r["blocks"] for r in rows}):
        got = {r["row"]: r for r in rows if r["blocks"] == n}
        search = got.get("toast.search", {})
        best = search.get("search_best", {}).get("replaceme")
        lines.append(
            f"| {n} | {_selection(got, DEFAULT_ROW)} | {_selection(got, 'toast.search')} "
            f"({search.get('what', '—')}) | {_selection(got, 'toast.replaceme default')} | "
            + ("—" if best is None else f"{best['perplexity']:.2f} ({best['label']})")
            + " |"
        )
    return "\n".join(lines)


def retained_accuracy(path: Path) -> tuple[int, dict[str, float]]:
    """From ``bench_accuracy.py``'s results: the largest size it measured and
    each row's retained share of the original's average accuracy there (%)."""
    from toast.hf.evaluate.harness import TaskReport

    record = json.loads(path.read_text())
    original = TaskReport.from_dict(record["original"]["report"]).average
    rows = [r for r in record["rows"] if "error" not in r]
    last = max(r["blocks"] for r in rows)
    return last, {
        r["row"]: 100 * TaskReport.from_dict(r["report"]).average / original
        for r in rows
        if r["blocks"] == last
    }


def summary(record: dict[str, Any], accuracy: tuple[int, dict[str, float]] | None = None) -> str:
    """One line per method: test perplexity at every size measured, KL and
    top-1 agreement at the largest, and with ``accuracy`` (see
    :func:`retained_accuracy`) the accuracy retained (the README's table)."""
    rows = [r for r in record["rows"] if "error" not in r]
    sizes = sorted({r["blocks"] for r in rows})
    last = sizes[-1]
    head = " | ".join(f"{n} blocks" for n in sizes)
    extra = "" if accuracy is None else f" retained acc. @{accuracy[0]} ↑ |"
    lines = [
        f"| perplexity ↓ (blocks removed of 30) | {head} | KL @{last} ↓ | top-1 @{last} ↑ |"
        + extra,
        "|---|" + "---:|" * (len(sizes) + 2 + (accuracy is not None)),
    ]
    o = record["original"]
    lines.append(
        f"| original | {o['perplexity']:.2f} |"
        + " |" * (len(sizes) + 1)
        + ("" if accuracy is None else " 100.0 |")
    )
    for name in ROWS:
        got = {r["blocks"]: r for r in rows if r["row"] == name}
        kept = None if accuracy is None else accuracy[1].get(name)
        if not got and kept is None:
            continue
        best = {n: min(r["perplexity"] for r in rows if r["blocks"] == n) for n in sizes}
        cells = []
        for n in sizes:
            r = got.get(n)
            text = "—" if r is None else f"{r['perplexity']:.2f}"
            tie = r is not None and text == f"{best[n]:.2f}"  # the best as printed
            cells.append(f"**{text}**" if tie else text)
        end = got.get(last)
        tail = "— | —" if end is None else f"{end['kl']:.3f} | {100 * end['agreement']:.1f}%"
        if accuracy is not None:
            tail += " | —" if kept is None else f" | {kept:.1f}"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {tail} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--rows", nargs="+", default=MEASURE_ORDER, choices=list(ROWS))
    parser.add_argument("--out", default="benchmarks/results/peers.json")
    parser.add_argument(
        "--append", action="store_true", help="keep the rows an earlier --out measured"
    )
    parser.add_argument(
        "--redo", action="store_true", help="with --append, measure the --rows again"
    )
    parser.add_argument(
        "--tables", action="store_true", help="only write the tables of an earlier --out"
    )
    parser.add_argument(
        "--readme", help="put the summary between <!-- peers --> markers of this file"
    )
    args = parser.parse_args()
    SIZES_ASKED[:] = args.sizes
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.tables:
        record = json.loads(out.read_text())
    else:
        record = run(args.sizes, args.rows, out, args.append, args.redo)
    text = (
        "# SmolLM2-135M-Instruct: toast against the training-free depth-pruning peers\n\n"
        "Test split: 16 × 256 tokens no method selected on. KL: mean KL(original ‖ model) "
        "per token; tokens/s ×: forward throughput over the original's (median of 3 "
        "interleaved rounds).\n\n"
        f"## Summary\n\n{summary(record)}\n\n"
        "## On the search's selection split\n\nPerplexity on the 16 × 256 tokens "
        "`toast.search` chooses on (and the search's own measurements).\n\n"
        f"{selection_table(record)}\n\n## Every row\n\n"
        f"{_table(record)}\n\n{_machine.describe(record['machine'])}\n"
    )
    out.with_suffix(".md").write_text(text)
    print(text)
    if args.readme:
        readme = Path(args.readme)
        accuracy = Path(args.out).with_name("accuracy.json")
        kept = retained_accuracy(accuracy) if accuracy.exists() else None
        text = replace_block(readme.read_text(), "peers", summary(record, kept), str(readme))
        readme.write_text(text)


if __name__ == "__main__":
    main()
