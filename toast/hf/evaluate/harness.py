"""Task accuracy the way the papers measure it: a model in memory on
lm-evaluation-harness tasks, and the share of the original's accuracy it
retains.

:func:`evaluate_tasks` wraps the model in the harness's ``HFLM`` (an
already-loaded ``transformers`` model and its tokenizer) and runs
``lm_eval.simple_evaluate`` once per task (:mod:`toast.hf.evaluate.tasks`
resolves and checks the tasks first, so that a missing dataset fails before
any model work). The harness's own results layout is kept whole in
:attr:`TaskReport.harness`; toast adds the summary the papers print:

- each task's *headline* metric: ``acc_norm`` where the harness reports it
  (HellaSwag, PIQA, ARC-Easy, ARC-Challenge, OpenBookQA: the length-normalised
  accuracy those papers quote), else ``acc`` (BoolQ, WinoGrande, COPA, RACE,
  WSC273, MMLU); both stay in :attr:`TaskReport.metrics`;
- the average of the headline accuracies over the tasks (unweighted, the
  papers' "Avg.");
- with a reference (the original model), the retained performance:
  ``average / reference.average * 100``, in percent, and the same per task.

The reference is measured in the same harness with the same settings, and
its report is cached on disk under a digest of its weights, its tokenizer,
the tasks (a local task's YAML and data files included) and the settings,
so that comparing many compressed models with one original measures the
original once.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import hashlib
import io
import json
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from toast.hf.capture.compute import forward_dtype
from toast.hf.data.calibration import COMPUTE_DTYPES
from toast.hf.data.progress import progress_bar
from toast.hf.evaluate.paired import paired_stderr
from toast.hf.evaluate.tasks import TaskUnit, resolve_tasks

__all__ = [
    "DEFAULT_CACHE",
    "HEADLINE_METRICS",
    "TaskReport",
    "evaluate_tasks",
    "task_accuracy",
    "weights_digest",
]

# The metric a task's accuracy is read from: the first of these it reports.
HEADLINE_METRICS = ("acc_norm", "acc", "exact_match", "f1", "mcc")
DEFAULT_CACHE = Path("~/.cache/toast/eval")
# The parts of simple_evaluate's output that describe the tasks' results (the
# rest is the environment: git hash, pip versions, the date).
_HARNESS_SECTIONS = (
    "results", "groups", "group_subtasks", "configs", "versions", "n-shot",
    "higher_is_better", "n-samples",
)  # fmt: skip
_CACHE_FORMAT = 2  # 2: per-document scores
# What the harness logs, as a warning, about how toast calls it on purpose.
_EXPECTED_LOGS = (
    "`pretrained` model kwarg is not of type `str`",
    "Passed an already-initialized model through `pretrained`",
    "SHOULD ONLY BE USED FOR TESTING",
    "Overwriting default num_fewshot",
)

TaskRequest = str | os.PathLike | Iterable[str | os.PathLike | TaskUnit]


@dataclasses.dataclass(frozen=True)
class TaskReport:
    """The accuracy of one model on tasks of lm-evaluation-harness.

    ``metrics`` holds each task's numbers by the harness's metric names
    (``acc``, ``acc_stderr``, ``acc_norm``, ...; a stderr the harness could
    not compute is None), ``headline`` the metric its accuracy is read
    from, ``harness`` the harness's own results layout (``results``,
    ``configs``, ``versions``, ``n-shot``, ``n-samples``, ...), ``settings``
    the options of the run, ``reference`` the original model's report."""

    metrics: dict[str, dict[str, float | None]]
    headline: dict[str, str]
    settings: dict[str, Any]
    harness: dict[str, Any]
    reference: TaskReport | None = None
    documents: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    @property
    def accuracy(self) -> dict[str, float]:
        """Each task's headline accuracy, in [0, 1]."""
        return {task: float(self.metrics[task][m] or 0.0) for task, m in self.headline.items()}

    @property
    def average(self) -> float:
        """The unweighted mean of :attr:`accuracy` over the tasks."""
        values = list(self.accuracy.values())
        return sum(values) / len(values)

    @property
    def retained(self) -> float | None:
        """``average / reference.average * 100``: the percentage of the
        original's average accuracy kept (None without a reference; NaN
        when the reference scores 0)."""
        if self.reference is None:
            return None
        return _percent(self.average, self.reference.average)

    @property
    def retained_by_task(self) -> dict[str, float] | None:
        """:attr:`retained` for each task alone."""
        if self.reference is None:
            return None
        theirs = self.reference.accuracy
        return {task: _percent(value, theirs[task]) for task, value in self.accuracy.items()}

    def paired_stderr(self, other: TaskReport, tasks: Iterable[str] | None = None) -> float | None:
        """The standard error of ``self.average - other.average`` when both
        scored the same documents (:func:`toast.hf.evaluate.paired.paired_stderr`);
        ``tasks``: of the average over these tasks only (default every task
        of this report)."""
        names = list(self.headline) if tasks is None else tasks
        return paired_stderr(self.documents, other.documents, names)

    def with_reference(self, reference: TaskReport) -> TaskReport:
        """This report against ``reference``, which must cover its tasks
        with the same settings."""
        missing = [task for task in self.headline if task not in reference.headline]
        if missing:
            raise ValueError(
                f"the reference report has no result for {', '.join(missing)}: measure the "
                "original on the same tasks"
            )
        for key in ("limit", "skip", "num_fewshot"):
            if reference.settings.get(key) != self.settings.get(key):
                raise ValueError(
                    f"the reference was measured with {key}={reference.settings.get(key)!r} "
                    f"and this model with {key}={self.settings.get(key)!r}: measure both alike"
                )
        return dataclasses.replace(self, reference=dataclasses.replace(reference, reference=None))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``toast`` (the summary), ``harness`` (the harness's
        layout) and ``reference`` (the reference's own dict, or None)."""
        summary = {
            "tasks": list(self.headline),
            "metric": self.headline,
            "accuracy": self.accuracy,
            "average": self.average,
            "retained": self.retained,
            "retained_by_task": self.retained_by_task,
            "metrics": self.metrics,
            "settings": self.settings,
        }
        reference = None if self.reference is None else self.reference.to_dict()
        return {
            "toast": summary,
            "harness": self.harness,
            "reference": reference,
            "documents": self.documents,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TaskReport:
        """The report :meth:`to_dict` (or a saved JSON file) describes."""
        summary = data["toast"]
        reference = data.get("reference")
        return cls(
            metrics=summary["metrics"],
            headline=summary["metric"],
            settings=summary["settings"],
            harness=data["harness"],
            reference=None if reference is None else cls.from_dict(reference),
            documents=data.get("documents") or {},
        )

    def to_markdown(self) -> str:
        """A table: each task's metric, accuracy (percent) and stderr, and
        with a reference its accuracy and the retained share; then the average."""
        ref = self.reference
        header = "| task | metric | accuracy (%) | ± stderr |"
        rule = "|---|---|---:|---:|"
        if ref is not None:
            header += " reference (%) | retained (%) |"
            rule += "---:|---:|"
        lines = [header, rule]
        for task, metric in self.headline.items():
            stderr = self.metrics[task].get(f"{metric}_stderr")
            row = f"| {task} | {metric} | {100 * self.accuracy[task]:.2f} | {_num(stderr, 100)} |"
            if ref is not None and self.retained_by_task is not None:
                row += f" {100 * ref.accuracy[task]:.2f} | {self.retained_by_task[task]:.1f} |"
            lines.append(row)
        average = f"| **average** | | **{100 * self.average:.2f}** | |"
        if ref is not None:
            average += f" {100 * ref.average:.2f} | **{self.retained:.1f}** |"
        lines += [average, "", _settings_line(self.settings)]
        data = self.settings.get("data") or {}
        if data:
            lines.append("Data: " + "; ".join(f"{task}: {where}" for task, where in data.items()))
        return "\n".join(lines)

    def save(self, path: str | os.PathLike) -> Path:
        """Writes the report as JSON to ``path`` and its markdown beside it
        (the same name, ``.md``); returns the JSON path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        path.with_suffix(".md").write_text(self.to_markdown() + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> TaskReport:
        """A report written by :meth:`save`."""
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


def _percent(value: float, of: float) -> float:
    return value / of * 100 if of else math.nan


def _num(value: float | None, scale: float) -> str:
    return "n/a" if value is None else f"{scale * value:.2f}"


def _settings_line(settings: dict[str, Any]) -> str:
    shots = settings.get("num_fewshot")
    limit = settings.get("limit")
    parts = [
        f"lm-evaluation-harness {settings.get('lm_eval', '?')}",
        "each task's own few-shot default" if shots is None else f"{shots}-shot",
        "every document" if limit is None else f"limit {limit} documents per task",
        *([f"after the first {settings['skip']}"] if settings.get("skip") else []),
        f"batch size {settings.get('batch_size')}",
    ]
    return "Measured with " + ", ".join(parts) + "."


def evaluate_tasks(
    model: nn.Module,
    tokenizer: Any,
    tasks: TaskRequest,
    reference: nn.Module | TaskReport | None = None,
    *,
    limit: int | float | None = None,
    skip: int = 0,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    progress: bool = True,
    cache: str | os.PathLike | bool | None = None,
    compute: str = "auto",
) -> TaskReport:
    """``model`` (a ``transformers`` causal LM in memory) with ``tokenizer``
    on ``tasks`` (see :func:`toast.hf.evaluate.tasks.resolve_tasks`; checked
    before any model work). ``reference``, the original model (measured
    first, with the same tokenizer, and cached in ``cache``: a folder, the
    default :data:`DEFAULT_CACHE` for None or True, no cache for False) or a
    report already measured, gives the retained performance. ``limit``: the
    first documents of each task only (a count, or a fraction); ``skip``: the
    ``limit`` documents after the first ``skip`` instead; ``num_fewshot``
    overrides the tasks' own number of examples in the prompt. ``compute``:
    ``"bfloat16"`` runs a float32 model's forwards under bf16 autocast (the
    reference's too: the harness's own ``mixed_precision_dtype``, as
    :func:`toast.hf.capture.compute.forward_dtype` chooses it), any other
    value the model's own dtype."""
    units = resolve_tasks(tasks)
    settings = _settings(limit, num_fewshot, batch_size, skip, compute)
    settings["data"] = {unit.name: unit.source for unit in units}
    if reference is not None and not isinstance(reference, TaskReport):
        reference = _reference_report(reference, tokenizer, units, settings, progress, cache)
    report = _measure(model, tokenizer, units, settings, progress, "model")
    return report if reference is None else report.with_reference(reference)


def task_accuracy(
    model: nn.Module,
    tokenizer: Any,
    tasks: TaskRequest,
    *,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
) -> float:
    """The average headline accuracy of ``model`` on ``tasks``, quietly:
    ``evaluate_tasks(...).average``, for a search measuring many candidates
    (resolve the tasks once with :func:`~toast.hf.evaluate.tasks.resolve_tasks`
    and pass the units to skip the checks)."""
    return evaluate_tasks(
        model, tokenizer, tasks, limit=limit, num_fewshot=num_fewshot, batch_size=batch_size,
        progress=False,
    ).average  # fmt: skip


def _settings(
    limit: int | float | None,
    num_fewshot: int | None,
    batch_size: int,
    skip: int = 0,
    compute: str = "auto",
) -> dict:
    from importlib.metadata import version

    if not (isinstance(skip, int) and skip >= 0):
        raise ValueError(f"skip must be an int >= 0; got {skip!r}")
    if skip and not (isinstance(limit, int) and not isinstance(limit, bool)):
        raise ValueError(
            f"skip={skip} scores the `limit` documents after the first {skip}: give limit as "
            f"a count of documents; got limit={limit!r}"
        )
    if limit is not None and not (isinstance(limit, (int, float)) and limit > 0):
        raise ValueError(f"limit must be a positive count or fraction of documents; got {limit!r}")
    if num_fewshot is not None and not (isinstance(num_fewshot, int) and num_fewshot >= 0):
        raise ValueError(f"num_fewshot must be an int >= 0; got {num_fewshot!r}")
    if not (isinstance(batch_size, int) and batch_size >= 1):
        raise ValueError(f"batch_size must be an int >= 1; got {batch_size!r}")
    if compute not in COMPUTE_DTYPES:
        raise ValueError(f"compute must be one of {list(COMPUTE_DTYPES)}; got {compute!r}")
    return {
        "limit": limit,
        **({"skip": skip} if skip else {}),  # absent at 0: earlier caches stay valid
        **({"compute": compute} if compute == "bfloat16" else {}),  # the same
        "num_fewshot": num_fewshot,
        "batch_size": batch_size,
        "lm_eval": version("lm_eval"),
    }


def _reference_report(
    reference: nn.Module,
    tokenizer: Any,
    units: list[TaskUnit],
    settings: dict,
    progress: bool,
    cache: str | os.PathLike | bool | None,
) -> TaskReport:
    """The reference's report, from the cache when it was measured alike."""
    folder = _cache_folder(cache)
    if folder is None:
        return _measure(reference, tokenizer, units, settings, progress, "reference")
    key = {
        "format": _CACHE_FORMAT,
        "weights": weights_digest(reference),
        "tokenizer": _tokenizer_digest(tokenizer),
        "tasks": [unit.fingerprint for unit in units],
        "settings": settings,
    }
    file = folder / f"{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()}.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # absent or unreadable
        cached = TaskReport.load(file)
        if progress:
            print(f"reference: {len(units)} task(s) read from the cache {file}", file=sys.stderr)
        return cached
    report = _measure(reference, tokenizer, units, settings, progress, "reference")
    folder.mkdir(parents=True, exist_ok=True)
    partial = file.with_name(f".{file.name}.{os.getpid()}")
    try:
        partial.write_text(json.dumps(report.to_dict()), encoding="utf-8")
        os.replace(partial, file)  # a reader never sees half a report
    finally:
        partial.unlink(missing_ok=True)  # an interrupted write leaves nothing behind
    return report


def _cache_folder(cache: str | os.PathLike | bool | None) -> Path | None:
    if cache is False:
        return None
    if cache is None or cache is True:
        return DEFAULT_CACHE.expanduser()
    return Path(cache).expanduser()


def weights_digest(model: nn.Module) -> str:
    """SHA-256 of the model's class, config and every tensor of its state
    dict (names, dtypes, shapes and bytes): equal for equal weights,
    wherever the model was loaded from."""
    digest = hashlib.sha256(type(model).__qualname__.encode())
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        values = {k: v for k, v in config.to_dict().items() if "name_or_path" not in k}
        digest.update(json.dumps(values, sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        data = tensor.detach()
        digest.update(f"{name}:{data.dtype}:{tuple(data.shape)};".encode())
        digest.update(data.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _tokenizer_digest(tokenizer: Any) -> str:
    parts = [
        type(tokenizer).__qualname__,
        sorted(tokenizer.get_vocab().items()),
        str(getattr(tokenizer, "special_tokens_map", "")),
        str(getattr(tokenizer, "padding_side", "")),
    ]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


def _measure(
    model: nn.Module,
    tokenizer: Any,
    units: list[TaskUnit],
    settings: dict,
    progress: bool,
    label: str,
) -> TaskReport:
    """One model on every unit, one harness run per unit, progress over the units."""
    if not hasattr(model, "config") or not hasattr(model, "device"):
        raise TypeError(
            "toast.evaluate runs Hugging Face language models (a transformers "
            f"PreTrainedModel); got {type(model).__name__}"
        )
    harness: dict[str, Any] = {}
    scores: dict[str, dict[str, list[float]]] = {}
    was_training = model.training
    with _task_progress(label, len(units), progress) as done:
        try:
            compute = forward_dtype(model, settings.get("compute", "auto"))
            lm = _harness_model(model, tokenizer, settings["batch_size"], compute)
            for unit in units:
                start = time.monotonic()
                output, per_document = _run(lm, unit, settings)
                _merge(harness, output)
                scores.update(per_document)
                done(unit.name, _task_metrics(harness, unit.name), time.monotonic() - start)
        finally:
            model.train(was_training)
    metrics = {unit.name: _task_metrics(harness, unit.name) for unit in units}
    headline = {task: _headline(task, values, harness) for task, values in metrics.items()}
    documents = {
        task: scores[task][metric]
        for task, metric in headline.items()
        if metric in scores.get(task, {})
    }
    return TaskReport(
        metrics=metrics, headline=headline, settings=settings, harness=harness, documents=documents
    )


@contextlib.contextmanager
def _task_progress(label: str, total: int, progress: bool) -> Iterator[Any]:
    """Progress over the tasks: a bar on a terminal, else one line per task
    done (its accuracy and time); nothing without ``progress``. Yields
    ``done(task, metrics, seconds)``."""
    terminal = progress and sys.stderr.isatty()
    bar = progress_bar(f"tasks ({label})", total, "task", disable=not terminal)
    count = 0

    def done(task: str, metrics: dict[str, float | None], seconds: float) -> None:
        nonlocal count
        count += 1
        bar.set_postfix(task=task)
        bar.update(1)
        if progress and not terminal:
            name = next((m for m in HEADLINE_METRICS if metrics.get(m) is not None), None)
            score = "" if name is None else f" {name} {100 * (metrics[name] or 0.0):.2f}%"
            print(f"{label}: task {count}/{total} {task}{score} ({seconds:.0f}s)", file=sys.stderr)

    try:
        yield done
    finally:
        bar.close()


def _harness_model(
    model: nn.Module, tokenizer: Any, batch_size: int, compute: torch.dtype | None = None
) -> Any:
    if tokenizer is None:
        raise ValueError(
            "toast.evaluate needs the tokenizer of a model given as a module: pass "
            "tokenizer=... (toast.load_tokenizer(folder) reads a model folder's)"
        )
    with _quiet_harness():
        from lm_eval.models.huggingface import HFLM

        # the harness sets a pad token on the tokenizer it gets: not on the user's;
        # its forwards run under its own autocast, which `compute` switches on
        return HFLM(
            pretrained=model,
            tokenizer=copy.deepcopy(tokenizer),
            batch_size=batch_size,
            mixed_precision_dtype=compute,
        )


@functools.lru_cache(maxsize=2)
def _task_manager(with_harness_tasks: bool) -> Any:
    """The harness's task index: its own ~14,000 task files take seconds to
    index and only names of the harness need them (a local task's config is
    given whole); built once per process."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=with_harness_tasks)


def _run(
    lm: Any, unit: TaskUnit, settings: dict
) -> tuple[dict[str, Any], dict[str, dict[str, list[float]]]]:
    """One harness run of ``unit``: the result sections of its output, and
    each task's numeric per-document metrics in document order."""
    from lm_eval import simple_evaluate

    limit, samples = settings["limit"], None
    if settings.get("skip"):  # documents [skip, skip + limit) of the task
        limit, samples = None, {unit.name: list(range(settings["skip"], settings["skip"] + limit))}
    with _quiet_harness():
        output = simple_evaluate(
            model=lm,
            tasks=[copy.deepcopy(unit.spec)],  # the harness edits the configs it gets
            task_manager=_task_manager(unit.registered),
            limit=limit,
            samples=samples,
            num_fewshot=settings["num_fewshot"],
            log_samples=True,  # per-document scores, for paired standard errors
            bootstrap_iters=1000,  # stderrs of means are closed forms; this is for the rest
        )
    if output is None:  # not the main process of a distributed run
        raise RuntimeError("the harness returned no results (a distributed run's worker?)")
    # callables of a config (process_docs, ...) become their names, as the harness saves them
    sections = {k: output.get(k, {}) for k in _HARNESS_SECTIONS}
    return json.loads(json.dumps(sections, default=str)), _per_document(output.get("samples", {}))


def _per_document(samples: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, list[float]]]:
    """Each task's headline candidates per document (sorted by ``doc_id``)."""
    found: dict[str, dict[str, list[float]]] = {}
    for task, rows in samples.items():
        rows = sorted(rows, key=lambda row: row["doc_id"])
        found[task] = {
            metric: [float(row[metric]) for row in rows]
            for metric in HEADLINE_METRICS
            if rows and all(isinstance(row.get(metric), (int, float)) for row in rows)
        }
    return found


def _merge(into: dict[str, Any], output: dict[str, Any]) -> None:
    for section, values in output.items():
        if isinstance(values, dict):
            into.setdefault(section, {}).update(values)


def _task_metrics(harness: dict[str, Any], task: str) -> dict[str, float | None]:
    """A task's (or group's) metrics by name, from the harness's ``metric,filter``
    keys (the first filter of each metric; "N/A" stderrs become None)."""
    row = harness.get("results", {}).get(task) or harness.get("groups", {}).get(task)
    if not row:
        raise RuntimeError(f"the harness reported no result for task {task}")
    metrics: dict[str, float | None] = {}
    for key, value in row.items():
        if "," not in key:
            continue  # alias, name, sample_len
        metric = key.split(",", 1)[0]
        if metric not in metrics:
            metrics[metric] = float(value) if isinstance(value, (int, float)) else None
    return metrics


def _headline(task: str, metrics: dict[str, float | None], harness: dict[str, Any]) -> str:
    for name in HEADLINE_METRICS:
        if metrics.get(name) is not None:
            return name
    better = harness.get("higher_is_better", {}).get(task, {})
    for name, value in metrics.items():
        if value is not None and better.get(name) is True and not name.endswith("_stderr"):
            return name
    raise ValueError(
        f"task {task} reports no accuracy ({', '.join(metrics) or 'no metric'}): "
        "toast.evaluate averages accuracies; measure perplexity with toast.hf.evaluate.quality"
    )


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if not any(expected in message for expected in _EXPECTED_LOGS):
            self.messages.append(message)


@contextlib.contextmanager
def _quiet_harness() -> Iterator[None]:
    """The harness runs silently: its progress bars, its datasets' bars and
    the git call of its environment report go nowhere (toast shows progress
    over tasks); its warnings, but for those about how toast calls it, and
    the Python warnings raised meanwhile are repeated once it is done."""
    logger = logging.getLogger("lm_eval")
    saved_logger = (logger.handlers[:], logger.level, logger.propagate)
    collect = _Collect()
    logger.handlers, logger.propagate = [collect], False
    logger.setLevel(logging.WARNING)
    sys.stderr.flush()
    saved_fd, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            # the harness prints some notes (bootstrapping, ...) to stdout too
            with (
                contextlib.redirect_stderr(io.StringIO()),
                contextlib.redirect_stdout(io.StringIO()),
            ):
                yield
    finally:
        os.dup2(saved_fd, 2)
        os.close(saved_fd)
        os.close(null)
        logger.handlers, logger.level, logger.propagate = saved_logger
        for message in dict.fromkeys(collect.messages):
            print(f"warning: lm-evaluation-harness: {message}", file=sys.stderr)
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
