"""ReplaceMe on a checkpoint on disk: calibration block by block and a pruned
checkpoint written without loading the model (for models bigger than memory).

The same statistics as the in-memory path, fed from
:func:`toast.hf.capture.sequential.stream_blocks` instead of whole-model forwards:

- the distance profile keeps each state's profile rows (the last token of
  each sequence by default: ``samples × dim`` per state) and adds them to
  the same float64 sums, batch by batch in the in-memory order;
- the estimation pass hooks the MLP output ``M`` of the block before each
  cut when that block runs, keeps ``M`` and the state ``L_start`` of every
  batch in a disk-backed buffer until the block ending the cut has run,
  then feeds the same moments (or cosine row sample) batch by batch. Only
  blocks up to the last cut run;
- the held-out check against plain removal and the choice among candidate
  cuts are :func:`toast.methods.replaceme.estimate.fit_checked`, the
  in-memory code, with :class:`DiskEstimation` fitting by the pass above
  and measuring by :class:`toast.hf.evaluate.from_disk.SequentialEvaluator`: each
  candidate is applied as the blocks load (:func:`cut_edits`: its blocks
  skipped, T folded into the block before it), one sweep per measurement;
- ``heldout=`` quality is measured the same way
  (:func:`toast.hf.evaluate.from_disk.measure_from_disk`);
- the pruned checkpoint is written by :func:`toast.io.pruned.write_pruned_checkpoint`
  with each T folded into its down-projection by the in-memory arithmetic
  (:func:`toast.methods.replaceme.fold.folded`).

So cuts, checks, transforms, measured quality and the written tensors equal
those of :func:`toast.methods.replaceme.replaceme` followed by ``save_pretrained``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from toast._scratch import scratch_place
from toast.core import Translator
from toast.hf.capture.sequential import BlockEdits, DiskModel, DiskStates, stream_blocks
from toast.hf.evaluate.check import CheckSplit, RemovalCheck, check_against_plain
from toast.hf.evaluate.from_disk import SequentialEvaluator, removal, replaced
from toast.io.pruned import write_pruned_checkpoint
from toast.methods.replaceme.auto import AutoResult, placement_options, resolved
from toast.methods.replaceme.config import ReplaceMeConfig
from toast.methods.replaceme.cuts import candidate_cuts, explicit_cuts, select_cuts
from toast.methods.replaceme.estimate import (
    Cut,
    Estimator,
    Fitted,
    check_note,
    fit_checked,
    fits_sequentially,
    flat_rows,
    solve_cut,
)
from toast.methods.replaceme.fold import (
    check_cuts,
    fold_into_writer,
    folded,
    folded_bias,
    folded_norm,
    is_diagonal,
    norm_offset,
    residual_writer,
)
from toast.methods.replaceme.hooks import MlpOutputs
from toast.methods.replaceme.profile import DistanceProfile, ProfileRows, check_selection
from toast.spans import Span
from toast.translators.block import translator_module

__all__ = [
    "DiskEstimation",
    "check_supported",
    "cut_edits",
    "estimate_from_disk",
    "fit_from_disk",
    "profile_from_disk",
    "write_replaceme",
]


def profile_from_disk(disk: DiskModel, data: Iterable, config: ReplaceMeConfig) -> DistanceProfile:
    """The distance profile of :func:`toast.methods.replaceme.profile_distances`,
    one block at a time."""
    rows = ProfileRows(config.distance_tokens, config.include_padding)
    # every state's profile rows wait on disk until the last state is known
    # (a row per sequence per state: in memory they grow with the data)
    kept = DiskStates(config.buffer_dir, disk.dtype)
    keeps: list[torch.Tensor | None] = []

    def on_state(state: int, batch: int, hidden: torch.Tensor, mask: torch.Tensor | None) -> None:
        (flat,), keep = rows.select([hidden], mask)
        if state == 0:
            rows.count(hidden, mask)
            keeps.append(keep)
        kept.append(flat)

    try:
        stream_blocks(
            disk,
            data,
            on_state,
            config.calibration,
            buffer_dir=config.buffer_dir,
            desc="replaceme: distances (sequential)",
        )
        batches = len(keeps)  # written state by state: state s of batch b is s * batches + b
        for batch, keep in enumerate(keeps):
            states = range(batch, len(kept.shapes), batches)
            rows.add([kept.read(i) for i in states], keep)
    finally:
        kept.close()
    return rows.profile(disk.stack.path)


class _Pending:
    """The states of the cuts' starts (``L_start``, and ``M`` when folding),
    waiting on disk for the block that ends each cut."""

    def __init__(self, directory: str | os.PathLike | None, cuts: list[Cut], folding: bool) -> None:
        self.starts: dict[int, DiskStates] = {}
        self.mlps: dict[int, DiskStates] = {}
        for n in range(len(cuts)):
            self.starts[n] = DiskStates(directory, torch.float32)
            if folding:
                self.mlps[n] = DiskStates(directory, torch.float32)

    def close(self) -> None:
        for states in (*self.starts.values(), *self.mlps.values()):
            states.close()


def estimate_from_disk(
    disk: DiskModel,
    data: Iterable,
    config: ReplaceMeConfig,
    spans: Sequence[Span],
    expected_rows: int | None = None,
    starts: Sequence[np.ndarray | None] | None = None,
) -> tuple[list[Fitted], int]:
    """The transforms of ``spans`` (one pass, as :meth:`Estimation.fit` on the
    original model), with blocks run up to the last cut's end; the cosine
    objective of each starts from its entry of ``starts`` (None: as
    ``init`` says)."""
    cuts = [Cut(s) for s in spans]
    folding = config.placement != "block"
    estimator = Estimator(cuts, config, {}, None, expected_rows)
    pending = _Pending(config.buffer_dir, cuts, folding)
    if config.calibration.progress:
        kept = "L_start and M" if folding else "L_start"
        print(
            f"toast: keeping {kept} of {len(cuts)} cut(s) for every calibration token "
            f"({'2' if folding else '1'} x {len(cuts)} x tokens x width) in "
            f"{scratch_place(config.buffer_dir)}",
            file=sys.stderr,
        )
    recorders: dict[int, MlpOutputs] = {}
    try:
        stream_blocks(
            disk,
            data,
            _state_consumer(cuts, estimator, pending, recorders, config),
            config.calibration,
            upto=max(s.stop for s in spans),
            on_block=_block_hooks(disk, cuts, recorders, config) if folding else None,
            buffer_dir=config.buffer_dir,
            desc="replaceme: estimating (sequential)",
        )
        if cuts[0].rows == 0:
            raise ValueError("the loader yielded no rows (empty loader, or every token masked out)")
        begin = [None] * len(cuts) if starts is None else list(starts)
        cpu = torch.device("cpu")
        fitted = [
            solve_cut(cut, config, cpu, start) for cut, start in zip(cuts, begin, strict=True)
        ]
        return fitted, cuts[0].rows
    finally:
        for cut in cuts:
            cut.close()
        pending.close()


def _block_hooks(
    disk: DiskModel, cuts: list[Cut], recorders: dict[int, MlpOutputs], config: ReplaceMeConfig
) -> Callable[[int, nn.Module], Callable[[], None] | None]:
    targets = {cut.kept for cut in cuts}

    def on_block(index: int, block: nn.Module) -> Callable[[], None] | None:
        if index not in targets:
            return None
        recorder = MlpOutputs(disk.stack, [index], config.check)
        recorders[index] = recorder

        def remove() -> None:
            recorders.pop(index).remove()

        return remove

    return on_block


def _state_consumer(
    cuts: list[Cut],
    estimator: Estimator,
    pending: _Pending,
    recorders: dict[int, MlpOutputs],
    config: ReplaceMeConfig,
) -> Callable[[int, int, torch.Tensor, torch.Tensor | None], None]:
    def on_state(state: int, batch: int, hidden: torch.Tensor, mask: torch.Tensor | None) -> None:
        d = int(hidden.shape[-1])
        keep = None if (mask is None or config.include_padding) else mask.reshape(-1)
        taken: dict[int, torch.Tensor] = {}  # cuts starting together share the block's M
        for n, cut in enumerate(cuts):
            if state == cut.span.start:
                # kept in their own dtype (the first append sets it), as the
                # in-memory pass sees them
                pending.starts[n].append(hidden)
                if n in pending.mlps:
                    if cut.kept not in taken:
                        taken[cut.kept] = recorders[cut.kept].take(cut.kept)
                    pending.mlps[n].append(taken[cut.kept])
            if state == cut.span.stop:
                if cut.moments is None and cut.sample is None:
                    estimator.open_cut(cut, d, hidden.device)
                lk = flat_rows(pending.starts[n].read(batch), d, keep)
                m = flat_rows(pending.mlps[n].read(batch), d, keep) if n in pending.mlps else None
                estimator.add_rows(cut, lk, flat_rows(hidden, d, keep), m)

    return on_state


@dataclass(frozen=True)
class DiskEstimation:
    """:class:`toast.methods.replaceme.estimate.Estimation` for a checkpoint
    on disk (the :class:`~toast.methods.replaceme.estimate.Fits` that
    :func:`~toast.methods.replaceme.estimate.fit_checked` uses): fits by
    :func:`estimate_from_disk`, checks by a sequential evaluator with each
    cut applied as its blocks load."""

    disk: DiskModel
    data: Iterable
    config: ReplaceMeConfig
    expected_rows: int | None = None

    def on(self, data: Iterable, expected_rows: int | None) -> DiskEstimation:
        return dataclasses.replace(self, data=data, expected_rows=expected_rows)

    def configured(self, config: ReplaceMeConfig) -> DiskEstimation:
        return dataclasses.replace(self, config=config)

    def fit(
        self, spans: Sequence[Span], starts: Sequence[np.ndarray | None] | None = None
    ) -> tuple[list[Fitted], int]:
        return estimate_from_disk(
            self.disk, self.data, self.config, spans, self.expected_rows, starts
        )

    def fit_each(
        self, configs: Sequence[ReplaceMeConfig], spans: Sequence[Span]
    ) -> list[tuple[list[Fitted], int]]:
        """:meth:`fit` under each of ``configs``, a sweep each (from disk a
        pass holds one option's pending rows)."""
        return [self.configured(config).fit(spans) for config in configs]

    def check(
        self,
        spans: Sequence[Span],
        transforms: Sequence[np.ndarray | None],
        heldout: Iterable,
        alone: bool,
    ) -> list[RemovalCheck | None]:
        """Each cut's T against plain removal on ``heldout``
        (:func:`toast.hf.evaluate.check.check_against_plain`), measured block by
        block with the cuts made as the blocks load."""
        config = self.config
        # each sweep reads every block from disk (minutes on a large model): counted
        evaluator = SequentialEvaluator(
            self.disk, heldout, progress=config.calibration.progress,
            buffer_dir=config.buffer_dir, fidelity=False,
        )  # fmt: skip

        def apply(where: Sequence[Span], fits: Sequence[Any]) -> AbstractContextManager:
            return evaluator.editing(cut_edits(where, fits, config, self.disk.dtype))

        return check_against_plain(
            self.disk.model, spans, transforms, apply, heldout, config.fallback, alone, evaluator
        )


def cut_edits(
    spans: Sequence[Span],
    transforms: Sequence[np.ndarray | None],
    config: ReplaceMeConfig,
    dtype: torch.dtype,
) -> BlockEdits:
    """The cuts as edits of the checkpoint's blocks while they load: the
    blocks of ``spans`` skipped and each T (None: plain removal) folded into
    the writer of the block before its cut by the in-memory arithmetic
    (:func:`toast.methods.replaceme.fold.fold_into_writer`), or, with
    ``placement="block"``, applied by a translator after the cut."""
    if config.placement == "block":
        kind = "diagonal" if config.structure == "diagonal" else "linear"
        modules = [
            None if t is None else _translator(np.asarray(t), kind, dtype) for t in transforms
        ]
        return replaced(spans, modules)
    folds = {s.start - 1: t for s, t in zip(spans, transforms, strict=True) if t is not None}

    def fold(index: int, block: nn.Module) -> None:
        if index in folds:
            fold_into_writer(residual_writer(block), folds[index])

    return dataclasses.replace(removal(spans), edit=fold)


def _translator(transform: np.ndarray, kind: str, dtype: torch.dtype) -> nn.Module:
    # in the model's dtype, as the surgery's translator block
    d = transform.shape[0]
    fitted = Translator(kind, transform, np.zeros(d), float("nan"), d, "replaceme")
    return translator_module(fitted, dtype=dtype)


def _choose(
    disk: DiskModel, data: Iterable, config: ReplaceMeConfig
) -> tuple[list[Span], DistanceProfile | None]:
    """The cuts: explicit spans checked, or chosen from a sequential profile."""
    total = disk.num_blocks
    if config.spans is not None:
        return explicit_cuts(config, total), None
    assert config.num_blocks is not None  # ReplaceMeConfig requires it without spans
    check_selection(config.num_blocks, config.num_cuts, config.min_start, total)
    profile = profile_from_disk(disk, data, config)
    return select_cuts(profile, config, total), profile


def write_replaceme(
    disk: DiskModel,
    output: str | os.PathLike,
    spans: Sequence[Span],
    transforms: Sequence[np.ndarray | None],
    *,
    progress: bool = True,
) -> Path:
    """Writes the pruned checkpoint: blocks of ``spans`` left out, the rest
    renumbered, each T folded into the down-projection before its cut."""
    total = disk.num_blocks
    renames, kept = disk.renumbered(b for s in spans for b in range(s.start, s.stop))
    edits = {}
    for span, t in zip(spans, transforms, strict=True):
        if t is not None:
            edits.update(_fold_edits(disk, span.start - 1, t))
    return write_pruned_checkpoint(
        disk.checkpoint, output, renames, kept=kept, total=total, edits=edits, progress=progress
    )


def _fold_edits(
    disk: DiskModel, index: int, transform: np.ndarray
) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The rewrites of the weight and bias of block ``index``'s writer (its
    down-projection, or a diagonal T into the norm after it)."""
    writer = residual_writer(disk.stack.blocks[index])
    keys = disk.block_keys(index)
    weight_key = keys[f"{writer.path}.weight"]
    bias_key = keys.get(f"{writer.path}.bias")
    d = writer.width
    if np.shape(transform) != (d, d):
        raise ValueError(f"the transform has shape {np.shape(transform)}; {writer.path} writes {d}")
    norm = writer.norm
    offset = 0.0 if norm is None else norm_offset(norm, d)
    if norm is not None and not is_diagonal(transform):
        raise ValueError(f"only a diagonal T folds into {writer.path}; use structure='diagonal'")

    def weight(w: torch.Tensor) -> torch.Tensor:
        if norm is not None:
            return folded_norm(w, None, transform, offset)[0]
        return folded(w, None, transform, writer.down.layout)[0]

    def bias(b: torch.Tensor) -> torch.Tensor:
        if norm is not None:
            return (b.to(torch.float64) * torch.as_tensor(np.diagonal(transform))).to(b.dtype)
        return folded_bias(b, transform)

    return {weight_key: weight, **({bias_key: bias} if bias_key is not None else {})}


def fit_from_disk(
    disk: DiskModel, data: Iterable, config: ReplaceMeConfig
) -> tuple[AutoResult, DistanceProfile | None, str]:
    """The cuts and their transforms, chosen and checked on held-out
    calibration batches as :func:`toast.methods.replaceme.replaceme` does,
    block by block; with the distance profile that chose them and why
    nothing was checked ("" when it was). The estimation returned carries
    the placement used."""
    split = CheckSplit(data, 0.0 if fits_sequentially(config) else config.check_fraction)
    spans, profile = _choose(disk, split.fit, config)
    note = check_note(config, split, len(spans))
    pool = [] if note else candidate_cuts(profile, config)
    # a written checkpoint must be standard: no block placement from disk
    options, why = placement_options(disk.stack.blocks, pool or spans, config, with_block=False)
    placement, structure = options[0]  # from disk: the diagonal fold where a norm follows
    said = f"{why}; from disk the diagonal T is folded into it (exact, a standard checkpoint)"
    config = resolved(config, options[0])
    check_cuts(disk.stack, pool or spans, structure, placement, config.objective)
    expected = profile.token_rows if profile is not None else None
    estimation = DiskEstimation(disk, split.fit, config, expected)
    if config.objective == "identity":
        unfitted = [Fitted(None) for _ in spans]
        return AutoResult(estimation, spans, unfitted, 0, [], []), profile, note
    spans, fitted, rows, checks, measured = fit_checked(estimation, spans, pool, split, note)
    placement_note = said if len(options) > 1 else ""
    chosen = AutoResult(estimation, spans, fitted, rows, checks, measured, placement_note)
    return chosen, profile, note


def check_supported(config: ReplaceMeConfig, writes: bool) -> None:
    """Refuses, before any pass, what the block-by-block path cannot do
    (``writes``: a checkpoint is written, which takes the fold alone)."""
    if config.spans is None and config.selection not in ("distance", "measured"):
        raise ValueError(
            f"selection={config.selection!r} is in memory only; from disk the cut is chosen "
            "by selection='measured' or 'distance' (or give spans=)"
        )
    if fits_sequentially(config):
        raise ValueError(
            "fit='sequential' re-runs the model with earlier cuts applied, which the "
            "from-disk path does not do; use fit='independent' (the default)"
        )
    if writes and config.placement not in ("fold", "auto"):
        raise ValueError(
            f"placement={config.placement!r} needs modules a standard checkpoint does not "
            "have; the from-disk writer folds T into the down-projection: use placement='fold'"
        )
