"""How exact is ``precision="mixed"`` on real activations? The numbers the
default precision is chosen from.

``"mixed"`` forms each chunk's products (at most 4,096 rows) in float32 and
sums the chunks in float64; ``"float64"`` forms everything in float64. Both
run here on the same activations, and every quantity a solver reads is
compared against the float64 result:

- **SmolLM2-135M-Instruct** (float32, 30 blocks, width 576; calibration
  ``--calibration`` × ``--length`` tokens of stdlib docstrings, held-out
  text from other sentences): ReplaceMe's least-squares statistics of
  several cuts (``MᵀM``, ``Mᵀ(L − Y)``; the massive-row rule as by
  default) from one estimation pass per precision; the relative error
  (Frobenius) of each Gram block and of the fitted T, and the held-out
  perplexity of the model with each T folded in.
- **digits ViT** (``toast.zoo.digits_vit``, 13 states × 64): the all-pairs
  moments of ``toast.analyze`` (gcv); the relative error of every cross
  block, the largest change of the linear error matrix, of every span's
  closed-form affine translator, and the test accuracy of the model with
  each of the three best spans replaced.

Each pass is also timed (the same process, the float64 pass first and then
the mixed one, twice, interleaved; medians). Writes
``results/precision.{json,md}``.

    .venv/bin/python benchmarks/bench_precision.py      # ~5 min on 2 cores
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from _machine import describe, machine

import toast
from toast.data import digits, stdlib_sentences
from toast.hf.data.text import TextData
from toast.hf.evaluate.quality import Evaluator
from toast.io.local import load_model, load_tokenizer
from toast.methods.replaceme import estimate
from toast.methods.replaceme.check import applied
from toast.methods.replaceme.config import ReplaceMeConfig
from toast.methods.replaceme.estimate import Estimation
from toast.methods.translate import Analysis
from toast.spans import Span
from toast.zoo import accuracy, digits_vit, smollm2_gguf

ROOT = Path(__file__).resolve().parent
PRECISIONS = ("float64", "mixed")
ROUNDS = 2


def rel(a: np.ndarray, b: np.ndarray) -> float:
    """‖a − b‖ / ‖b‖ (Frobenius)."""
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@contextlib.contextmanager
def recorded_grams(into: list):
    """Records each cut's (MᵀM, Mᵀ(L − Y)) as ReplaceMe solves it."""
    solve = estimate.solve_cut

    def spy(cut, *args, **kwargs):
        m = cut.moments.to_moments() if hasattr(cut.moments, "to_moments") else cut.moments
        into.append((m.cross(0, 0), m.cross(0, 1)))
        return solve(cut, *args, **kwargs)

    estimate.solve_cut = spy
    try:
        yield
    finally:
        estimate.solve_cut = solve


def smollm2(args) -> dict:
    gguf = smollm2_gguf()
    model, tokenizer = load_model(gguf), load_tokenizer(gguf)
    sentences = stdlib_sentences(limit=None)
    half = len(sentences) // 2
    options = {"max_length": args.length, "pack": True, "batch_size": 4}
    calib = TextData(sentences[:half], tokenizer, num_samples=args.calibration, **options)
    heldout = TextData(sentences[half:], tokenizer, num_samples=args.heldout, **options)
    spans = [Span(a, b, float("nan")) for a, b in args.spans]
    stack = toast.hf.find_blocks(model)
    # one pass per group of cuts with distinct first blocks (the pass
    # records one MLP output per block before a cut)
    groups: list[list[Span]] = []
    for span in spans:
        group = next((g for g in groups if all(s.start != span.start for s in g)), None)
        if group is None:
            groups.append(group := [])
        group.append(span)
    runs: dict[str, dict] = {p: {} for p in PRECISIONS}
    times: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    for _ in range(ROUNDS):
        for p in PRECISIONS:
            start = time.perf_counter()
            for group in groups:
                cuts = {"spans": [(s.start, s.stop) for s in group], "precision": p}
                config = ReplaceMeConfig.from_options(None, {**cuts, "progress": False})
                grams: list = []
                with recorded_grams(grams):
                    fitted, _ = Estimation(model, calib, config, stack).fit(group)
                for s, g, f in zip(group, grams, fitted, strict=True):
                    runs[p][s.start, s.stop] = (g, f.transform)
            times[p].append(time.perf_counter() - start)
            print(f"SmolLM2 {p}: {times[p][-1]:.1f} s", flush=True)
    evaluator = Evaluator(heldout, progress=False)
    original = evaluator.measure(model, "original")
    rows = []
    for span in spans:
        key = (span.start, span.stop)
        (g64, b64), t64 = runs["float64"][key]
        (gmx, bmx), tmx = runs["mixed"][key]
        ppl = {}
        for p in PRECISIONS:
            with applied(stack, [span], [runs[p][key][1]], "fold"):
                ppl[p] = evaluator.measure(model)
        rows.append(
            {
                "span": [span.start, span.stop],
                "gram_rel": rel(gmx, g64),
                "cross_rel": rel(bmx, b64),
                "condition": float(np.linalg.cond(g64)),
                "T_rel": rel(tmx, t64),
                "ppl_float64": ppl["float64"],
                "ppl_mixed": ppl["mixed"],
                "ppl_rel": abs(ppl["mixed"] - ppl["float64"]) / ppl["float64"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return {
        "rows": rows,
        "original_perplexity": original,
        "heldout_tokens": evaluator.count,
        "calibration": [calib.num_samples, args.length],
        "seconds": {p: statistics.median(v) for p, v in times.items()},
    }


def digits_part(args) -> dict:
    model = digits_vit(progress=False)
    train, test = digits("train"), digits("test")
    loader = [torch.from_numpy(train.images[i : i + 64]) for i in range(0, len(train), 64)]
    found: dict[str, Analysis] = {}
    times: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    for _ in range(ROUNDS):
        for p in PRECISIONS:
            start = time.perf_counter()
            found[p] = toast.analyze(model, loader, estimator="gcv", precision=p, progress=False)
            times[p].append(time.perf_counter() - start)
    m64, mmx = found["float64"].moments, found["mixed"].moments
    S = m64.num_states
    blocks = [rel(mmx.cross(i, j), m64.cross(i, j)) for i in range(S) for j in range(i, S)]
    e64 = found["float64"].error_matrix("linear", "gcv")
    emx = found["mixed"].error_matrix("linear", "gcv")
    upper = np.triu(np.ones((S, S), dtype=bool), 1)
    translators = []
    for i in range(S - 1):
        for j in range(i + 1, S):
            w = [toast.fit_translator(m, i, j, kind="affine").weight for m in (m64, mmx)]
            translators.append(rel(w[1], w[0]))
    spans = sorted(((float(e64[i, j]), i, j) for i, j in zip(*np.nonzero(upper), strict=True)))
    accuracies = []
    for _, i, j in [s for s in spans if s[2] - s[1] >= 2][:3]:
        acc = {}
        for p, m in (("float64", m64), ("mixed", mmx)):
            pruned = copy.deepcopy(model)
            toast.io.replace_spans(pruned, [(i, j)], [toast.fit_translator(m, i, j, kind="affine")])
            acc[p] = accuracy(pruned, test.images, test.labels)
        accuracies.append({"span": [int(i), int(j)], **acc})
    return {
        "rows": m64.rows,
        "block_rel_max": max(blocks),
        "block_rel_median": statistics.median(blocks),
        "error_matrix_max_abs": float(np.nanmax(np.abs(emx - e64)[upper])),
        "translator_rel_max": max(translators),
        "translator_rel_median": statistics.median(translators),
        "accuracy": accuracies,
        "seconds": {p: statistics.median(v) for p, v in times.items()},
    }


def markdown(result: dict) -> str:
    s, d = result["smollm2"], result["digits"]
    lines = [
        "# Mixed precision against float64 on real activations",
        "",
        f"SmolLM2-135M-Instruct, ReplaceMe LS statistics, {s['calibration'][0]} × "
        f"{s['calibration'][1]} calibration tokens; held-out perplexity on "
        f"{s['heldout_tokens']:,} tokens (original {s['original_perplexity']:.2f}). Relative "
        "errors are Frobenius norms against the float64 result.",
        "",
        "| cut | MᵀM rel. error | Mᵀ(L−Y) rel. error | cond(MᵀM) | T rel. error "
        "| perplexity float64 | perplexity mixed | rel. change |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in s["rows"]:
        a, b = r["span"]
        lines.append(
            f"| blocks[{a}:{b}] | {r['gram_rel']:.1e} | {r['cross_rel']:.1e} | "
            f"{r['condition']:.1e} | {r['T_rel']:.1e} | {r['ppl_float64']:.3f} | "
            f"{r['ppl_mixed']:.3f} | {r['ppl_rel']:.1e} |"
        )
    lines += [
        "",
        f"Estimation passes (all cuts, forward included): float64 {s['seconds']['float64']:.1f} s, "
        f"mixed {s['seconds']['mixed']:.1f} s (median of {ROUNDS}).",
        "",
        f"digits ViT, all-pairs moments of `toast.analyze` (gcv), {d['rows']:,} rows: cross "
        f"blocks rel. error median {d['block_rel_median']:.1e}, max {d['block_rel_max']:.1e}; "
        f"linear error matrix max abs change {d['error_matrix_max_abs']:.1e}; affine "
        f"translators (every span) rel. error median {d['translator_rel_median']:.1e}, max "
        f"{d['translator_rel_max']:.1e}.",
        "",
        "| span replaced | test accuracy float64 | test accuracy mixed |",
        "|---|---|---|",
    ]
    for a in d["accuracy"]:
        start, stop = a["span"]
        lines.append(f"| blocks[{start}:{stop}] | {a['float64']:.4f} | {a['mixed']:.4f} |")
    m = result["machine"]
    lines += [
        "",
        f"analyze: float64 {d['seconds']['float64']:.2f} s, mixed {d['seconds']['mixed']:.2f} s. "
        + describe(m),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", type=int, default=40, help="sequences (40)")
    parser.add_argument("--heldout", type=int, default=8, help="sequences (8)")
    parser.add_argument("--length", type=int, default=512, help="tokens per sequence (512)")
    parser.add_argument(
        "--spans",
        type=lambda s: tuple(int(v) for v in s.split(":")),
        nargs="+",
        default=[(12, 16), (12, 20), (8, 12), (3, 7)],
        help="cuts as start:stop (toast's 4- and 8-block cuts, a sink window, an early one)",
    )
    parser.add_argument("--out", default=str(ROOT / "results"))
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    before = os.getloadavg()
    result = {"smollm2": smollm2(args), "digits": digits_part(args)}
    result["machine"] = machine(before)
    out = Path(args.out)
    (out / "precision.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    text = markdown(result)
    (out / "precision.md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
