"""What a search optimizes: one measured quantity, the front's quality axis.

Every candidate's held-out pass measures several quantities at once
(perplexity, KL to the original, its 99th percentile, top-1 agreement for
causal LMs; accuracy or output cosine otherwise; see
:class:`toast.hf.evaluate.quality.Evaluator`). The objective names the one
the front, the target and the choice follow:

- ``None``: the model's own held-out metric (perplexity for causal LMs,
  accuracy with labels, output cosine otherwise), as before objectives;
- a metric of the held-out pass: ``"perplexity"``, ``"kl"``, ``"kl_p99"``,
  ``"agreement"``, ``"accuracy"``, ``"cosine"``;
- ``"task:<preset or tasks>"``: the average accuracy of lm-evaluation-harness
  tasks (:func:`toast.evaluate`): a preset (``task:replaceme``), task names
  separated by commas (``task:piqa,arc_easy``) or a task YAML file or folder
  (``task:./my_task.yaml``). Each candidate is also evaluated on them.

Every other measured quantity stays in each measurement's ``metrics`` and
in the report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from toast.hf.evaluate.quality import HIGHER_IS_BETTER, METRICS, quality_metric

from .measure import Measurement

__all__ = ["TASK_OPTIONS", "TASK_PREFIX", "Objective", "higher_is_better"]

#: The prefix of an objective measured by lm-evaluation-harness tasks.
TASK_PREFIX = "task:"

#: What ``task_options`` may set of the harness's run.
TASK_OPTIONS = ("limit", "num_fewshot", "batch_size")


def higher_is_better(metric: str) -> bool:
    """Whether a higher value of ``metric`` is better (task accuracies are)."""
    if metric.startswith(TASK_PREFIX):
        return True
    if metric not in HIGHER_IS_BETTER:
        raise ValueError(f"unknown metric {metric!r}; known: {sorted(HIGHER_IS_BETTER)}")
    return HIGHER_IS_BETTER[metric]


@dataclass(frozen=True)
class Objective:
    """``name``: the metric optimized (None: the model's own); ``tasks``:
    the harness tasks of a ``task:`` objective; ``options``: what
    :func:`toast.evaluate` gets beside them (``limit``, ``num_fewshot``,
    ``batch_size``)."""

    name: str | None = None
    tasks: str | list[str] | None = None
    options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def parse(cls, value: Any, task_options: dict[str, Any] | None = None) -> Objective:
        """An objective from what a user writes (None, a metric, ``task:...``)."""
        if isinstance(value, Objective):
            return value
        options = tuple(sorted((task_options or {}).items()))
        unknown = sorted(set(dict(options)) - set(TASK_OPTIONS))
        if unknown:
            raise ValueError(
                f"task_options has {unknown}: it takes {list(TASK_OPTIONS)} (see toast.evaluate)"
            )
        if value is None:
            if options:
                raise ValueError("task_options apply to an objective='task:...' only")
            return cls()
        if not isinstance(value, str):
            raise TypeError(f"objective must be a string or None; got {type(value).__name__}")
        if value.startswith(TASK_PREFIX):
            spec = value[len(TASK_PREFIX) :].strip()
            if not spec:
                raise ValueError(
                    "objective 'task:' names no task: write task:<preset>, e.g. task:replaceme, "
                    "task names separated by commas, or a task YAML path"
                )
            tasks: str | list[str] = spec if "," not in spec else _names(spec)
            return cls(TASK_PREFIX + spec, tasks, options)
        if options:
            raise ValueError("task_options apply to an objective='task:...' only")
        if value not in HIGHER_IS_BETTER or value == "tail_mass":
            known = sorted(k for k in HIGHER_IS_BETTER if k != "tail_mass")
            raise ValueError(
                f"objective must be one of {known} or 'task:<preset or tasks>'; got {value!r}"
            )
        return cls(value)

    @property
    def is_task(self) -> bool:
        return self.tasks is not None

    def key(self) -> str:
        """What the measurement cache must know of the objective: for tasks,
        their definitions and data (a task file edited since is measured
        again), not only their names."""
        tasks = [unit.fingerprint for unit in self.units()] if self.is_task else None
        return repr((self.name, tasks, self.options))

    def check(
        self, model: nn.Module, example: Any, kind: str = "loaded", tokenizer: Any = None
    ) -> None:
        """Refuses, before any pass, an objective the model cannot give:
        ``kind`` is ``"disk"`` where the model is never loaded; a task
        objective needs ``tokenizer``."""
        if self.name is None:
            return
        metric = quality_metric(model, example)
        if self.is_task:
            if metric != "perplexity":
                raise ValueError(
                    f"objective {self.name!r} needs a causal language model; this "
                    f"{type(model).__name__} is measured by {metric}"
                )
            if tokenizer is None:
                raise ValueError(
                    f"objective {self.name!r} needs the tokenizer: pass tokenizer= (the CLI "
                    "reads it from the model folder)"
                )
            if kind == "disk":
                raise ValueError(
                    f"objective {self.name!r} runs the harness on the loaded model, which the "
                    "block-by-block path never loads: give max_memory enough to load it, or "
                    "choose objective='kl' or 'perplexity'"
                )
            return
        offered = [k for k in METRICS[metric] if k != "tail_mass"]
        if self.name not in offered:
            raise ValueError(
                f"objective {self.name!r} is not measured for a {type(model).__name__} "
                f"(its held-out pass measures {offered}): choose one of those"
            )

    def check_tasks(self) -> None:
        """Refuses a task objective whose tasks are unknown or whose data is
        not on this machine (a second or so, before any model work)."""
        if self.is_task:
            self.units()

    def units(self) -> list[Any]:
        """The harness tasks, resolved and checked (the data on this machine)."""
        from toast.hf.evaluate.tasks import resolve_tasks

        assert self.tasks is not None  # a task objective
        return list(resolve_tasks(self.tasks))

    def missing(self, measured: Measurement) -> ValueError:
        """The error for an objective the original's pass did not give
        (agreement of a model whose outputs are not class scores)."""
        return ValueError(
            f"objective {self.name!r} was not measured: the held-out pass measured "
            f"{sorted(measured.metrics)} of this model; choose one of those"
        )

    def check_target(self, kind: str) -> None:
        """A quality floor is relative to the original's value: none exists
        where the original's is 0 (its KL to itself)."""
        if kind == "quality" and self.name in ("kl", "kl_p99"):
            raise ValueError(
                f"a quality= target is relative to the original's value, and the original's "
                f"{self.name} to itself is 0: give a size target (params=20%) with "
                f"objective={self.name!r}, or a quality= target with objective='perplexity' "
                "or 'agreement'"
            )

    def resolve(self, measured: Measurement) -> str:
        """The metric optimized, given the original's measurement."""
        return self.name or measured.metric

    def project(self, m: Measurement) -> Measurement | None:
        """``m`` with the objective's value as its quality (None when it was
        not measured: a cache entry from another objective)."""
        if self.name is None or self.name == m.metric:
            return m
        value = m.metrics.get(self.name)
        if value is None:
            return None
        return dataclasses.replace(m, quality=float(value), metric=self.name)

    def extra(
        self, tokenizer: Any
    ) -> Callable[[nn.Module], tuple[dict[str, float], dict[str, list[float]]]] | None:
        """What a bench adds to each measurement: the tasks' average accuracy
        and each task's per-document scores (None for a held-out objective)."""
        if not self.is_task:
            return None
        from toast.hf.evaluate.harness import evaluate_tasks

        name, units, options = self.name, self.units(), dict(self.options)
        assert name is not None  # set with tasks

        def evaluate(model: nn.Module) -> tuple[dict[str, float], dict[str, list[float]]]:
            report = evaluate_tasks(model, tokenizer, units, progress=False, **options)
            return {name: report.average}, report.documents

        return evaluate


def _names(spec: str) -> list[str]:
    names = [part.strip() for part in spec.split(",")]
    if not all(names):
        raise ValueError(f"objective 'task:{spec}' has an empty task name between commas")
    return names
