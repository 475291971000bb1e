"""toast.search against the best single method run by hand, at a 20%
parameter target, on SmolLM2-135M-Instruct, the digits ViT and a tiny
random DeiT (head pruning).

For each model: ``toast.search(model, calibration, heldout=selection,
target=0.2)`` is timed from a cold cache (the full cost of a first call),
then each method is run by hand as a user would, with its defaults, at the
smallest setting reaching 20% fewer parameters (ReplaceMe
``num_blocks=n``; TOAST ``budget=n``; ToaSt ``head_sparsity=ρ`` for ViTs).
Every model is evaluated on the search's held-out data (where the search
chose) and on a test split none of them saw (no selection bias); the
digits ViT, whose test split is small, is run twice with the halves
swapped. A second search call with a new target (30%) on the warm cache
counts its calibration passes, its new measurements and its time.

Usage: ``python benchmarks/bench_search.py [--models smollm2,digits,deit]
[--out benchmarks/results/search.json]`` (about 15 minutes on 2 cores).
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
from toast.hf.evaluate.quality import Evaluator  # noqa: E402

TARGET = 0.2


def _evaluate(models: dict[str, torch.nn.Module], test: Any) -> dict[str, float]:
    evaluator = Evaluator(test, progress=False)
    return {name: evaluator.measure(m, name) for name, m in models.items()}


def _smallest(model: torch.nn.Module, params: int, run) -> tuple[Any, Any, Any]:
    """``run(copy, setting)`` for increasing settings until the copy has at
    most (1 - TARGET) of ``params``; returns (model, report, setting)."""
    for setting in run.settings:
        built = copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            built, report = run(built, setting)
        if toast.count_params(built) <= (1 - TARGET) * params:
            return built, report, setting
    raise RuntimeError("no setting reaches the target")


class _Hand:
    def __init__(self, settings, call):
        self.settings, self.call = settings, call

    def __call__(self, model, setting):
        return self.call(model, setting)


def _compare(name: str, model, calib, selection, test, hand: dict[str, _Hand]) -> dict:
    params = toast.count_params(model)
    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        result = toast.search(model, calib, selection, target=TARGET, cache=cache, progress=False)
        first = time.perf_counter() - start
        start = time.perf_counter()
        again = toast.search(model, calib, selection, target=0.3, cache=cache, progress=False)
        second = time.perf_counter() - start
    print(result.to_markdown(), flush=True)
    models = {"original": model, "search": result.model}
    settings, times = {}, {}
    for method, run in hand.items():
        start = time.perf_counter()
        models[method], _, settings[method] = _smallest(model, params, run)
        times[method] = time.perf_counter() - start
    return {
        "model": name,
        "metric": result.metric,
        "chosen": result.best.candidate.label if result.best else None,
        "search_seconds": first,
        "second_call_seconds": second,
        "second_call_passes": again.calibration_passes,
        "second_call_measured_new": sum(not m.cached for m in again.measured),
        "spearman": result.spearman,
        "spearman_by_family": result.spearman_by_family(),
        "measured": len(result.measured),
        "enumerated": result.enumerated,
        "heldout": _evaluate(models, selection),
        "test": _evaluate(models, test),
        "params": {k: toast.count_params(m) for k, m in models.items()},
        "by_hand_settings": settings,
        "by_hand_seconds": times,
        "report": result.to_markdown(),
    }


def smollm2() -> dict:
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
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    first = math.ceil(TARGET * toast.count_params(model) / block)  # fewer cannot reach it
    hand = {
        "replaceme": _Hand(
            range(first, 30),
            lambda m, n: toast.compress(m, calib, method="replaceme", num_blocks=n, progress=False),
        ),
        "toast": _Hand(
            range(first, 30),
            lambda m, n: toast.compress(m, calib, method="toast", budget=n, progress=False),
        ),
    }
    return _compare("SmolLM2-135M-Instruct", model, calib, selection, test, hand)


def _image_batches(images, labels=None, size: int = 128) -> list:
    out = []
    for k in range(0, len(images), size):
        x = torch.as_tensor(images[k : k + size])
        out.append(x if labels is None else (x, torch.as_tensor(labels[k : k + size])))
    return out


def _vit_hand(calib) -> dict[str, _Hand]:
    return {
        "toast": _Hand(
            range(1, 8),
            lambda m, n: toast.compress(m, calib, method="toast", budget=n, progress=False),
        ),
        "replaceme": _Hand(
            range(1, 8),
            lambda m, n: toast.compress(m, calib, method="replaceme", num_blocks=n, progress=False),
        ),
        "toast-vit": _Hand(
            (0.25, 0.5, 0.75, 0.9),
            lambda m, rho: toast.compress(m, None, method="toast-vit", head_sparsity=rho),
        ),
    }


def digits() -> list[dict]:
    from toast.data import digits as load

    model = toast.zoo.digits_vit(progress=False)
    train, test = load("train"), load("test")
    # the ViT was trained on the whole training split: the search's held-out
    # data and the test data both come from the test split, two disjoint
    # halves, each in turn (250 images resolve 0.004: two folds halve that)
    calib = _image_batches(train.images[:512])
    halves = [
        _image_batches(test.images[:250], test.labels[:250]),
        _image_batches(test.images[250:], test.labels[250:]),
    ]
    return [
        _compare(
            f"digits ViT (fold {k + 1})", model, calib, halves[k], halves[1 - k], _vit_hand(calib)
        )
        for k in range(2)
    ]


def deit() -> dict:
    import transformers

    torch.manual_seed(0)
    config = transformers.DeiTConfig(
        hidden_size=192,
        num_hidden_layers=6,
        num_attention_heads=3,
        intermediate_size=768,
        image_size=64,
        patch_size=16,
    )
    model = transformers.DeiTModel(config).eval()
    g = torch.Generator().manual_seed(1)
    images = torch.randn(384, 3, 64, 64, generator=g)
    calib = [images[k : k + 64] for k in range(0, 256, 64)]
    selection = [images[256:320]]
    test = [images[320:384]]
    return _compare("tiny random DeiT", model, calib, selection, test, _vit_hand(calib))


def _table(results: list[dict]) -> str:
    lines = [
        "| model | metric | split | original | toast.search (chosen) | best by hand | by hand |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for r in results:
        higher = r["metric"] != "perplexity"
        for split in ("heldout", "test"):
            scores = r[split]
            hand = {k: v for k, v in scores.items() if k not in ("original", "search")}
            best = (max if higher else min)(hand, key=hand.get)
            spec = ".2f" if r["metric"] == "perplexity" else ".4f"
            others = ", ".join(f"{k} {v:{spec}}" for k, v in hand.items())
            lines.append(
                f"| {r['model']} | {r['metric']} | {split} | {scores['original']:{spec}} "
                f"| {scores['search']:{spec}} ({r['chosen']}) | {scores[best]:{spec}} ({best}) "
                f"| {others} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2,digits,deit")
    parser.add_argument("--out", default="benchmarks/results/search.json")
    args = parser.parse_args()
    load = os.getloadavg()
    runs = {"smollm2": smollm2, "digits": digits, "deit": deit}
    results: list[dict] = []
    for name in args.models.split(","):
        found = runs[name]()
        results += found if isinstance(found, list) else [found]
    record = {"machine": _machine.machine(load), "target": TARGET, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            record,
            indent=1,
            default=lambda v: None if isinstance(v, float) and math.isnan(v) else str(v),
        )
    )
    for r in results:
        print(
            f"\n{r['model']}: {r['metric']} on the test split",
            {k: round(v, 4) for k, v in r["test"].items()},
            "held-out",
            {k: round(v, 4) for k, v in r["heldout"].items()},
            f"search {r['search_seconds']:.0f} s; second call {r['second_call_seconds']:.0f} s, "
            f"{r['second_call_passes']} calibration passes; Spearman {r['spearman']:+.2f}",
        )
    table = _table(results)
    print("\n" + table)
    print(_machine.describe(record["machine"]))
    md = Path(args.out).with_suffix(".md")
    reports = "\n\n".join(f"### {r['model']}\n\n{r['report']}" for r in results)
    md.write_text(
        f"# toast.search at a {TARGET:.0%} parameter target\n\n{table}\n\n"
        f"{_machine.describe(record['machine'])}\n\n{reports}\n"
    )


if __name__ == "__main__":
    main()
