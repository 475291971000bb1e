"""Fits against plain removal on every 4-block window of SmolLM2-135M-Instruct.

For each window ``blocks[s:s+4]`` (``s = 1 … 26``) and for the 8-block cut
ReplaceMe's distance profile chooses, the held-out perplexity of:

- plain removal (the blocks skipped);
- the paper's LS (ReplaceMe Eq. 6 on every calibration row, folded);
- toast's default ReplaceMe fit: LS in which the rows whose massive
  activation only the removed blocks create are fitted to what plain
  removal gives them (``massive_rows="plain"``), on 90% of the calibration
  batches, checked against plain removal on the other 10% and falling back
  to it when it loses (``holdout=0.1, fallback=True``);
- the cosine objective with the paper's settings (Adam, lr 1e-4, 10
  epochs from the identity) and with L-BFGS from the LS solution;
- TOAST's affine translator in place of the window (closed form, from one
  all-pairs analysis pass).

Every fit of one kind comes from one calibration pass for all windows (the
estimation accumulates each window's statistics side by side); the fits
are evaluated by hooks that compute what the surgery computes
(:func:`toast.methods.replaceme.heldout.applied`), TOAST's translators on a
patched copy. Calibration and held-out text are disjoint stdlib docstring
sentences, packed into sequences of ``--length`` tokens.

    .venv/bin/python benchmarks/bench_fits.py            # ~40 min on 2 cores
    .venv/bin/python benchmarks/bench_fits.py --starts 9 10 11 12 --no-eight

Writes ``benchmarks/results/fits.md`` and ``fits.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import time
from pathlib import Path

import torch

import toast
from toast.data import stdlib_sentences
from toast.hf.quality import Evaluator
from toast.hf.text import TextData
from toast.io.local import load_model, load_tokenizer
from toast.methods.replaceme.config import ReplaceMeConfig
from toast.methods.replaceme.estimate import Estimation
from toast.methods.replaceme.heldout import Holdout, applied, check_fits
from toast.spans import Span
from toast.zoo import smollm2_gguf

ROOT = Path(__file__).resolve().parent
METHODS = ["plain", "paper LS", "default", "cosine (paper)", "cosine (L-BFGS from LS)", "TOAST"]
#: The fits estimated in one pass each: name -> ReplaceMeConfig options.
FITS = {
    "paper LS": {"objective": "ls", "massive_rows": "fit", "holdout": 0.0},
    "default": {},  # LS, massive_rows="plain", holdout=0.1 with fallback
    "cosine (paper)": {"objective": "cosine", "massive_rows": "fit", "holdout": 0.0},
    "cosine (L-BFGS from LS)": {
        "objective": "cosine",
        "solver": "lbfgs",
        "init": "ls",
        "lbfgs_steps": 100,
        "holdout": 0.0,
    },
}


def _data(tokenizer, args):
    sentences = stdlib_sentences(limit=None)
    cut = len(sentences) // 2  # calibration from the first half, held-out from the second
    options = {"max_length": args.length, "pack": True, "batch_size": args.batch}
    calib = TextData(sentences[:cut], tokenizer, num_samples=args.calibration, **options)
    heldout = TextData(sentences[cut:], tokenizer, num_samples=args.heldout, **options)
    return calib, heldout


def _fits(model, calib, spans, name, options):
    """Every span's transform from one estimation pass (on the fit part of
    the calibration batches for the held-out-checked default)."""
    spans_option = {"spans": [(s.start, s.stop) for s in spans], "progress": False}
    config = ReplaceMeConfig.from_options(None, {**spans_option, **options})
    split = Holdout(calib, config.holdout)
    stack = toast.find_blocks(model)
    start = time.perf_counter()
    fitted, _ = Estimation(model, split.fit, config, stack).fit(spans)
    print(f"{name}: {len(spans)} fits in {time.perf_counter() - start:.0f} s", flush=True)
    transforms = [f.transform for f in fitted]
    if config.holdout and config.fallback:
        pairs = zip(spans, transforms, strict=True)
        transforms = [_checked(model, stack, s, t, split) for s, t in pairs]
        won = [k for k, t in enumerate(transforms) if t is not None]
        if won:  # as toast.replaceme does: the winners fitted again on every batch
            again, _ = Estimation(model, calib, config, stack).fit([spans[k] for k in won])
            for k, f in zip(won, again, strict=True):
                transforms[k] = f.transform
    return transforms


def _checked(model, stack, span, transform, split):
    (check,) = check_fits(model, stack, [span], [transform], "fold", split.check, True)
    print(f"  check {span}: fitted {check.fitted:.2f}, plain {check.plain:.2f}", flush=True)
    return transform if check.used == "fitted" else None


def _toast_models(model, calib, spans):
    analysis = toast.analyze(model, calib, metric="linear", estimator="gcv", precision="mixed")
    for span in spans:
        translator = toast.fit_translator(analysis.moments, span.start, span.stop, kind="affine")
        pruned = copy.deepcopy(model)
        toast.replace_spans(pruned, [(span.start, span.stop)], [translator])
        yield pruned


def _measure_all(model, calib, heldout, spans, methods, previous):
    evaluator = Evaluator(heldout, progress=False)
    original = evaluator.measure(model, "original")
    stack = toast.find_blocks(model)
    rows = [previous.get((s.start, s.stop), {"span": [s.start, s.stop]}) for s in spans]
    for row, span in zip(rows, spans, strict=True):
        if "plain" not in row:
            with applied(stack, [span], [None], "fold"):
                row["plain"] = evaluator.measure(model)
    # the 8-block cut may start where a window starts: its own pass (one block
    # records the MLP output for one cut)
    groups = [[s for s in spans if s.num_blocks == 4], [s for s in spans if s.num_blocks != 4]]
    for name, options in FITS.items():
        if name not in methods:
            continue
        for row in rows:
            row.pop(f"{name} fell back", None)
        transforms = [t for g in groups if g for t in _fits(model, calib, g, name, options)]
        for row, span, t in zip(rows, [s for g in groups for s in g], transforms, strict=True):
            if t is None:  # the default fell back to plain removal
                row[name], row[f"{name} fell back"] = row["plain"], True
                continue
            with applied(stack, [span], [t], "fold"):
                row[name] = evaluator.measure(model)
            print(json.dumps(row), flush=True)
    if "TOAST" in methods:
        for row, pruned in zip(rows, _toast_models(model, calib, spans), strict=True):
            row["TOAST"] = evaluator.measure(pruned)
            print(json.dumps(row), flush=True)
    return original, evaluator.count, rows


def _table(rows) -> str:
    methods = [m for m in METHODS if all(m in row for row in rows)]
    lines = [
        "| window | " + " | ".join(methods) + " |",
        "|---|" + "---:|" * len(methods),
    ]
    for row in rows:
        best = min(row[m] for m in methods)
        cells = []
        for m in methods:
            text = f"{row[m]:.2f}"
            if m == "default" and row.get("default fell back"):
                text += " (plain)"
            cells.append(f"**{text}**" if row[m] == best else text)
        lines.append(f"| blocks[{row['span'][0]}:{row['span'][1]}] | " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: The comparisons the summary counts over the 4-block windows: a <= b.
COMPARISONS = [
    ("default", "plain"),
    ("default", "paper LS"),
    ("paper LS", "plain"),
    ("cosine (paper)", "paper LS"),
    ("cosine (L-BFGS from LS)", "paper LS"),
    ("cosine (L-BFGS from LS)", "default"),
    ("TOAST", "plain"),
]


def _summary(rows) -> dict:
    four = [r for r in rows if r["span"][1] - r["span"][0] == 4]
    counts: dict[str, int] = {"windows": len(four)}
    for a, b in COMPARISONS:
        if all(a in r and b in r for r in four):
            # a relative 1e-9: equal fits measured twice are equal, not "worse"
            counts[f"{a} <= {b}"] = sum(r[a] <= r[b] * (1 + 1e-9) for r in four)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, nargs="+", default=list(range(1, 27)))
    parser.add_argument("--no-eight", action="store_true", help="skip the 8-block cut")
    parser.add_argument("--calibration", type=int, default=40, help="sequences (40)")
    parser.add_argument("--heldout", type=int, default=8, help="sequences (8)")
    parser.add_argument("--length", type=int, default=512, help="tokens per sequence (512)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per batch (4)")
    parser.add_argument("--out", default=str(ROOT / "results"))
    parser.add_argument(
        "--methods", nargs="+", default=[*FITS, "TOAST"], help="the columns to (re)compute"
    )
    parser.add_argument(
        "--merge", action="store_true", help="keep the other columns of the results JSON"
    )
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    start = time.perf_counter()
    gguf = smollm2_gguf()
    model, tokenizer = load_model(gguf), load_tokenizer(gguf)
    calib, heldout = _data(tokenizer, args)
    spans = [Span(s, s + 4, float("nan")) for s in args.starts]
    if not args.no_eight:
        (eight,) = toast.profile_distances(model, calib, progress=False).select(8)
        spans.append(eight)
    previous = {}
    if args.merge:
        saved = json.loads((Path(args.out) / "fits.json").read_text(encoding="utf-8"))
        previous = {tuple(r["span"]): r for r in saved["rows"]}
    original, tokens, rows = _measure_all(model, calib, heldout, spans, args.methods, previous)
    results = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32)",
        "calibration": [calib.num_samples, args.length],
        "heldout_tokens": tokens,
        "original_perplexity": original,
        "rows": rows,
        "summary": _summary(rows),
        "machine": {"cpus": os.cpu_count(), "load_average": list(os.getloadavg())},
        "torch": torch.__version__,
        "python": platform.python_version(),
        "total_s": time.perf_counter() - start,
    }
    out = Path(args.out)
    (out / "fits.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    table = _table(rows)
    text = (
        "# Fits against plain removal: every 4-block window of SmolLM2-135M-Instruct\n\n"
        f"Held-out perplexity ({tokens:,} predicted tokens of stdlib docstrings; original "
        f"{original:.2f}); calibration {calib.num_samples} × {args.length} tokens of other "
        "sentences. Best per row in bold; `(plain)`: the default's held-out check chose plain "
        f"removal.\n\n{table}\n\nSummary over the 4-block windows: "
        f"{json.dumps(results['summary'])}\n\nTotal {results['total_s']:.0f} s on "
        f"{os.cpu_count()} CPUs, load average at the end {os.getloadavg()[0]:.2f}.\n"
    )
    (out / "fits.md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
