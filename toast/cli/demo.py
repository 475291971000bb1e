"""The embedded default job: compress a real (small) ViT end to end, offline.

``python -m toast demo`` loads the ViT trained on scikit-learn's digits
that ships in the package (``--retrain`` or another ``--seed`` trains one:
:func:`toast.zoo.digits_vit`), measures its block error matrix on 512 calibration
images, plans the spans to replace, replaces them with closed-form affine
translators, and writes ``heatmap.png``, ``report.md`` and ``result.json`` (spans, predicted
errors, accuracy before and after, with plain block removal as the baseline,
parameters, MACs and wall-clock before and after) into the output folder.
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from toast._validation import Interval, check, merge_alias

__all__ = ["DemoResult", "run_demo"]


@dataclass
class DemoResult:
    """What the demo measured (every number of the report)."""

    out: Path
    spans: list = field(default_factory=list)
    accuracy: dict[str, float] = field(default_factory=dict)
    params: dict[str, int] = field(default_factory=dict)
    gmacs: dict[str, float] = field(default_factory=dict)
    latency_ms: dict[str, float] = field(default_factory=dict)
    rounds_ms: dict[str, list[float]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    checks: list = field(default_factory=list)

    def to_dict(self) -> dict:
        """The figures as ``result.json`` holds them (what the README quotes:
        ``scripts/check_docs.py``)."""
        return {
            "spans": [[s.start, s.stop] for s in self.spans],
            "papers": [s.paper for s in self.spans],
            "accuracy": {k: round(v, 3) for k, v in self.accuracy.items()},
            "params": self.params,
            "mmacs": {k: round(1e3 * v, 2) for k, v in self.gmacs.items()},
            "checks": [
                {
                    "span": [c.span.start, c.span.stop],
                    "metric": c.metric,
                    "fitted": round(c.fitted, 4),
                    "plain": round(c.plain, 4),
                    "count": c.count,
                    "used": c.used,
                }
                for c in self.checks
                if c is not None
            ],
            # timings vary run to run: quoted as rounded, never compared
            "latency_ms": {k: round(v, 1) for k, v in self.latency_ms.items()},
            "speedup": _spread(_speedups(self.rounds_ms)) if self.rounds_ms else {},
            "seconds": {k: round(v, 1) for k, v in self.seconds.items()},
        }


def _spread(ratios: list[float]) -> dict[str, float]:
    """Median and quartiles of the per-round speed-ups (what the README quotes
    as a range: one round's load says little, the middle half says more)."""
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return {"median": round(median, 2), "q1": round(q1, 2), "q3": round(q3, 2)}


def _say(message: str, quiet: bool) -> None:
    if not quiet:
        print(f"[toast demo] {message}", file=sys.stderr, flush=True)


def _latencies_ms(models: dict, images: np.ndarray, rounds: int = 15) -> dict[str, list[float]]:
    """Wall-clock of one forward pass over ``images`` per model and round
    (milliseconds). The models take turns within each round, so that a change
    of the machine's load falls on all of them alike."""
    import torch

    x = torch.from_numpy(images)
    times: dict[str, list[float]] = {name: [] for name in models}
    with torch.inference_mode():
        for model in models.values():
            model(pixel_values=x)  # warm-up
        for _ in range(rounds):
            for name, model in models.items():
                start = time.perf_counter()
                model(pixel_values=x)
                times[name].append(1e3 * (time.perf_counter() - start))
    return times


def _speedups(times: dict[str, list[float]]) -> list[float]:
    """The original's time over the compressed model's, round by round."""
    return sorted(a / b for a, b in zip(times["original"], times["compressed"], strict=True))


def run_demo(
    out: str | Path = "toast-demo",
    num_blocks: int | None = None,
    calibration: int = 512,
    seed: int = 0,
    cache: str | Path | None = None,
    retrain: bool = False,
    progress: bool = True,
    *,
    budget: int | None = None,
) -> DemoResult:
    """Runs the demo, removing ``num_blocks`` blocks (None: 2; ``budget``:
    another name for it, the TOAST paper's); writes ``heatmap.png``, ``report.md`` and
    ``result.json`` into ``out``."""
    import torch

    import toast
    from toast.data import digits
    from toast.zoo import accuracy, digits_vit

    for name, value in (("num_blocks", num_blocks), ("budget", budget)):
        check(name, value, Interval(int, 1, None), None)
    num_blocks = merge_alias("num_blocks", num_blocks, "budget", budget) or 2
    quiet = not progress
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    result = DemoResult(out)
    clock = time.perf_counter()

    _say("1/4 the digits ViT (shipped trained; another seed trains once, then cached)", quiet)
    model = digits_vit(seed=seed, cache=cache, retrain=retrain, progress=progress)
    result.seconds["model"] = time.perf_counter() - clock
    test = digits("test", seed=seed)
    train = digits("train", seed=seed)
    calib = train.images[:calibration]
    batches = [torch.from_numpy(calib[k : k + 128]) for k in range(0, len(calib), 128)]

    _say(f"2/4 the block error matrix from {len(calib)} calibration images", quiet)
    start = time.perf_counter()
    with warnings.catch_warnings():
        # The embedding output of 8x8 digits is rank-deficient (blank border
        # patches); spans starting at the embeddings are never planned.
        warnings.simplefilter("ignore", toast.core.IllConditionedWarning)
        analysis = toast.analyze(model, batches, metric="linear", estimator="cv", progress=progress)
    spans = analysis.plan(max_blocks=num_blocks)
    result.seconds["analyze"] = time.perf_counter() - start
    result.spans = spans
    fig = analysis.heatmap(spans=spans, title="digits ViT: held-out linear error")
    fig.savefig(out / "heatmap.png", dpi=120, bbox_inches="tight")

    _say("3/4 replacing the planned spans (and, as the baseline, dropping them)", quiet)
    original = copy.deepcopy(model)
    dropped = copy.deepcopy(model)
    toast.io.replace_spans(
        dropped, [(s.start, s.stop) for s in spans], [torch.nn.Identity()] * len(spans)
    )
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", toast.core.IllConditionedWarning)
        compressed, report = toast.compress(
            model, batches, spans=[(s.start, s.stop) for s in spans], progress=progress
        )
    result.seconds["compress"] = time.perf_counter() - start
    result.checks = list(report.checks)

    _say("4/4 measuring accuracy, size and speed", quiet)
    image_size = original.config.image_size  # type: ignore[union-attr]
    for name, m in (("original", original), ("dropped", dropped), ("compressed", compressed)):
        result.accuracy[name] = accuracy(m, test.images, test.labels)
        result.params[name] = toast.count_params(m)
        result.gmacs[name] = toast.macs(m, image_size=image_size).gmacs
    result.rounds_ms = _latencies_ms({"original": original, "compressed": compressed}, test.images)
    result.latency_ms = {k: statistics.median(v) for k, v in result.rounds_ms.items()}
    result.seconds["total"] = time.perf_counter() - clock
    (out / "report.md").write_text(_report(result, analysis, report), encoding="utf-8")
    (out / "result.json").write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    print(_summary(result), flush=True)  # the result: shown with or without progress
    return result


def _report(result: DemoResult, analysis, report) -> str:
    acc, params, gmacs, lat = result.accuracy, result.params, result.gmacs, result.latency_ms
    lines = [
        "# toast demo: the digits ViT",
        "",
        "A ViT (8 blocks, width 64, 2×2 patches) trained on scikit-learn's digits "
        "(1,297 training scans, 500 held out). The block error matrix comes from "
        f"{analysis.rows:,} token rows of the first 512 training images (held-out "
        "linear error, 5 folds); the plan removes the most blocks within the budget "
        "at the least total predicted error, keeping a block between spans.",
        "",
        "![block error matrix](heatmap.png)",
        "",
        "## Top single spans",
        "",
        "| blocks | paper (s→e) | predicted error |",
        "|---|---|---:|",
    ]
    for span in analysis.top_spans(5):
        lines.append(f"| [{span.start}:{span.stop}] | {span.paper} | {span.error:.4f} |")
    lines += ["", "## Result", "", report.to_markdown(), ""]
    lines += [
        "| model | test accuracy | parameters | MACs (M) | latency, 500 images (ms) |",
        "|---|---:|---:|---:|---:|",
        f"| original | {acc['original']:.3f} | {params['original']:,} | "
        f"{1e3 * gmacs['original']:.2f} | {lat['original']:.1f} |",
        f"| spans dropped (identity) | {acc['dropped']:.3f} | {params['dropped']:,} | "
        f"{1e3 * gmacs['dropped']:.2f} | |",
        f"| toast (affine translators) | {acc['compressed']:.3f} | {params['compressed']:,} | "
        f"{1e3 * gmacs['compressed']:.2f} | {lat['compressed']:.1f} |",
        "",
        f"Speed-up {_speedup_words(result)} (batch 500, CPU; the two models timed in turns, "
        f"{len(result.rounds_ms['original'])} rounds). MACs per image, "
        "analytic (`toast.macs`).",
        "",
        "Wall-clock of this run: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in result.seconds.items())
        + ".",
        "",
    ]
    return "\n".join(lines)


def _speedup_words(result: DemoResult) -> str:
    s = _spread(_speedups(result.rounds_ms))
    return f"{s['median']:.2f}× (middle half of the rounds {s['q1']:.2f}–{s['q3']:.2f}×)"


def _summary(result: DemoResult) -> str:
    acc = result.accuracy
    spans = ", ".join(f"blocks[{s.start}:{s.stop}] ({s.paper})" for s in result.spans)
    checked = [c for c in result.checks if c is not None]
    speed = f"{_spread(_speedups(result.rounds_ms))['median']:.2f}×"
    held_out = (
        "held-out check: "
        + ", ".join(f"fitted {c.fitted:.4f} vs removal {c.plain:.4f} {c.metric}" for c in checked)
        if checked
        else "no held-out check"
    )
    return (
        f"toast demo: replaced {spans}; accuracy {acc['original']:.3f} → "
        f"{acc['compressed']:.3f} (dropping them instead: {acc['dropped']:.3f}); {held_out}; "
        f"parameters {result.params['original']:,} → {result.params['compressed']:,}; "
        f"MACs {1e3 * result.gmacs['original']:.2f} M → {1e3 * result.gmacs['compressed']:.2f} M "
        f"per image; {speed} faster on 500 images; "
        f"wrote {result.out / 'report.md'} and {result.out / 'heatmap.png'} "
        f"in {result.seconds['total']:.0f} s"
    )
