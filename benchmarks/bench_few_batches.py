"""The defaults with few calibration batches, on a real LLM: SmolLM2-135M-Instruct
compressed with 8 calibration batches of 4 x 512 tokens.

With ``check_fraction=0.1`` the old rule held out one batch in every ten,
so 8 batches held out none: TOAST's gate against plain removal, ReplaceMe's
measured cut and its measured placement fell back to unmeasured
predictions. Now the last batch is held out when the data have at least 2
batches but fewer than one group (:class:`toast.hf.evaluate.check.CheckSplit`).
At 4 and 8 blocks removed this measures, on 16 x 512 held-out test tokens
nothing was fitted or chosen on:

- ``replaceme``: toast's ReplaceMe default (``num_blocks=n``);
- ``replaceme_block``: the block placement of the same cut (the transform kept
  as a separate linear block after the cut, ``spans=`` the default's cut,
  ``placement="block"``, fitted on every batch: ``check_fraction=0``);
- ``toast``: TOAST's default (``toast.compress(model, calib, budget=n)``);
- ``toast_no_refit``: the same with ``refit=False`` (the translator the check
  measured, fitted without the held-out batch; the default before the refit).

Data as ``bench_fidelity.py``'s ``data()`` with ``max_length=512``: the
calibration batches from the first half of ``toast.data.stdlib_sentences``,
the test tokens from the last quarter. One thread (``torch.set_num_threads(1)``).

Usage: ``python benchmarks/bench_few_batches.py --label after`` (``--label
before`` on the commit before the change); ``--rows toast toast_no_refit
--label refit`` measures those rows alone. Each run adds its label to
``benchmarks/results/few_batches.json`` (kept labels are merged) and writes
``few_batches.md`` from every label present.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
# this checkout's package, not whichever one the environment installed
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import _machine  # noqa: E402

import toast  # noqa: E402
import toast.zoo  # noqa: E402
from toast.hf.evaluate.quality import Evaluator  # noqa: E402

BLOCKS = (4, 8)
RESULTS = Path(__file__).resolve().parent / "results"
ROWS = (
    ("replaceme", "ReplaceMe default"),
    ("replaceme_block", "ReplaceMe, block placement of the same cut"),
    ("toast", "TOAST default"),
    ("toast_no_refit", "TOAST default, refit=False"),
)
#: What a run measures unless told (``--rows``).
DEFAULT_ROWS = ("replaceme", "replaceme_block", "toast")


def data() -> tuple[Any, Any, Any]:
    from toast.data import stdlib_sentences
    from toast.hf.data.text import TextData

    gguf = toast.zoo.smollm2_gguf()
    model = toast.load_model(gguf).eval()
    tokenizer = toast.load_tokenizer(gguf)
    sentences = stdlib_sentences(limit=None)
    half, quarter = len(sentences) // 2, len(sentences) // 4
    options: dict[str, Any] = {"max_length": 512, "pack": True, "batch_size": 4}
    calib = TextData(sentences[:half], tokenizer, num_samples=32, **options)
    test = TextData(sentences[half + quarter :], tokenizer, num_samples=16, **options)
    return model, calib, test


def _compress(model: torch.nn.Module, calib: Any, **options: Any) -> tuple[Any, Any, float]:
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built, report = toast.compress(copy.deepcopy(model), calib, progress=False, **options)
    return built, report, time.perf_counter() - start


def run(
    label: str,
    blocks: tuple[int, ...] = BLOCKS,
    out: Path | None = None,
    wanted: tuple[str, ...] = DEFAULT_ROWS,
) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    load = os.getloadavg()
    model, calib, test = data()
    evaluator = Evaluator(test, progress=False)
    record: dict[str, Any] = {"original": evaluator.measure(model, "original"), "blocks": {}}
    assert toast.__file__.startswith(str(Path(__file__).resolve().parent.parent))
    for n in blocks:
        rows: dict[str, Any] = {}
        cut = None
        if "replaceme" in wanted or "replaceme_block" in wanted:
            built, report, seconds = _compress(model, calib, method="replaceme", num_blocks=n)
            cut = [(s.start, s.stop) for s in report.spans]
            rows["replaceme"] = {
                "perplexity": evaluator.measure(built, f"replaceme {n}"),
                "cut": cut,
                "placement": report.placement,
                "structure": report.structure,
                "check_note": report.check_note,
                "placement_note": report.placement_note,
                "seconds": seconds,
            }
            del built
        if "replaceme_block" in wanted:
            built, _, seconds = _compress(
                model, calib, method="replaceme", spans=cut, placement="block", check_fraction=0.0
            )
            rows["replaceme_block"] = {
                "perplexity": evaluator.measure(built, f"block {n}"),
                "cut": cut,
                "seconds": seconds,
            }
            del built
        for key, refit in (("toast", True), ("toast_no_refit", False)):
            if key not in wanted:
                continue
            built, report, seconds = _compress(model, calib, budget=n, refit=refit)
            rows[key] = {
                "perplexity": evaluator.measure(built, f"{key} {n}"),
                "spans": [(s.start, s.stop) for s in report.spans],
                "check_note": report.check_note,
                "refitted": report.refitted,
                "seconds": seconds,
            }
            del built
        record["blocks"][str(n)] = rows
        print(n, json.dumps(rows, indent=1), flush=True)
        if out is not None:  # what is measured so far, should the run be stopped
            _write(out, label, {**record, "machine": _machine.machine(load)})
    record["machine"] = _machine.machine(load)
    return record


def markdown(results: dict) -> str:
    lines = [
        "# Few calibration batches: what the defaults measure",
        "",
        "SmolLM2-135M-Instruct (30 blocks), 8 calibration batches of 4 x 512 tokens",
        "(first half of `toast.data.stdlib_sentences`), held-out perplexity on 16 x 512",
        "test tokens (last quarter). `before`: the old split (one batch in every",
        "`round(1 / check_fraction)` held out: none of 8); `after`: the last batch held",
        "out when there are fewer than one group; `refit`: TOAST's default, which now",
        "fits a translator the check kept again on every batch, beside `refit=False`.",
        "Produced by",
        "`benchmarks/bench_few_batches.py`.",
        "",
    ]
    labels = [k for k in ("before", "after") if k in results] + sorted(
        k for k in results if k not in ("before", "after")
    )
    for label in labels:
        rec = results[label]
        lines += [f"## {label}", "", f"Original: perplexity {rec['original']:.2f}.", ""]
        lines += [
            "| blocks removed | row | perplexity ↓ | cut / spans | seconds |",
            "|---|---|---|---|---|",
        ]
        notes = []
        for n, rows in rec["blocks"].items():
            for key, name in ROWS:
                if key not in rows:
                    continue
                row = rows[key]
                where = row.get("cut", row.get("spans"))
                extra = ""
                if key == "replaceme":
                    extra = f" ({row['structure']} T, placement={row['placement']!r})"
                    notes.append(
                        f"- {n} blocks, ReplaceMe: check: {row['check_note'] or 'run'}; "
                        f"placement: {row['placement_note'] or '-'}"
                    )
                if key.startswith("toast"):
                    refit = {True: "; refitted on every batch", False: ""}.get(row.get("refitted"))
                    notes.append(
                        f"- {n} blocks, {name}: check: {row['check_note'] or 'run'}{refit or ''}"
                    )
                lines.append(
                    f"| {n} | {name}{extra} | {row['perplexity']:.2f} | {where} | "
                    f"{row['seconds']:.0f} |"
                )
        lines += ["", *notes, "", _machine.describe(rec["machine"]), ""]
    return "\n".join(lines)


def _write(out: Path, label: str, record: dict) -> dict:
    results = json.loads(out.read_text()) if out.exists() else {}
    results[label] = record
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(results))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="after")
    parser.add_argument("--blocks", type=int, nargs="+", default=list(BLOCKS))
    parser.add_argument("--out", type=Path, default=RESULTS / "few_batches.json")
    parser.add_argument(
        "--rows", nargs="+", choices=[k for k, _ in ROWS], default=list(DEFAULT_ROWS)
    )
    args = parser.parse_args()
    record = run(args.label, tuple(args.blocks), args.out, tuple(args.rows))
    print(markdown(_write(args.out, args.label, record)))


if __name__ == "__main__":
    main()
