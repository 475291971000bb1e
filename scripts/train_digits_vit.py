"""Trains the digits ViT that ships in the package (``toast/weights``) and
records how it was chosen.

Training is chaotic across CPUs (the same seed gives 0.962 to 0.976 test
accuracy on different machines), so ``toast.zoo.digits_vit()`` loads
shipped weights instead of training: the demo is then the same model
everywhere. Which weights is decided by a rule fixed before any test figure
is seen:

1. train the recipe (``toast.zoo._train_digits_vit``: 40 epochs, AdamW,
   one-cycle) with seeds 0 to 4 for the initial weights and the batch order,
   on the first 90% of ``toast.data.digits("train")`` (split seed 0, the
   split the demo reports its test accuracy beside);
2. score each on the last 10% of that split (130 images): the highest
   accuracy wins, ties going to the lower mean cross-entropy there;
3. train the winning seed on the whole training split (1,297 images) and
   write that model.

The 500-image test split is never looked at until the model is written;
its accuracy is printed last, for the docs.

Usage: python scripts/train_digits_vit.py [--seeds 0 1 2 3 4] [--out FILE]
(about six trainings of half a minute to a minute each on two cores).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from toast import zoo
from toast.data import Digits, digits
from toast.zoo import DIGITS_VIT, accuracy, digits_vit_weights

EPOCHS = zoo._SHIPPED_EPOCHS
# The demo's split, for every candidate: the recipe's own split follows its
# seed, and another seed's training split holds most of split 0's test images.
SPLIT_SEED = zoo._SHIPPED_SPLIT_SEED
VALIDATION = 0.1


def _mean_loss(model: torch.nn.Module, data: Digits) -> float:
    with torch.inference_mode():
        logits = model(pixel_values=torch.from_numpy(data.images)).logits
        return float(torch.nn.functional.cross_entropy(logits, torch.from_numpy(data.labels)))


def choose(seeds: list[int]) -> tuple[int, list[dict]]:
    """Each seed's validation figures, and the seed the rule picks."""
    train = digits("train", seed=SPLIT_SEED)
    held = round(VALIDATION * len(train))
    fit = Digits(train.images[:-held], train.labels[:-held])
    val = Digits(train.images[-held:], train.labels[-held:])
    rows = []
    for seed in seeds:
        start = time.perf_counter()
        model = zoo._train_digits_vit(seed, EPOCHS, progress=False, train=fit)
        row = {
            "seed": seed,
            "fit_images": len(fit),
            "validation_images": len(val),
            "validation_accuracy": accuracy(model, val.images, val.labels),
            "validation_loss": _mean_loss(model, val),
            "seconds": round(time.perf_counter() - start, 1),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    best = min(rows, key=lambda r: (-r["validation_accuracy"], r["validation_loss"]))
    return best["seed"], rows


def write(seed: int, rows: list[dict], out: Path) -> torch.nn.Module:
    from safetensors.torch import save_file

    model = zoo._train_digits_vit(
        seed, EPOCHS, progress=False, train=digits("train", seed=SPLIT_SEED)
    )
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    metadata = {
        "recipe": zoo._RECIPE,
        "seed": str(seed),
        "split_seed": str(SPLIT_SEED),
        "epochs": str(EPOCHS),
        "config": json.dumps(DIGITS_VIT, sort_keys=True),
        "choice": json.dumps(rows),
        "torch": torch.__version__,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out), metadata=metadata)
    out.chmod(0o644)  # save_file writes 0600: an installed wheel must be readable by all
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--out", type=Path, default=digits_vit_weights())
    args = parser.parse_args(argv)
    seed, rows = choose(args.seeds)
    print(f"chosen: seed {seed}", flush=True)
    if seed != zoo._SHIPPED_SEED:
        print(f"set toast.zoo._SHIPPED_SEED = {seed} (digits_vit(retrain=True) trains it)")
    model = write(seed, rows, args.out)
    test = digits("test", seed=SPLIT_SEED)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out} ({params:,} parameters)")
    print(f"test accuracy (500 images): {accuracy(model, test.images, test.labels):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
