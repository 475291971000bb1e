"""Fidelity to the original on a real LLM: perplexity, KL and top-1
agreement of SmolLM2-135M-Instruct compressed by 20% of its parameters,
and ``toast.search`` following each objective.

Data as ``bench_search.py`` (stdlib docstring sentences packed into 256
tokens: 32 calibration sequences, 16 held out for the search's selection,
16 more for a test split nobody selects on). Rows: the original; plain
removal, ReplaceMe and TOAST by hand at the smallest setting reaching the
target (each method's defaults); ``toast.search``'s choice with
``objective="perplexity"`` (cold cache, timed) and with ``objective="kl"``
(the same cache: no calibration pass, nothing measured again). Every row
is measured by one :class:`toast.hf.evaluate.quality.Evaluator` per split
(perplexity, mean KL(original ‖ model) per predicted token, its 99th
percentile, top-1 agreement; the KL over the original's top-k tokens and a
rest bucket, whose mass is printed). The KL-objective front is listed with
its sizes to show it is ordered by measured KL.

Usage: ``python benchmarks/bench_fidelity.py [--out benchmarks/results/fidelity.json]``
(about 15 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _machine  # noqa: E402

import toast  # noqa: E402
import toast.zoo  # noqa: E402
from toast.hf.evaluate.fidelity import DEFAULT_TOP_K  # noqa: E402
from toast.hf.evaluate.quality import Evaluator  # noqa: E402

TARGET = 0.2
_COLUMNS = (
    ("perplexity", "perplexity ↓", ".2f"),
    ("kl", "KL ↓", ".4f"),
    ("kl_p99", "KL p99 ↓", ".3f"),
    ("agreement", "top-1 agreement ↑", ".4f"),
)


def data() -> tuple[Any, Any, Any, Any, Any]:
    from toast.data import stdlib_sentences
    from toast.hf.data.text import TextData

    gguf = toast.zoo.smollm2_gguf()
    model = toast.load_model(gguf).eval()
    tokenizer = toast.load_tokenizer(gguf)
    sentences = stdlib_sentences(limit=None)
    half, quarter = len(sentences) // 2, len(sentences) // 4
    options: dict[str, Any] = {"max_length": 256, "pack": True, "batch_size": 4}
    calib = TextData(sentences[:half], tokenizer, num_samples=32, **options)
    selection = TextData(sentences[half : half + quarter], tokenizer, num_samples=16, **options)
    test = TextData(sentences[half + quarter :], tokenizer, num_samples=16, **options)
    return model, tokenizer, calib, selection, test


def _smallest(model: torch.nn.Module, method: str, key: str, calib: Any) -> tuple[Any, int]:
    """``method`` at the smallest setting reaching the target; (model, setting)."""
    params = toast.count_params(model)
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    for n in range(math.ceil(TARGET * params / block), 30):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            built, _ = toast.compress(
                copy.deepcopy(model), calib, method=method, progress=False, **{key: n}
            )
        if toast.count_params(built) <= (1 - TARGET) * params:
            return built, n
    raise RuntimeError(f"{method} cannot reach the target")


def _measured(models: dict[str, torch.nn.Module], split: Any) -> dict[str, dict[str, float]]:
    evaluator = Evaluator(split, progress=False)  # the original first: the reference
    out = {}
    for name, model in models.items():
        evaluator.measure(model, name)
        out[name] = dict(evaluator.last)
    return out


def _search(model: Any, calib: Any, selection: Any, cache: str, objective: str) -> tuple:
    start = time.perf_counter()
    # quality only: throughput is bench_search's (timing beside other work misleads)
    result = toast.search(
        model,
        calib,
        selection,
        target=TARGET,
        cache=cache,
        objective=objective,
        latency=False,
        progress=False,
    )
    return result, time.perf_counter() - start


def _front(result: Any) -> list[dict[str, Any]]:
    rows = []
    for k in sorted(result.front, key=lambda k: result.measured[k].measurement.params):
        m = result.measured[k]
        rows.append(
            {
                "candidate": m.candidate.label,
                "params": m.measurement.params,
                **m.measurement.metrics,
            }
        )
    return rows


def run() -> dict[str, Any]:
    model, _, calib, selection, test = data()
    with tempfile.TemporaryDirectory() as cache:
        by_ppl, first = _search(model, calib, selection, cache, "perplexity")
        by_kl, second = _search(model, calib, selection, cache, "kl")
    print(by_kl.to_markdown(), flush=True)
    replaceme, n = _smallest(model, "replaceme", "num_blocks", calib)
    toast_model, budget = _smallest(model, "toast", "budget", calib)
    plain, _ = _smallest(model, "remove", "num_blocks", calib)
    models = {
        "original": model,
        "plain removal": plain,
        f"ReplaceMe (num_blocks={n})": replaceme,
        f"TOAST (budget={budget})": toast_model,
        f"toast.search, perplexity: {by_ppl.best.candidate.label}": by_ppl.model,
        f"toast.search, kl: {by_kl.best.candidate.label}": by_kl.model,
    }
    return {
        "target": TARGET,
        "top_k": DEFAULT_TOP_K,
        "search_seconds": {"perplexity (cold cache)": first, "kl (warm cache)": second},
        "kl_call_passes": by_kl.calibration_passes,
        "kl_call_measured_new": sum(not m.cached for m in by_kl.measured),
        "params": {k: toast.count_params(m) for k, m in models.items()},
        "heldout": _measured(models, selection),
        "test": _measured(models, test),
        "kl_front": _front(by_kl),
        "perplexity_front": _front(by_ppl),
        "report_kl": by_kl.to_markdown(),
    }


def _table(record: dict[str, Any], split: str) -> str:
    head = "| model | params | " + " | ".join(n for _, n, _ in _COLUMNS) + " |"
    lines = [head, "|---|---:|" + "---:|" * len(_COLUMNS)]
    for name, metrics in record[split].items():
        cells = [f"{metrics[k]:{spec}}" for k, _, spec in _COLUMNS]
        lines.append(f"| {name} | {record['params'][name]:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/fidelity.json")
    args = parser.parse_args()
    load = os.getloadavg()
    record = run()
    record["machine"] = _machine.machine(load)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, default=str))
    tail = record["test"]["original"].get("tail_mass", math.nan)
    front = "\n".join(
        f"- {r['candidate']}: {r['params']:,} parameters, KL {r['kl']:.4f}"
        for r in record["kl_front"]
    )
    text = (
        f"# SmolLM2-135M-Instruct at {TARGET:.0%} fewer parameters: fidelity to the original\n\n"
        f"## Test split (16 × 256 tokens nobody selected on)\n\n{_table(record, 'test')}\n\n"
        f"## Held-out split (the search's selection)\n\n{_table(record, 'heldout')}\n\n"
        f"KL over the original's {record['top_k']:,} most likely tokens and one bucket for "
        f"the rest (a lower bound); the rest held {tail:.2g} of the original's probability "
        "on average.\n\n"
        f"Searches: {record['search_seconds']}; the kl call made "
        f"{record['kl_call_passes']} calibration passes and measured "
        f"{record['kl_call_measured_new']} candidates anew.\n\n"
        f"## The KL-objective front, smallest first\n\n{front}\n\n"
        f"{_machine.describe(record['machine'])}\n\n## The KL search's report\n\n"
        f"{record['report_kl']}\n"
    )
    out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
