"""Fits against plain removal on every 4-block window of SmolLM2-135M-Instruct.

For each window ``blocks[s:s+4]`` (``s = 1 … 26``), the 8-block cut the
paper's distance chooses, and the 4- and 8-block cuts ``replaceme``
chooses by default (held-out loss among the four closest windows), the
held-out perplexity of:

- plain removal (the blocks skipped);
- the paper's LS (ReplaceMe Eq. 6 on every calibration row, folded:
  :data:`~toast.methods.replaceme.config.PAPER`);
- toast's default ReplaceMe fit: LS in which the rows whose massive
  activation only the removed blocks create are fitted to what plain
  removal gives them (``massive_rows="plain"``), on 90% of the calibration
  batches, checked against plain removal on the other 10% (plain removal
  where it loses), a winner fitted again on every batch;
- the cosine objective with the paper's settings (Adam, lr 1e-4, 10
  epochs from the identity, approximate loss) and with toast's defaults
  (exact loss, L-BFGS from the default LS to convergence, held-out check);
- TOAST's affine translator in place of the window (closed form, from one
  all-pairs analysis pass on every calibration batch: the papers' protocol),
  and with toast's TOAST defaults: the analysis on 90% of the batches, the
  rows the window would have to make massive fitted as their inputs
  (``massive_rows="plain"``), each translator checked against plain removal
  on the other 10% (plain removal where it loses).

Every fit of one kind comes from one calibration pass for all windows (the
estimation accumulates each window's statistics side by side); the fits
are evaluated by hooks that compute what the surgery computes
(:func:`toast.methods.replaceme.check.applied`), TOAST's translators on a
patched copy. Calibration and held-out text are disjoint stdlib docstring
sentences, packed into sequences of ``--length`` tokens.

    .venv/bin/python benchmarks/bench_fits.py            # ~2 h on 2 cores
    .venv/bin/python benchmarks/bench_fits.py --starts 9 10 11 12 --no-eight
    .venv/bin/python benchmarks/bench_fits.py --merge --recompute default

``--merge`` keeps the cells of the saved results and computes only the
missing ones (``--recompute`` drops columns first). Writes
``benchmarks/results/fits.md`` and ``fits.json``.
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
from toast.hf.data.text import TextData
from toast.hf.evaluate.quality import Evaluator
from toast.io.local import load_model, load_tokenizer
from toast.methods.replaceme import profile_distances, replaceme
from toast.methods.replaceme.check import CheckSplit, applied, check_fits
from toast.methods.replaceme.config import PAPER, ReplaceMeConfig
from toast.methods.replaceme.estimate import Estimation
from toast.methods.translate.check import check_translators
from toast.spans import Span
from toast.zoo import smollm2_gguf

ROOT = Path(__file__).resolve().parent
METHODS = [
    "plain",
    "paper LS",
    "default",
    "cosine (paper)",
    "cosine (default)",
    "TOAST",
    "TOAST (default)",
]
#: The fits estimated in one pass each: name -> ReplaceMeConfig options.
FITS = {
    "paper LS": {**PAPER, "objective": "ls"},
    "default": {},  # LS, massive_rows="plain", check_fraction=0.1 with fallback
    "cosine (paper)": {**PAPER, "objective": "cosine"},  # Adam from I, approximate loss
    "cosine (default)": {"objective": "cosine"},  # exact loss, L-BFGS from the default LS
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
    split = CheckSplit(calib, config.check_fraction)
    stack = toast.hf.find_blocks(model)
    start = time.perf_counter()
    fitted, _ = Estimation(model, split.fit, config, stack).fit(spans)
    print(f"{name}: {len(spans)} fits in {time.perf_counter() - start:.0f} s", flush=True)
    transforms = [f.transform for f in fitted]
    if config.check_fraction and config.fallback:
        pairs = zip(spans, transforms, strict=True)
        transforms = [_checked(model, stack, s, t, split) for s, t in pairs]
        won = [k for k, t in enumerate(transforms) if t is not None]
        if won:  # as replaceme does: the winners fitted again on every batch
            starts = [transforms[k] for k in won] if config.objective == "cosine" else None
            again, _ = Estimation(model, calib, config, stack).fit([spans[k] for k in won], starts)
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
        toast.io.replace_spans(pruned, [(span.start, span.stop)], [translator])
        yield pruned


def _toast_default_models(model, calib, spans):
    """TOAST's default pipeline for each forced span (what toast.compress(...,
    spans=[span]) does, from one analysis for all the spans)."""
    split = CheckSplit(calib, 0.1)
    analysis = toast.analyze(
        model, split.fit, metric="linear", estimator="gcv", precision="mixed", massive_rows=True
    )
    # what a kept fit is refitted from (refit=True): every batch, the held-out ones too
    every = toast.analyze(
        model, calib, metric="linear", estimator="gcv", precision="mixed", massive_rows=True
    )
    stack = toast.hf.find_blocks(model)
    for span in spans:
        fit = _plain_fit(analysis, span)
        (check,) = check_translators(model, stack, [span], [fit], split.check, True)
        print(f"  TOAST check {span}: fitted {check.fitted:.2f}, plain {check.plain:.2f}")
        pruned = copy.deepcopy(model)
        if check.used == "fitted":
            toast.io.replace_spans(pruned, [(span.start, span.stop)], [_plain_fit(every, span)])
        else:
            toast.io.replace_spans(pruned, [(span.start, span.stop)], [torch.nn.Identity()])
        yield pruned, check.used != "fitted"


def _plain_fit(analysis, span):
    """TOAST's default translator of ``span`` from ``analysis``: affine, the
    rows the span would have to make massive fitted as plain removal leaves them."""
    fit = analysis.massive.plain_fit(analysis.moments, span.start, span.stop, True, 0.0, False)
    if fit is None:
        fit = toast.fit_translator(analysis.moments, span.start, span.stop, kind="affine")
    return fit


def _todo(rows, spans, name):
    """The spans whose row lacks ``name``, grouped for one estimation pass
    each: the 4-block windows together, every other span on its own (two
    cuts of one pass must not share the block that records the MLP output)."""
    todo = [s for s, row in zip(spans, rows, strict=True) if name not in row]
    return [g for g in ([s for s in todo if s.num_blocks == 4],) if g] + [
        [s] for s in todo if s.num_blocks != 4
    ]


def _measure_all(model, calib, heldout, spans, previous):
    """Every missing cell of the rows of ``spans`` (``previous``: the saved
    rows, by span)."""
    evaluator = Evaluator(heldout, progress=False)
    original = evaluator.measure(model, "original")
    stack = toast.hf.find_blocks(model)
    rows = [previous.get((s.start, s.stop), {"span": [s.start, s.stop]}) for s in spans]
    for row, span in zip(rows, spans, strict=True):
        if "plain" not in row:
            with applied(stack, [span], [None], "fold"):
                row["plain"] = evaluator.measure(model)
    by_span = {(s.start, s.stop): row for s, row in zip(spans, rows, strict=True)}
    for name, options in FITS.items():
        for group in _todo(rows, spans, name):
            for span, t in zip(group, _fits(model, calib, group, name, options), strict=True):
                row = by_span[(span.start, span.stop)]
                if t is None:  # the default fell back to plain removal
                    row[name], row[f"{name} fell back"] = row["plain"], True
                    continue
                with applied(stack, [span], [t], "fold"):
                    row[name] = evaluator.measure(model)
                print(json.dumps(row), flush=True)
    todo = [s for g in _todo(rows, spans, "TOAST") for s in g]
    for span, pruned in zip(todo, _toast_models(model, calib, todo), strict=True):
        row = by_span[(span.start, span.stop)]
        row["TOAST"] = evaluator.measure(pruned)
        print(json.dumps(row), flush=True)
    todo = [s for g in _todo(rows, spans, "TOAST (default)") for s in g]
    for span, (pruned, fell) in zip(todo, _toast_default_models(model, calib, todo), strict=True):
        row = by_span[(span.start, span.stop)]
        row["TOAST (default)"], row["TOAST (default) fell back"] = evaluator.measure(pruned), fell
        print(json.dumps(row), flush=True)
    return original, evaluator.count, rows


def _toast_choice(model, calib, num_blocks):
    """The cut replaceme chooses by default (held-out loss among the
    windows of smallest distance), with what it measured."""
    _, report = replaceme(copy.deepcopy(model), calib, num_blocks=num_blocks, progress=False)
    (span,) = report.spans
    measured = [
        {"span": [c.span.start, c.span.stop], "fitted": c.fitted, "plain": c.plain}
        for c in report.candidates
    ]
    print(f"toast's {num_blocks}-block cut: {span} among {measured}", flush=True)
    return span, measured


def _table(rows, chosen) -> str:
    methods = [m for m in METHODS if all(m in row for row in rows)]
    labels = {(s.start, s.stop): name for name, (s, _) in chosen.items()}
    lines = [
        "| window | " + " | ".join(methods) + " |",
        "|---|" + "---:|" * len(methods),
    ]
    for row in rows:
        best = min(row[m] for m in methods)
        cells = []
        for m in methods:
            text = f"{row[m]:.2f}"
            if row.get(f"{m} fell back"):
                text += " (plain)"
            cells.append(f"**{text}**" if row[m] == best else text)
        a, b = row["span"]
        label = f" ({labels[(a, b)]})" if (a, b) in labels else ""
        lines.append(f"| blocks[{a}:{b}]{label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: The comparisons the summary counts: a <= b.
COMPARISONS = [
    ("default", "plain"),
    ("default", "paper LS"),
    ("paper LS", "plain"),
    ("cosine (paper)", "paper LS"),
    ("cosine (default)", "paper LS"),
    ("cosine (default)", "default"),
    ("TOAST", "plain"),
    ("TOAST (default)", "plain"),
    ("TOAST (default)", "TOAST"),
]


def _counts(rows) -> dict[str, int]:
    counts: dict[str, int] = {}
    for a, b in COMPARISONS:
        if all(a in r and b in r for r in rows):
            # a relative 1e-9: equal fits measured twice are equal, not "worse"
            counts[f"{a} <= {b}"] = sum(r[a] <= r[b] * (1 + 1e-9) for r in rows)
    return counts


def _summary(rows, chosen) -> dict:
    four = [r for r in rows if r["span"][1] - r["span"][0] == 4]
    by_span = {tuple(r["span"]): r for r in rows}
    at_chosen = {
        name: _counts([by_span[(span.start, span.stop)]]) for name, (span, _) in chosen.items()
    }
    return {"windows": len(four), **_counts(four), "at the chosen cuts": at_chosen}


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
        "--merge", action="store_true", help="keep the saved cells of the results JSON"
    )
    parser.add_argument(
        "--recompute", nargs="+", default=[], help="with --merge: columns computed again"
    )
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    start = time.perf_counter()
    gguf = smollm2_gguf()
    model, tokenizer = load_model(gguf), load_tokenizer(gguf)
    calib, heldout = _data(tokenizer, args)
    spans = [Span(s, s + 4, float("nan")) for s in args.starts]
    saved = {}
    if args.merge:
        saved = json.loads((Path(args.out) / "fits.json").read_text(encoding="utf-8"))
    previous = {tuple(r["span"]): r for r in saved.get("rows", [])}
    chosen = {
        name: (Span(*c["span"], float("nan")), c["candidates"])
        for name, c in saved.get("chosen", {}).items()
    }
    if not args.no_eight and not chosen:  # the choices are part of the saved results
        (eight,) = profile_distances(model, calib, progress=False).select(8)
        chosen["the paper's 8-block cut"] = (eight, [])
        for n in (4, 8):
            chosen[f"toast's {n}-block cut"] = _toast_choice(model, calib, n)
    for span, _ in chosen.values():
        if all((span.start, span.stop) != (s.start, s.stop) for s in spans):
            spans.append(span)
    for row in previous.values():
        for name in args.recompute:
            row.pop(name, None)
            row.pop(f"{name} fell back", None)
    original, tokens, rows = _measure_all(model, calib, heldout, spans, previous)
    results = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32)",
        "calibration": [calib.num_samples, args.length],
        "heldout_tokens": tokens,
        "original_perplexity": original,
        "rows": rows,
        "chosen": {k: {"span": [s.start, s.stop], "candidates": c} for k, (s, c) in chosen.items()},
        "summary": _summary(rows, chosen),
        "machine": {"cpus": os.cpu_count(), "load_average": list(os.getloadavg())},
        "torch": torch.__version__,
        "python": platform.python_version(),
        "total_s": time.perf_counter() - start,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)  # a new --out folder is made, not an error at the end
    (out / "fits.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    table = _table(rows, chosen)
    text = (
        "# Fits against plain removal: every 4-block window of SmolLM2-135M-Instruct\n\n"
        f"Held-out perplexity ({tokens:,} predicted tokens of stdlib docstrings; original "
        f"{original:.2f}); calibration {calib.num_samples} × {args.length} tokens of other "
        "sentences. Best per row in bold; `(plain)`: the held-out check chose plain "
        f"removal.\n\n{table}\n\nSummary over the 4-block windows: "
        f"{json.dumps(results['summary'])}\n\nTotal {results['total_s']:.0f} s on "
        f"{os.cpu_count()} CPUs, load average at the end {os.getloadavg()[0]:.2f}.\n"
    )
    (out / "fits.md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
