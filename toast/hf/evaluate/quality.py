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

In the same pass it measures fidelity to the first model measured (the
reference: measure the original first), kept in :attr:`Evaluator.last`:
for causal LMs the KL of the next-token distributions, its 99th
percentile and top-1 agreement (:mod:`toast.hf.evaluate.fidelity`, which
states what the top-k KL bounds); for labelled predictions and for logits
compared by cosine, top-1 agreement of the predicted class.

:func:`skipped_blocks` measures plain removal of spans (every block of a
span returns its input) on the model as it is, with no copy, so a method
can report the baseline of the very blocks it removes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from toast._validation import Options, check
from toast.hf.capture.compute import forwards_in
from toast.hf.capture.distributed import (
    Ranks,
    all_gather_rows,
    all_reduce_sums,
    checked_batches,
    ranks_of,
)
from toast.hf.capture.states import forward_inputs, without_kv_cache
from toast.hf.data.calibration import COMPUTE_DTYPES, Calibration
from toast.hf.data.progress import progress_bar
from toast.hf.evaluate.fidelity import DEFAULT_TOP_K, Recording, TokenFidelity
from toast.hf.model.blocks import BlockStack

__all__ = [
    "FIDELITY_METRICS",
    "HIGHER_IS_BETTER",
    "METRICS",
    "QUALITY_METRICS",
    "Evaluator",
    "HeadRuns",
    "Quality",
    "quality_metric",
    "skipped_blocks",
]

QualityMetric = Literal["perplexity", "accuracy", "cosine"]
QUALITY_METRICS = ("perplexity", "accuracy", "cosine")
#: What a pass measures besides the quality metric: fidelity to the reference.
FIDELITY_METRICS = ("kl", "kl_p99", "agreement", "tail_mass")
#: The keys of :attr:`Evaluator.last` for each quality metric ("agreement"
#: under "cosine" only where the outputs are logits, one row per sample).
METRICS: dict[str, tuple[str, ...]] = {
    "perplexity": ("perplexity", "kl", "kl_p99", "agreement", "tail_mass"),
    "accuracy": ("accuracy", "agreement"),
    "cosine": ("cosine", "agreement"),
}
HIGHER_IS_BETTER = {
    "perplexity": False,
    "accuracy": True,
    "cosine": True,
    "kl": False,
    "kl_p99": False,
    "agreement": True,
    "tail_mass": False,
}
_LABEL_KEYS = ("labels", "label")


@dataclass(frozen=True)
class Quality:
    """Held-out quality of the original model, of plain removal of the
    blocks the method removed (None when it removes none), and of the
    compressed model. ``count`` is what the metric averages over: predicted
    tokens, labelled predictions or samples. ``metrics`` holds every metric
    of each model's pass (:attr:`Evaluator.last`) under ``"original"``,
    ``"plain_removal"`` and ``"compressed"``: fidelity to the original
    besides the quality metric; ``top_k`` the original's tokens the KL
    keeps (causal LMs)."""

    metric: QualityMetric
    original: float
    compressed: float
    plain_removal: float | None
    samples: int
    count: int
    metrics: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    top_k: int | None = None

    @property
    def higher_is_better(self) -> bool:
        return self.metric != "perplexity"

    def _rows(self) -> list[tuple[str, str, float]]:
        rows = [("original", "original", self.original)]
        if self.plain_removal is not None:
            rows.append(("plain_removal", "plain removal of the same blocks", self.plain_removal))
        rows.append(("compressed", "compressed", self.compressed))
        return rows

    def _columns(self) -> list[str]:
        """The fidelity columns every row measured."""
        keys = [k for k in METRICS[self.metric][1:] if k in _COLUMNS]
        return [k for k in keys if all(k in self.metrics.get(r, {}) for r, _, _ in self._rows())]

    def to_markdown(self) -> str:
        unit = {
            "perplexity": "predicted tokens",
            "accuracy": "labelled predictions",
            "cosine": "outputs compared with the original's",
        }[self.metric]
        spec = ".2f" if self.metric == "perplexity" else ".4f"
        columns = self._columns()
        head = [self.metric, *(_COLUMNS[k][0] for k in columns)]
        lines = [
            f"Measured on held-out data ({self.samples:,} samples, {self.count:,} {unit}; "
            f"{_directions([self.metric, *columns])}):",
            "",
            "| model | " + " | ".join(head) + " |",
            "|---|" + "---:|" * len(head),
        ]
        for key, name, value in self._rows():
            cells = [f"{value:{spec}}"]
            cells += [_COLUMNS[k][1](self.metrics[key][k]) for k in columns]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        return "\n".join(lines + self._notes(columns))

    def _notes(self, columns: list[str]) -> list[str]:
        notes = []
        if "kl" in columns:
            tail = self.metrics["original"].get("tail_mass", 0.0)
            kept = "its" if self.top_k is None else f"its {self.top_k:,} most likely"
            bound = (
                "exact: the kept tokens cover the vocabulary"
                if tail == 0.0
                else f"a lower bound of the exact KL; the tokens left out hold {tail:.2%} of "
                "the original's probability on average"
            )
            notes.append(
                f"KL(original ‖ model) per predicted token (mean and 99th percentile) over "
                f"the original's next-token distribution, {kept} tokens and the rest ({bound})."
            )
        if "agreement" in columns:
            notes.append(
                "Top-1 agreement: the share of predictions (next tokens, classes) whose most "
                "likely one is the original's."
            )
        return [line for note in notes for line in ("", note)]


def _directions(keys: list[str]) -> str:
    """Which way the columns ``keys`` are better, in words."""
    label = {"kl": "KL", "agreement": "top-1 agreement"}
    shown = [k for k in keys if k != "kl_p99"]  # goes with the KL
    lower = " and ".join(label.get(k, k) for k in shown if not HIGHER_IS_BETTER[k])
    higher = " and ".join(label.get(k, k) for k in shown if HIGHER_IS_BETTER[k])
    if lower and higher:
        return f"{lower}: lower is better, {higher}: higher"
    return f"{lower or higher}: {'lower' if lower else 'higher'} is better"


#: Fidelity columns of the report: header and format.
_COLUMNS: dict[str, tuple[str, Any]] = {
    "kl": ("KL", lambda v: f"{v:.4f}"),
    "kl_p99": ("KL p99", lambda v: f"{v:.4f}"),
    "agreement": ("top-1 agreement", lambda v: f"{v:.2%}"),
}


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
    The first model measured is the reference, so measure the original
    first: for ``"cosine"`` its outputs are kept (one vector per sample)
    and every later model is compared with them; for ``"perplexity"`` its
    ``top_k`` most likely next tokens and their log-probabilities are kept
    for each predicted token (``8 * top_k + 8`` bytes a token) and every
    model measured gets its KL, KL 99th percentile and top-1 agreement in
    the same pass (:mod:`toast.hf.evaluate.fidelity`); for ``"accuracy"``
    its predicted classes are kept for top-1 agreement. After each
    :meth:`measure`, :attr:`last` holds every metric of that pass (keys:
    :data:`METRICS`). ``compute``: what the forwards compute in
    (``Calibration.compute_dtype``; ``"bfloat16"`` autocasts a float32
    model, :func:`toast.hf.capture.compute.forwards_in`); the scores are
    float32 either way. ``fidelity=False``: a causal LM's perplexity alone
    (no reference kept, no KL or agreement: what a check of one figure
    reads, without the top-k over the vocabulary each token costs).

    Under ``torch.distributed`` (``calibration``'s process group, default:
    an initialised one; see :class:`toast.Calibration`) every rank passes
    the same held-out batches, forwards batch ``k`` when ``k % world`` is
    its rank, and the sums (losses, token and sample counts, agreements,
    cosines; the per-token KLs gathered for their percentile) are reduced
    over the ranks: every rank measures one process's figures (to
    rounding). Every rank must call :meth:`measure` alike (collective).
    """

    def __init__(
        self,
        heldout: Iterable,
        metric: QualityMetric | None = None,
        progress: bool = True,
        top_k: int = DEFAULT_TOP_K,
        compute: str = "auto",
        calibration: Calibration | None = None,
        fidelity: bool = True,
    ) -> None:
        check("metric", metric, Options(QUALITY_METRICS), None)
        check("compute", compute, Options(COMPUTE_DTYPES))
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k={top_k!r}: give the number of tokens kept, an int >= 1")
        _check_order(heldout)
        self.heldout, self.metric, self.progress, self.top_k = heldout, metric, progress, top_k
        self.compute, self.fidelity = compute, fidelity
        #: the ranks the held-out batches are sharded over (None: one process)
        self.ranks: Ranks | None = ranks_of(calibration)
        self._reference: torch.Tensor | None = None
        self._kept: Recording[Any] = Recording()
        self.samples = 0
        self.count = 0
        self.last: dict[str, float] = {}

    def _iterate(self, label: str) -> Iterator[Any]:
        total = len(self.heldout) if isinstance(self.heldout, Sized) else None
        batches = checked_batches(self.heldout, self.ranks)
        if not self.progress:
            yield from batches
            return
        if total is not None and self.ranks is not None:
            total = len(range(self.ranks.rank, total, self.ranks.world))
        bar = progress_bar(f"held-out: {label}", total, "batch", disable=False)
        try:
            for batch in batches:
                yield batch
                bar.update(1)
        finally:
            bar.close()

    def measure(self, model: nn.Module, label: str = "model") -> float:
        """``model``'s quality on the held-out data (eval mode, no gradients;
        the model's mode is restored); every metric of the pass in :attr:`last`."""
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
            with forwards_in(model, self.compute):
                output = model(*args, **without_kv_cache(model, kwargs))
            yield batch, args, kwargs, output

    def _scorer(self) -> _Tokens | _Classes | _Cosine:
        self._kept.begin()
        if self.metric == "perplexity":
            return _Tokens(TokenFidelity(self._kept if self.fidelity else None, self.top_k))
        if self.metric == "accuracy":
            return _Classes(self._kept)
        return _Cosine()

    def _measure(self, model: nn.Module, label: str) -> float:
        self.last = {}
        scorer: _Tokens | _Classes | _Cosine | None = None
        samples = 0
        if self.ranks is not None and self.metric is None:
            # from the first batch of all, which a rank need not forward itself
            first = next(iter(self.heldout), None)
            if first is not None:
                self.metric = quality_metric(model, first)
        # closed on every exit: a sequential evaluator's buffers go with it
        with contextlib.closing(self.outputs(model, label)) as outputs:
            for batch, args, kwargs, output in outputs:
                if self.metric is None:
                    self.metric = quality_metric(model, batch)
                scorer = self._scorer() if scorer is None else scorer
                samples += batch_rows(args, kwargs)
                scorer.add(batch, kwargs, output)
        if self.ranks is not None:
            return self._measured_over_ranks(scorer, samples, self.ranks)
        if scorer is None or samples == 0:
            raise ValueError("the held-out data yielded no batch")
        self.samples = samples
        if isinstance(scorer, _Cosine):
            self.last, self.count = self._cosine(scorer)
        else:
            if scorer.count == 0:
                raise ValueError(f"the held-out data has nothing to score for {self.metric}")
            self._kept.end()
            self.last, self.count = scorer.result(), scorer.count
        return self.last[str(self.metric)]

    def _measured_over_ranks(
        self, scorer: _Tokens | _Classes | _Cosine | None, samples: int, ranks: Ranks
    ) -> float:
        """The pass's figures from every rank's sums (collective): each
        scorer's counters replaced by their totals, then scored as one
        process scores them."""
        if self.metric is None:
            raise ValueError("the held-out data yielded no batch")
        scorer = self._scorer() if scorer is None else scorer  # a rank given no batch adds 0
        if isinstance(scorer, _Cosine):
            metrics, count, total = self._cosine_over_ranks(scorer, samples, ranks)
        else:
            if isinstance(scorer, _Tokens):
                f = scorer.fidelity
                kl = torch.cat(f.kl).double() if f.kl else torch.zeros(0, dtype=torch.float64)
                sums = all_reduce_sums([samples, f.nll, f.count, f.agree, f.tail], ranks)
                f.nll, f.tail = float(sums[1]), float(sums[4])
                f.count, f.agree = int(sums[2]), int(sums[3])
                f.kl = [torch.from_numpy(all_gather_rows(kl.numpy(), ranks))]
            else:
                sums = all_reduce_sums([samples, scorer.hits, scorer.agree, scorer.count], ranks)
                scorer.hits, scorer.agree, scorer.count = int(sums[1]), int(sums[2]), int(sums[3])
            total = int(sums[0])
            count = scorer.count
            if total and count:
                self._kept.end()
                metrics = scorer.result()
        if total == 0:
            raise ValueError("the held-out data yielded no batch")
        if count == 0:
            raise ValueError(f"the held-out data has nothing to score for {self.metric}")
        self.samples, self.last, self.count = total, metrics, count
        return self.last[str(self.metric)]

    def _cosine_over_ranks(
        self, scorer: _Cosine, samples: int, ranks: Ranks
    ) -> tuple[dict[str, float], int, int]:
        """:meth:`_cosine` of every rank's samples: each against this rank's
        reference outputs of the same samples, the sums reduced."""
        cos_sum = agree = 0.0
        rows = 0
        if scorer.vectors:
            vectors = torch.cat(scorer.vectors)
            if self._reference is None:
                self._reference = vectors
            if self._reference.shape != vectors.shape:
                raise ValueError(
                    f"the held-out data gave {vectors.shape[0]} outputs of width "
                    f"{vectors.shape[1]} but the reference {self._reference.shape[0]} of width "
                    f"{self._reference.shape[1]}: the data must give the same samples on every "
                    "pass"
                )
            reference = self._reference
            cos = F.cosine_similarity(vectors.double(), reference.double(), dim=-1)
            cos_sum, rows = float(cos.sum()), int(vectors.shape[0])
            agree = float((vectors.argmax(dim=-1) == reference.argmax(dim=-1)).sum())
        # whether every rank's outputs were logits: counted as ranks that were not
        sums = all_reduce_sums([samples, cos_sum, rows, agree, 0 if scorer.logits else 1], ranks)
        count = int(sums[2])
        metrics = {"cosine": float(sums[1] / count)} if count else {}
        if count and sums[4] == 0:
            metrics["agreement"] = float(sums[3] / count)
        return metrics, count, int(sums[0])

    def _cosine(self, scorer: _Cosine) -> tuple[dict[str, float], int]:
        vectors = torch.cat(scorer.vectors)
        if self._reference is None:
            self._reference = vectors
        reference = self._reference
        if reference.shape != vectors.shape:
            raise ValueError(
                f"the held-out data gave {vectors.shape[0]} outputs of width {vectors.shape[1]} "
                f"but the reference {reference.shape[0]} of width {reference.shape[1]}: the "
                "data must give the same samples on every pass"
            )
        cos = F.cosine_similarity(vectors.double(), reference.double(), dim=-1)
        metrics = {"cosine": float(cos.mean())}
        if scorer.logits:  # one row of class scores per sample: the predicted class
            same = vectors.argmax(dim=-1) == reference.argmax(dim=-1)
            metrics["agreement"] = float(same.double().mean())
        return metrics, int(vectors.shape[0])


@dataclass(frozen=True)
class HeadRuns:
    """A causal LM's output given as the final states its head reads
    (``hidden``, ``[rows, tokens, width]``) and the ``head`` that makes
    logits of them, a run of ``tokens`` positions at a time: a row's logits
    (tokens x vocabulary x 4 bytes, 200 MB for 1,024 tokens of a 49k
    vocabulary) are never whole. Scored as the logits would be."""

    hidden: torch.Tensor
    head: Any
    tokens: int

    def runs(self, row: int, stop: int) -> Iterator[tuple[int, torch.Tensor]]:
        """``(start, logits)`` of positions ``start ..`` of ``row``, up to ``stop``."""
        for start in range(0, stop, self.tokens):
            end = min(start + self.tokens, stop)
            yield start, self.head(self.hidden[row, start:end])


class _Tokens:
    """A causal LM's pass: perplexity and fidelity over predicted tokens."""

    def __init__(self, fidelity: TokenFidelity) -> None:
        self.fidelity = fidelity

    @property
    def count(self) -> int:
        return self.fidelity.count

    def add(self, batch: Any, kwargs: dict, output: Any) -> None:
        if isinstance(output, HeadRuns):
            self._add_runs(batch, kwargs, output)
            return
        logits = _logits(output)
        targets = _targets(kwargs, _labels(batch)).to(logits.device)
        for row in range(logits.shape[0]):  # one row at a time bounds the temporaries
            target = targets[row, 1:]
            self._add_valid(logits[row, :-1], target)

    def _add_runs(self, batch: Any, kwargs: dict, output: HeadRuns) -> None:
        targets = _targets(kwargs, _labels(batch)).to(output.hidden.device)
        for row in range(output.hidden.shape[0]):
            target = targets[row, 1:]
            for start, logits in output.runs(row, int(target.shape[0])):
                self._add_valid(logits, target[start : start + logits.shape[0]])

    def _add_valid(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        """The positions of ``target`` not ignored (``-100``); a view, not a
        vocabulary-wide copy per row, when none is."""
        valid = target != -100
        if bool(valid.all()):
            self.fidelity.add(logits, target)
        elif bool(valid.any()):
            self.fidelity.add(logits[valid], target[valid])

    def result(self) -> dict[str, float]:
        return self.fidelity.result()


class _Classes:
    """A labelled pass: accuracy, and top-1 agreement with the reference's
    predicted classes (recorded on its pass)."""

    def __init__(self, kept: Recording[torch.Tensor]) -> None:
        self.kept = kept
        self.hits = self.agree = self.count = 0

    def add(self, batch: Any, kwargs: dict, output: Any) -> None:
        labels = _labels(batch)
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
        predicted, labels = predicted[valid], labels[valid]
        rows = int(predicted.shape[0])
        own = predicted.int().cpu()
        kept = self.kept.add(own, rows) if self.kept.recording else self.kept.next(rows)
        self.hits += int((predicted == labels).sum())
        self.agree += int((own == kept).sum())
        self.count += rows

    def result(self) -> dict[str, float]:
        return {"accuracy": self.hits / self.count, "agreement": self.agree / self.count}


class _Cosine:
    """A pass compared by cosine: one vector per sample, and whether they
    are logits with one row per sample (class scores, whose argmax agrees
    or not)."""

    def __init__(self) -> None:
        self.vectors: list[torch.Tensor] = []
        self.logits = True

    def add(self, batch: Any, kwargs: dict, output: Any) -> None:
        logits = getattr(output, "logits", None)
        self.logits &= isinstance(logits, torch.Tensor) and logits.dim() == 2
        self.vectors.append(_sample_vectors(output, kwargs.get("attention_mask")))


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


def _targets(kwargs: dict, labels: torch.Tensor | None) -> torch.Tensor:
    """Each position's token to predict from the one before: ``labels``
    (``-100``: ignored), else the inputs with padding ignored."""
    if labels is not None:
        return labels
    ids = kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        raise ValueError("perplexity needs input_ids (or labels) in every held-out batch")
    return ids.masked_fill(_mask(kwargs, ids) == 0, -100)


def _mask(kwargs: dict, ids: torch.Tensor) -> torch.Tensor:
    mask = kwargs.get("attention_mask")
    return torch.ones_like(ids) if mask is None else mask.to(ids.device)


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
