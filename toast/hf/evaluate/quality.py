"""Measured quality on held-out data: what a compressed model is worth.

Predicted errors rank spans; users ship models on measured quality. Given
held-out batches, :class:`Evaluator` measures one number per model, chosen
by what the model is:

- ``"perplexity"`` for causal LMs: ``exp`` of the mean next-token negative
  log-likelihood over every predicted token (padding excluded; ``labels``
  in a batch, with ``-100`` for ignored positions, replace the inputs as
  targets), the quantity the ReplaceMe paper reports;
- ``"accuracy"`` when the batches carry labels (``(inputs, labels)`` pairs
  or a ``labels`` key) and the model returns logits;
- ``"cosine"`` otherwise (encoders, embedding models): the mean cosine
  between each sample's output and the original model's, the output being
  the logits when there are any, else the mask-aware mean of the last
  hidden state (a sentence embedding).

:func:`skipped_blocks` measures plain removal of spans (every block of a
span returns its input) on the model as it is, with no copy, so a method
can report the baseline of the very blocks it removes.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from toast._validation import Options, check
from toast.hf.capture.states import forward_inputs
from toast.hf.data.progress import progress_bar
from toast.hf.model.blocks import BlockStack

__all__ = [
    "QUALITY_METRICS",
    "Evaluator",
    "Quality",
    "quality_metric",
    "skipped_blocks",
]

QualityMetric = Literal["perplexity", "accuracy", "cosine"]
QUALITY_METRICS = ("perplexity", "accuracy", "cosine")
_LABEL_KEYS = ("labels", "label")


@dataclass(frozen=True)
class Quality:
    """Held-out quality of the original model, of plain removal of the
    blocks the method removed (None when it removes none), and of the
    compressed model. ``count`` is what the metric averages over: predicted
    tokens, labelled predictions or samples."""

    metric: QualityMetric
    original: float
    compressed: float
    plain_removal: float | None
    samples: int
    count: int

    @property
    def higher_is_better(self) -> bool:
        return self.metric != "perplexity"

    def to_markdown(self) -> str:
        unit = {
            "perplexity": "predicted tokens; lower is better",
            "accuracy": "labelled predictions; higher is better",
            "cosine": "outputs compared with the original's; higher is better",
        }[self.metric]
        spec = ".2f" if self.metric == "perplexity" else ".4f"
        rows = [("original", self.original)]
        if self.plain_removal is not None:
            rows.append(("plain removal of the same blocks", self.plain_removal))
        rows.append(("compressed", self.compressed))
        lines = [
            f"Measured on held-out data ({self.samples:,} samples, {self.count:,} {unit}):",
            "",
            f"| model | {self.metric} |",
            "|---|---:|",
            *(f"| {name} | {value:{spec}} |" for name, value in rows),
        ]
        return "\n".join(lines)


def _is_causal_lm(model: nn.Module) -> bool:
    name = type(model).__name__
    return name.endswith(("ForCausalLM", "LMHeadModel")) and hasattr(model, "get_output_embeddings")


def _labels(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, (tuple, list)) and len(batch) > 1 and isinstance(batch[1], torch.Tensor):
        return batch[1]
    if isinstance(batch, Mapping):
        for key in _LABEL_KEYS:
            if isinstance(batch.get(key), torch.Tensor):
                return batch[key]
    return None


def quality_metric(model: nn.Module, batch: Any) -> QualityMetric:
    """The metric :class:`Evaluator` uses for ``model`` on batches like ``batch``."""
    if _is_causal_lm(model):
        return "perplexity"
    return "accuracy" if _labels(batch) is not None else "cosine"


def _check_order(heldout: Iterable) -> None:
    # Cosine compares sample k of one pass with sample k of another: the
    # held-out data must come in the same order on every pass.
    sampler = getattr(heldout, "sampler", None)
    if isinstance(sampler, torch.utils.data.RandomSampler):
        raise ValueError(
            "held-out data must come in the same order on every pass; build its DataLoader "
            "with shuffle=False"
        )


class Evaluator:
    """Measures models on ``heldout`` batches (iterated once per model).

    ``metric`` is one of :data:`QUALITY_METRICS`, or None to choose it from
    the first model measured and the first batch (:func:`quality_metric`).
    For ``"cosine"`` the first model measured is the reference: its outputs
    are kept (one vector per sample) and every later model is compared with
    them, so measure the original first.
    """

    def __init__(
        self, heldout: Iterable, metric: QualityMetric | None = None, progress: bool = True
    ) -> None:
        check("metric", metric, Options(QUALITY_METRICS), None)
        _check_order(heldout)
        self.heldout, self.metric, self.progress = heldout, metric, progress
        self._reference: torch.Tensor | None = None
        self.samples = 0
        self.count = 0

    def _iterate(self, label: str) -> Iterator[Any]:
        total = len(self.heldout) if isinstance(self.heldout, Sized) else None
        if not self.progress:
            yield from self.heldout
            return
        bar = progress_bar(f"held-out: {label}", total, "batch", disable=False)
        try:
            for batch in self.heldout:
                yield batch
                bar.update(1)
        finally:
            bar.close()

    def measure(self, model: nn.Module, label: str = "model") -> float:
        """``model``'s quality on the held-out data (eval mode, no gradients;
        the model's mode is restored)."""
        was_training = model.training
        model.eval()
        try:
            with torch.inference_mode():
                return self._measure(model, label)
        finally:
            model.train(was_training)

    def outputs(self, model: nn.Module, label: str) -> Generator[tuple[Any, tuple, dict, Any]]:
        """Each held-out batch with its forward inputs and ``model``'s output
        (what a sequential evaluator computes block by block instead)."""
        for batch in self._iterate(label):
            args, kwargs = forward_inputs(model, batch)
            yield batch, args, kwargs, model(*args, **_no_cache(model, kwargs))

    def _measure(self, model: nn.Module, label: str) -> float:
        totals = [0.0, 0]  # summed score, count
        vectors: list[torch.Tensor] = []
        samples = 0
        # closed on every exit: a sequential evaluator's buffers go with it
        with contextlib.closing(self.outputs(model, label)) as outputs:
            for batch, args, kwargs, output in outputs:
                if self.metric is None:
                    self.metric = quality_metric(model, batch)
                samples += batch_rows(args, kwargs)
                if self.metric == "perplexity":
                    _add(totals, *_token_nll(output, kwargs, _labels(batch)))
                elif self.metric == "accuracy":
                    _add(totals, *_correct(output, _labels(batch)))
                else:
                    vectors.append(_sample_vectors(output, kwargs.get("attention_mask")))
        if samples == 0:
            raise ValueError("the held-out data yielded no batch")
        self.samples = samples
        if self.metric == "cosine":
            return self._cosine(torch.cat(vectors))
        if totals[1] == 0:
            raise ValueError(f"the held-out data has nothing to score for {self.metric}")
        self.count = int(totals[1])
        score = totals[0] / totals[1]
        return math.exp(score) if self.metric == "perplexity" else score

    def _cosine(self, vectors: torch.Tensor) -> float:
        if self._reference is None:
            self._reference = vectors
        reference = self._reference
        if reference.shape != vectors.shape:
            raise ValueError(
                f"the held-out data gave {vectors.shape[0]} outputs of width {vectors.shape[1]} "
                f"but the reference {reference.shape[0]} of width {reference.shape[1]}: the "
                "data must give the same samples on every pass"
            )
        self.count = int(vectors.shape[0])
        cos = F.cosine_similarity(vectors.double(), reference.double(), dim=-1)
        return float(cos.mean())


def _add(totals: list, score: float, count: int) -> None:
    totals[0] += score
    totals[1] += count


def _no_cache(model: nn.Module, kwargs: dict) -> dict:
    # A KV cache only costs memory when every sequence is scored whole.
    accepted = inspect.signature(model.forward).parameters
    return {**kwargs, "use_cache": False} if "use_cache" in accepted else kwargs


def batch_rows(args: tuple, kwargs: dict) -> int:
    """The batch size of one batch's forward inputs: the leading dimension of
    its first tensor (0 when it has none)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return 0


def _logits(output: Any) -> torch.Tensor:
    logits = getattr(output, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise ValueError(
            f"the model returned {type(output).__name__} without logits; perplexity and "
            "accuracy need a model with a head (e.g. AutoModelForCausalLM)"
        )
    return logits


def _token_nll(output: Any, kwargs: dict, labels: torch.Tensor | None) -> tuple[float, int]:
    """Summed next-token NLL (float64) and the number of predicted tokens."""
    logits = _logits(output)
    if labels is None:
        ids = kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor):
            raise ValueError("perplexity needs input_ids (or labels) in every held-out batch")
        labels = ids.masked_fill(_mask(kwargs, ids) == 0, -100)
    labels = labels.to(logits.device)
    total, count = 0.0, 0
    for row in range(logits.shape[0]):  # one row at a time bounds the temporaries
        target = labels[row, 1:]
        valid = target != -100
        if not bool(valid.any()):
            continue
        nll = F.cross_entropy(logits[row, :-1][valid].float(), target[valid], reduction="sum")
        total += float(nll.double())
        count += int(valid.sum())
    return total, count


def _mask(kwargs: dict, ids: torch.Tensor) -> torch.Tensor:
    mask = kwargs.get("attention_mask")
    return torch.ones_like(ids) if mask is None else mask.to(ids.device)


def _correct(output: Any, labels: torch.Tensor | None) -> tuple[float, int]:
    assert labels is not None  # the metric is "accuracy" only when batches carry labels
    logits = _logits(output)
    labels = labels.to(logits.device)
    predicted = logits.argmax(dim=-1)
    if predicted.shape != labels.shape:
        raise ValueError(
            f"labels have shape {tuple(labels.shape)} but the predictions "
            f"{tuple(predicted.shape)}; accuracy needs one label per prediction"
        )
    valid = labels != -100
    return float((predicted == labels)[valid].sum()), int(valid.sum())


def _sample_vectors(output: Any, mask: torch.Tensor | None) -> torch.Tensor:
    """One vector per sample: the logits, else the masked mean of the last
    hidden state."""
    hidden: Any = getattr(output, "logits", None)
    if isinstance(output, torch.Tensor):
        hidden = output
    elif not isinstance(hidden, torch.Tensor):
        hidden = getattr(output, "last_hidden_state", None)
        if not isinstance(hidden, torch.Tensor):
            hidden = output[0]
    hidden = hidden.float()
    if hidden.dim() == 3:
        if mask is None:
            hidden = hidden.mean(dim=1)
        else:
            weights = mask.to(hidden.device, torch.float32).unsqueeze(-1)
            hidden = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)
    return hidden.reshape(hidden.shape[0], -1).cpu()


@contextlib.contextmanager
def skipped_blocks(stack: BlockStack, spans: Sequence[Any]) -> Iterator[None]:
    """Within the block, every block of ``spans`` (``(start, stop)`` pairs or
    :class:`toast.spans.Span`) hands its input on unchanged: plain removal of
    those blocks, measured on the model as it is. The blocks still run
    (their outputs are discarded); nothing is copied or changed."""
    handles = []
    try:
        for span in spans:
            start, stop = (span.start, span.stop) if hasattr(span, "start") else span
            for index in range(start, stop):
                handles.append(
                    stack.blocks[index].register_forward_hook(_pass_input, with_kwargs=True)
                )
        yield
    finally:
        for handle in handles:
            handle.remove()


def _pass_input(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(
            f"cannot find the hidden states entering {type(module).__name__}: expected the "
            "first positional argument or hidden_states=..."
        )
    if isinstance(output, torch.Tensor):
        return hidden
    if isinstance(output, tuple):
        return (hidden, *output[1:])
    raise TypeError(f"{type(module).__name__} returned {type(output).__name__}")
