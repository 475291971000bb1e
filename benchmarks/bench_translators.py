"""TOAST's closed-form translators side by side on the real pretrained
encoders: is LinearPatch's form (fitted by least squares, or least squares
shrunk towards it) as good as the affine default where the LLM table of
``bench_peers.py`` found it at least as good?

Models and data, all offline and real:

- DINOv2 ViT-S/14 (``toast.zoo.dinov2_vits14``, 12 blocks, width 384) at
  224 × 224: calibration ``--images`` crops of scikit-image's photographs
  (seed 0), scored on ``--images`` other crops (seed 2), by the cosine of
  the CLS feature (``pooler_output``) to the original's;
- all-MiniLM-L6-v2 (6 blocks, width 384): calibration and scoring on
  disjoint stdlib docstring sentences (``--texts`` each, 16 a batch),
  scored by the cosine of the mean-pooled sentence embedding to the
  original's.

Rows: ``toast.compress(model, data, budget=k, translator=...)`` for every
closed-form kind compared (``affine``: the default), each call with all its
defaults (its own analysis pass, the held-out check on one batch in ten
when there are ten). Columns: the mean cosine at every budget, the spans
chosen and the parameters added.

Usage: ``python benchmarks/bench_translators.py [--images 96] [--texts 320]
[--out benchmarks/results/translators.json]`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _machine  # noqa: E402

import toast  # noqa: E402
import toast.zoo  # noqa: E402
from toast.data import natural_images, stdlib_sentences  # noqa: E402

KINDS = ("affine", "linear", "rotated_diagonal", "patch_ridge")
RESULTS = Path(__file__).resolve().parent / "results"


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = torch.nn.functional.normalize(a, dim=-1), torch.nn.functional.normalize(b, dim=-1)
    return float((a * b).sum(-1).mean())


def _vit(images: int) -> tuple[torch.nn.Module, list, list, Callable]:
    model = toast.zoo.dinov2_vits14().eval()
    calib = torch.from_numpy(natural_images(images, seed=0))
    test = torch.from_numpy(natural_images(images, seed=2))

    def embed(m: torch.nn.Module, batches: list) -> torch.Tensor:
        with torch.inference_mode():
            return torch.cat([m(pixel_values=b).pooler_output for b in batches])

    return model, list(calib.split(32)), list(test.split(32)), embed


def _minilm(texts: int) -> tuple[torch.nn.Module, list, list, Callable]:
    from transformers import AutoModel, AutoTokenizer

    path = toast.zoo.minilm_path()
    model, tokenizer = AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    sentences = stdlib_sentences(limit=2 * texts)
    options = {"padding": True, "truncation": True, "max_length": 128, "return_tensors": "pt"}

    def batches(part: list[str]) -> list[dict]:
        return [dict(tokenizer(part[i : i + 16], **options)) for i in range(0, len(part), 16)]

    def embed(m: torch.nn.Module, loader: list) -> torch.Tensor:
        out = []
        with torch.inference_mode():
            for batch in loader:
                hidden = m(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                out.append((hidden * mask).sum(1) / mask.sum(1))
        return torch.cat(out)

    return model, batches(sentences[:texts]), batches(sentences[texts:]), embed


def measure(name: str, loaded: tuple, budgets: list[int]) -> list[dict[str, Any]]:
    model, calib, test, embed = loaded
    reference = embed(model, test)
    params = toast.count_params(model)
    rows = []
    for k in budgets:
        for kind in KINDS:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                built, report = toast.compress(
                    copy.deepcopy(model), calib, budget=k, translator=kind, progress=False
                )
            row = {
                "model": name,
                "budget": k,
                "translator": kind,
                "spans": [[s.start, s.stop] for s in report.spans],
                "params_added": toast.count_params(built) - params + _removed(model, report),
                "cosine": _cosine(embed(built, test), reference),
            }
            print(row, flush=True)
            rows.append(row)
    return rows


def _removed(model: torch.nn.Module, report: Any) -> int:
    """Parameters of the blocks the report's spans removed."""
    from toast.hf.model.blocks import find_blocks

    blocks = find_blocks(model).blocks
    return sum(
        p.numel()
        for s in report.spans
        for b in range(s.start, s.stop)
        for p in blocks[b].parameters()
    )


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | blocks removed | " + " | ".join(KINDS) + " |",
        "|---|---:|" + "---:|" * len(KINDS),
    ]
    keys = sorted({(r["model"], r["budget"]) for r in rows})
    for model, k in keys:
        got = {r["translator"]: r for r in rows if (r["model"], r["budget"]) == (model, k)}
        best = max(r["cosine"] for r in got.values())
        cells = []
        for kind in KINDS:
            r = got.get(kind)
            text = "—" if r is None else f"{r['cosine']:.4f}"
            cells.append(f"**{text}**" if r is not None and r["cosine"] == best else text)
        lines.append(f"| {model} | {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=96)
    parser.add_argument("--texts", type=int, default=320)
    parser.add_argument("--out", default=str(RESULTS / "translators.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    np.random.seed(0)
    load = os.getloadavg()
    rows = measure("DINOv2 ViT-S/14", _vit(args.images), [1, 2, 3, 4])
    rows += measure("all-MiniLM-L6-v2", _minilm(args.texts), [1, 2])
    record = {"machine": _machine.machine(load), "rows": rows, "args": vars(args)}
    out = Path(args.out)
    out.write_text(json.dumps(record, indent=1))
    text = (
        "# TOAST's closed-form translators on real encoders\n\n"
        "Mean cosine of the compressed model's embedding to the original's on data no "
        "fit saw (DINOv2: CLS feature of photo crops; MiniLM: mean-pooled sentence "
        "embedding), `toast.compress(budget=k, translator=...)` with every other "
        f"default.\n\n{table(rows)}\n\n{_machine.describe(record['machine'])}\n"
    )
    out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
