"""Measured quality of a checkpoint on disk, block by block: the numbers of
:class:`toast.hf.evaluate.quality.Evaluator` for a model bigger than memory.

The held-out batches go through the checkpoint as calibration does
(:func:`toast.hf.capture.sequential.sweep`): the embedding on every batch, then
block 0 on all of them, block 1, ...; the hidden states wait on disk
between blocks. The blocks may be changed as they load
(:class:`toast.hf.capture.sequential.BlockEdits`: skipped, a transform folded
into their weights, a translator after them), which measures plain
removal and a compressed model without writing either. Then the model's
own forward, with the embeddings and the head loaded and every block
replaced by one handing on the final states of that batch, gives the
outputs the in-memory model would, and the same scores are computed
from them, fidelity to the first checkpoint measured included, in the same
sweep. Peak memory: one block, the embeddings and the head.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from toast.hf.capture.budget import logit_positions, logit_rows
from toast.hf.capture.sequential import BlockEdits, DiskModel, Swept, sweep
from toast.hf.capture.states import forward_inputs, without_kv_cache
from toast.hf.data.calibration import Calibration
from toast.hf.evaluate.fidelity import DEFAULT_TOP_K
from toast.hf.evaluate.quality import (
    Evaluator,
    HeadRuns,
    Quality,
    QualityMetric,
    quality_metric,
)

__all__ = ["SequentialEvaluator", "measure_from_disk", "removal", "replaced"]


class SequentialEvaluator(Evaluator):
    """An :class:`~toast.hf.evaluate.quality.Evaluator` of the checkpoint ``disk``
    with the blocks changed as :attr:`edits` says (none: the original).
    ``measure(disk.model, label)`` runs one sweep over the blocks;
    :meth:`editing` sets the edits within a ``with`` block (so the
    in-memory held-out checks, which apply each candidate by a context,
    run unchanged on disk). ``fidelity=False``: perplexity alone, as those
    checks measure in memory (none of the first pass's top tokens kept: 32
    KiB a predicted token at the default ``top_k``)."""

    def __init__(
        self,
        disk: DiskModel,
        heldout: Iterable,
        metric: QualityMetric | None = None,
        progress: bool = True,
        buffer_dir: str | os.PathLike | None = None,
        top_k: int = DEFAULT_TOP_K,
        fidelity: bool = True,
    ) -> None:
        super().__init__(_RowChunks(heldout, disk), metric, progress, top_k, fidelity=fidelity)
        # block by block from disk every rank measures every batch (not sharded)
        self.ranks = None
        self.disk, self.buffer_dir = disk, buffer_dir
        self.edits = BlockEdits()
        self._runs: bool | None = None  # whether the head alone gives the logits

    @contextlib.contextmanager
    def editing(self, edits: BlockEdits) -> Iterator[None]:
        """Within the block, the measured model is the checkpoint with ``edits``."""
        previous, self.edits = self.edits, edits
        try:
            yield
        finally:
            self.edits = previous

    def measure_edited(self, edits: BlockEdits, label: str = "model") -> float:
        """The quality of the checkpoint with ``edits``."""
        with self.editing(edits):
            return self.measure(self.disk.model, label)

    def outputs(self, model: nn.Module, label: str) -> Generator[tuple[Any, tuple, dict, Any]]:
        disk = self.disk
        if model is not disk.model:
            raise ValueError("a SequentialEvaluator measures its own checkpoint: pass disk.model")
        # every held-out batch, whatever a calibration would bound
        cal = Calibration(progress=self.progress)
        with sweep(
            disk,
            self.heldout,
            _ignore,
            cal,
            edits=self.edits,
            buffer_dir=self.buffer_dir,
            desc=f"held-out: {label} (sequential)",
        ) as swept:
            disk.prepare(full=True, embedding=False)
            try:
                with _replayed(disk, swept):
                    yield from self._in_runs(model, label)
            finally:
                disk.release()

    def _in_runs(self, model: nn.Module, label: str) -> Iterator[tuple[Any, tuple, dict, Any]]:
        """The outputs of :meth:`Evaluator.outputs`, but a causal LM's batch
        whose row alone has more logits than the plan's bound
        (:attr:`DiskModel.logit_bytes <toast.hf.capture.disk_model.DiskModel>`,
        :data:`toast.hf.capture.budget.LOGIT_BYTES` by default) comes as
        :class:`HeadRuns`: the final states (the model's own forward, its
        head run on the last position only) and the head, which the scorer
        runs on that many bytes of positions at a time. The head is checked
        once against the model's own last-position logits (a head that does
        more than its output embedding, e.g. soft-capped logits, keeps the
        model's full forward)."""
        found = getattr(model, "get_output_embeddings", None)
        head: Any = found() if callable(found) else None
        vocabulary = _vocabulary(self.disk)
        per = logit_positions(vocabulary, self.disk.logit_bytes)
        final: list[torch.Tensor] = []

        def keep(module: nn.Module, args: tuple, output: Any) -> None:
            tuple_like = isinstance(output, (tuple, list))
            final[:] = [output[0] if tuple_like else output.last_hidden_state]

        handle = self.disk.base.register_forward_hook(keep)
        try:
            for batch in self._iterate(label):
                args, kwargs = forward_inputs(model, batch)
                kwargs = without_kv_cache(model, kwargs)
                ids = kwargs.get("input_ids")
                long = (
                    self._runs is not False and head is not None and vocabulary > 0
                    and isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] > per
                    and (self.metric or quality_metric(model, batch)) == "perplexity"
                    and "logits_to_keep" in inspect.signature(model.forward).parameters
                )  # fmt: skip
                if not long:
                    yield batch, args, kwargs, model(*args, **kwargs)
                    continue
                last = model(*args, **kwargs, logits_to_keep=1).logits[:, -1]
                runs = HeadRuns(final[0], head, per)
                if self._runs is None:  # the head alone gives the model's logits, or never runs
                    self._runs = torch.allclose(head(final[0][:, -1]), last, rtol=1e-4, atol=1e-4)
                if not self._runs:
                    yield batch, args, kwargs, model(*args, **kwargs)
                    continue
                yield batch, args, kwargs, runs
        finally:
            handle.remove()


def _vocabulary(disk: DiskModel) -> int:
    weight = getattr(disk.embedding("output"), "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) else 0


class _RowChunks:
    """The held-out batches, each cut into consecutive runs of rows whose
    logits (tokens x vocabulary x 4 bytes) stay within the plan's bound
    (:attr:`DiskModel.logit_bytes <toast.hf.capture.disk_model.DiskModel>`,
    read as the batches are, :data:`toast.hf.capture.budget.LOGIT_BYTES` by
    default): a batch of 8 x 512 tokens of a 49k vocabulary would otherwise
    hold 800 MB of logits, and as much again for their log-softmax. Rows are
    scored independently, so the metrics are the whole batches' (sums in
    another order); every pass of the evaluator sees the same cut."""

    def __init__(self, batches: Iterable, disk: DiskModel) -> None:
        self.batches, self.disk = batches, disk
        self.sampler = getattr(batches, "sampler", None)  # what the order check reads

    def __iter__(self) -> Iterator[Any]:
        vocabulary = _vocabulary(self.disk)
        for batch in self.batches:
            yield from _cut(batch, vocabulary, self.disk.logit_bytes)


def _cut(batch: Any, vocabulary: int, bound: int | None = None) -> Iterator[Any]:
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if vocabulary <= 0 or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        yield batch
        return
    rows, tokens = ids.shape
    per = logit_rows(rows, tokens, vocabulary, bound)
    if per >= rows:
        yield batch
        return
    for lo in range(0, rows, per):
        yield {
            k: v[lo : lo + per] if isinstance(v, torch.Tensor) and v.shape[:1] == (rows,) else v
            for k, v in batch.items()
        }


def _ignore(state: int, batch: int, hidden: torch.Tensor, mask: torch.Tensor | None) -> None:
    """The sweep's states are read once it ends, not as they pass."""


@contextlib.contextmanager
def _replayed(disk: DiskModel, swept: Swept) -> Iterator[None]:
    """Within the block every block of ``disk`` returns the final states the
    sweep left for the batch the model is called on (the model's forward
    hands the last block's to the final norm and head); the batches come
    in the sweep's order, one model call each."""
    batch = iter(range(len(swept.batches)))
    final: list[Any] = []

    def next_batch(module: nn.Module, args: tuple) -> None:
        index = next(batch, None)
        if index is None:
            raise ValueError("the held-out data gave more batches on its second pass")
        final[:] = [swept.form.wrap(swept.states.read(index))]

    def forward(*args: Any, **kwargs: Any) -> Any:
        return final[0]

    embedding = disk.skipped_embedding()
    weight = getattr(embedding, "weight", None)
    width = int(weight.shape[-1]) if isinstance(weight, torch.Tensor) else 0

    def zeros(ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # what the blocks would read is replaced: only the shape, dtype and
        # device matter (masks and positions are built from them)
        return torch.zeros(*ids.shape, width, dtype=disk.dtype)

    blocks = disk.stack.blocks
    handle = disk.model.register_forward_pre_hook(next_batch)
    patched: list[nn.Module] = [*blocks, *([embedding] if embedding is not None else [])]
    for block in blocks:
        block.forward = forward  # an instance attribute shadows the class's
    if embedding is not None:
        embedding.forward = zeros
    try:
        yield
    finally:
        handle.remove()
        for module in patched:
            del module.forward


def measure_from_disk(
    disk: DiskModel,
    heldout: Iterable,
    plain: BlockEdits | None,
    compressed: BlockEdits,
    *,
    progress: bool = True,
    buffer_dir: str | os.PathLike | None = None,
) -> Quality:
    """The :class:`~toast.hf.evaluate.quality.Quality` of ``toast.compress``'s
    ``heldout=`` for a checkpoint on disk: the original, plain removal
    (``plain``; None: no block goes, nothing to measure, as in memory) and
    the compressed model (``compressed``), measured in that order (the
    cosine compares with the original) by one sweep each."""
    evaluator = SequentialEvaluator(disk, heldout, progress=progress, buffer_dir=buffer_dir)
    original = evaluator.measure_edited(BlockEdits(), "original")
    metrics = {"original": evaluator.last}
    removed = None
    if plain is not None:
        removed = evaluator.measure_edited(plain, "plain removal")
        metrics["plain_removal"] = evaluator.last
    result = evaluator.measure_edited(compressed, "compressed")
    metrics["compressed"] = evaluator.last
    assert evaluator.metric is not None  # set by the first measurement
    return Quality(
        metric=evaluator.metric,
        original=original,
        compressed=result,
        plain_removal=removed,
        samples=evaluator.samples,
        count=evaluator.count,
        metrics=metrics,
        top_k=evaluator.top_k if evaluator.metric == "perplexity" else None,
    )


def removal(spans: Iterable[Any]) -> BlockEdits:
    """Plain removal of ``spans`` (``(start, stop)`` pairs or
    :class:`toast.spans.Span`): their blocks are skipped."""
    skip: set[int] = set()
    for span in spans:
        start, stop = (span.start, span.stop) if hasattr(span, "start") else span
        skip.update(range(start, stop))
    return BlockEdits(skip=frozenset(skip))


def replaced(
    spans: Sequence[Any], modules: Sequence[Callable[[torch.Tensor], Any] | None]
) -> BlockEdits:
    """Each span replaced by its module (None: plain removal), which maps
    the span's input to what the block after it receives (a translator)."""
    plain = removal(spans)
    after = {}
    for span, module in zip(spans, modules, strict=True):
        if module is not None:
            stop = span.stop if hasattr(span, "stop") else span[1]
            after[stop - 1] = module
    return dataclasses.replace(plain, after=after)
