"""TOAST Figure 5 at this machine's scale: accuracy against calibration samples.

For the digits ViT (``toast.zoo.digits_vit``), each span's affine translator
is fitted on the first ``n`` images of a seeded random order of the training
split (all tokens) and the patched model is evaluated on the 500 held-out
images. Writes ``results/calibration_curve.png`` and
``results/calibration_curve.md``.

    python benchmarks/bench_calibration_curve.py [--seeds 3]
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings
from pathlib import Path

import numpy as np
import torch

import toast
from toast.data import digits
from toast.zoo import accuracy, digits_vit

SIZES = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
SPANS = ((1, 3), (4, 6), (6, 8))
RESULTS = Path(__file__).resolve().parent / "results"


def _accuracy_after(model, images: np.ndarray, span, test) -> float:
    batches = [torch.from_numpy(images[k : k + 128]) for k in range(0, len(images), 128)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m, _ = toast.hf.capture_moments(model, batches, states=list(span), folds=0, progress=False)
        # a small relative ridge keeps the fits from a handful of rows well posed
        t = toast.fit_translator(m, 0, 1, kind="affine", ridge=1e-3, ridge_relative=True)
    patched = copy.deepcopy(model)
    toast.io.replace_spans(patched, [span], [t])
    return accuracy(patched, test.images, test.labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = digits_vit(progress=True)
    test, train = digits("test"), digits("train")
    base = accuracy(model, test.images, test.labels)
    start = time.perf_counter()
    curves = {span: np.zeros((args.seeds, len(SIZES))) for span in SPANS}
    for seed in range(args.seeds):
        order = np.random.default_rng(seed).permutation(len(train))
        for span in SPANS:
            for k, n in enumerate(SIZES):
                curves[span][seed, k] = _accuracy_after(model, train.images[order[:n]], span, test)
    elapsed = time.perf_counter() - start

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    RESULTS.mkdir(exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for span, values in curves.items():
        mean, std = values.mean(0), values.std(0)
        label = f"blocks[{span[0]}:{span[1]}] ({span[0] - 1}→{span[1] - 1})"
        ax.errorbar(SIZES, mean, yerr=std, marker="o", capsize=3, label=label)
    ax.axhline(base, color="k", ls="--", lw=1, label="original")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("calibration images (17 tokens each)")
    ax.set_ylabel("test accuracy")
    ax.set_title("digits ViT: affine translator vs calibration size")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "calibration_curve.png", dpi=120)

    lines = [
        "# Accuracy against calibration samples (TOAST Fig. 5, digits ViT)",
        "",
        f"`python benchmarks/bench_calibration_curve.py --seeds {args.seeds}`; mean ± std over "
        f"{args.seeds} random calibration orders; original accuracy {base:.3f}; "
        f"{elapsed:.0f} s.",
        "",
        "| span | " + " | ".join(str(n) for n in SIZES) + " |",
        "|---|" + "---:|" * len(SIZES),
    ]
    for span, values in curves.items():
        cells = " | ".join(
            f"{m:.3f}±{s:.3f}" for m, s in zip(values.mean(0), values.std(0), strict=True)
        )
        lines.append(f"| {span[0] - 1}→{span[1] - 1} | {cells} |")
    lines += ["", "![curve](calibration_curve.png)", ""]
    (RESULTS / "calibration_curve.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
