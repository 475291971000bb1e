"""ReplaceMe on a checkpoint on disk: calibration block by block and a pruned
checkpoint written without loading the model (for models bigger than memory).

The same statistics as the in-memory path, fed from
:func:`toast.hf.sequential.stream_blocks` instead of whole-model forwards:

- the distance profile keeps each state's profile rows (the last token of
  each sequence by default: ``samples × dim`` per state) and adds them to
  the same float64 sums, batch by batch in the in-memory order;
- the estimation pass hooks the MLP output ``M`` of the block before each
  cut when that block runs, keeps ``M`` and the state ``L_start`` of every
  batch in a disk-backed buffer until the block ending the cut has run,
  then feeds the same moments (or cosine row sample) batch by batch. Only
  blocks up to the last cut run;
- the pruned checkpoint is written by :func:`toast.io.pruned.write_pruned_checkpoint`
  with each T folded into its down-projection by the in-memory arithmetic
  (:func:`toast.methods.replaceme.fold.folded`).

So cuts, transforms and the written tensors equal those of
:func:`toast.replaceme` followed by ``save_pretrained``.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from toast.hf.sequential import DiskModel, DiskStates, stream_blocks
from toast.hf.text import as_batches
from toast.io.pruned import write_pruned_checkpoint
from toast.methods.replaceme.config import ReplaceMeConfig
from toast.methods.replaceme.cuts import explicit_cuts, select_cuts
from toast.methods.replaceme.estimate import Cut, Estimator, Fitted, flat_rows, solve_cut
from toast.methods.replaceme.fold import (
    check_cuts,
    folded,
    folded_bias,
    folded_norm,
    is_diagonal,
    norm_offset,
    residual_writer,
)
from toast.methods.replaceme.hooks import MlpOutputs
from toast.methods.replaceme.profile import DistanceProfile, ProfileRows, check_selection
from toast.methods.replaceme.report import ReplaceMeReport
from toast.methods.runner import split_text_options
from toast.spans import Span

__all__ = ["estimate_from_disk", "profile_from_disk", "replaceme_from_disk", "write_replaceme"]


def profile_from_disk(disk: DiskModel, data: Iterable, config: ReplaceMeConfig) -> DistanceProfile:
    """The distance profile of :func:`toast.methods.replaceme.profile_distances`,
    one block at a time."""
    rows = ProfileRows(config.distance_tokens, config.include_padding)
    kept: dict[int, list[torch.Tensor]] = {}  # per batch, each state's profile rows
    keeps: list[torch.Tensor | None] = []

    def on_state(state: int, batch: int, hidden: torch.Tensor, mask: torch.Tensor | None) -> None:
        (flat,), keep = rows.select([hidden], mask)
        if state == 0:
            rows.count(hidden, mask)
            keeps.append(keep)
        kept.setdefault(batch, []).append(flat.clone())

    stream_blocks(
        disk,
        data,
        on_state,
        config.calibration,
        buffer_dir=config.buffer_dir,
        desc="replaceme: distances (sequential)",
    )
    for batch, keep in enumerate(keeps):
        rows.add(kept.pop(batch), keep)
    return rows.profile(disk.stack.path)


class _Pending:
    """The states of the cuts' starts (``L_start``, and ``M`` when folding),
    waiting on disk for the block that ends each cut."""

    def __init__(self, folder: str, cuts: list[Cut], folding: bool) -> None:
        self.starts: dict[int, DiskStates] = {}
        self.mlps: dict[int, DiskStates] = {}
        for n in range(len(cuts)):
            self.starts[n] = DiskStates(os.path.join(folder, f"start{n}.bin"), torch.float32)
            if folding:
                self.mlps[n] = DiskStates(os.path.join(folder, f"mlp{n}.bin"), torch.float32)

    def close(self) -> None:
        for states in (*self.starts.values(), *self.mlps.values()):
            states.close()


def estimate_from_disk(
    disk: DiskModel,
    data: Iterable,
    config: ReplaceMeConfig,
    spans: Sequence[Span],
    expected_rows: int | None = None,
) -> tuple[list[Fitted], int]:
    """The transforms of ``spans`` (one pass, as :meth:`Estimation.fit` on the
    original model), with blocks run up to the last cut's end."""
    cuts = [Cut(s) for s in spans]
    folding = config.placement != "block"
    estimator = Estimator(cuts, config, {}, None, expected_rows)
    folder = tempfile.mkdtemp(prefix="toast-replaceme-", dir=config.buffer_dir)
    pending = _Pending(folder, cuts, folding)
    if config.calibration.progress:
        kept = "L_start and M" if folding else "L_start"
        print(
            f"toast: keeping {kept} of {len(cuts)} cut(s) for every calibration token "
            f"({'2' if folding else '1'} x {len(cuts)} x tokens x width) in {folder}",
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
        return [solve_cut(cut, config, torch.device("cpu")) for cut in cuts], cuts[0].rows
    finally:
        for cut in cuts:
            cut.close()
        pending.close()
        shutil.rmtree(folder, ignore_errors=True)


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
        for n, cut in enumerate(cuts):
            if state == cut.span.start:
                # kept in their own dtype (the first append sets it), as the
                # in-memory pass sees them
                pending.starts[n].append(hidden)
                if n in pending.mlps:
                    pending.mlps[n].append(recorders[cut.kept].take(cut.kept))
            if state == cut.span.stop:
                if cut.moments is None and cut.sample is None:
                    estimator.open_cut(cut, d, hidden.device)
                lk = flat_rows(pending.starts[n].read(batch), d, keep)
                m = flat_rows(pending.mlps[n].read(batch), d, keep) if n in pending.mlps else None
                estimator.add_rows(cut, lk, flat_rows(hidden, d, keep), m)

    return on_state


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
    removed = {b for s in spans for b in range(s.start, s.stop)}
    kept = [b for b in range(total) if b not in removed]
    renames: dict[str, str | None] = {}
    for b in range(total):
        keys = disk.block_keys(b)
        new = kept.index(b) if b in kept else None
        new_keys = disk.block_keys(new) if new is not None else {}
        for name, key in keys.items():
            renames[key] = new_keys[name] if new is not None else None
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


def replaceme_from_disk(
    folder: str | os.PathLike | DiskModel,
    data: Iterable,
    output: str | os.PathLike | None = None,
    config: ReplaceMeConfig | None = None,
    **params: Any,
) -> ReplaceMeReport:
    """ReplaceMe on the checkpoint in ``folder`` without loading the model.

    ``folder`` may also be a :class:`~toast.hf.sequential.DiskModel` opened
    before. ``data`` is a loader of tokenized batches, or raw text with
    ``tokenizer=`` (and ``max_length``, ``batch_size``...: see
    :func:`toast.compress`); ``config`` and/or its fields as keywords choose
    the cut and the transform.
    With ``output``, the pruned checkpoint is written there (a new folder;
    ``placement="fold"`` only). Only one block's weights and the calibration
    states are ever in memory; the states wait between blocks in a
    temporary directory under ``buffer_dir``, removed on every exit. An
    interrupted run (Ctrl-C included) leaves neither temporary files nor a
    partial ``output``. Returns the report (as :func:`toast.replaceme`'s).
    """
    text, params = split_text_options(params)
    config = ReplaceMeConfig.from_options(config, params)
    _check_supported(config, output)
    data = as_batches(data, **text)
    if output is not None and Path(output).exists():
        raise FileExistsError(f"{output} exists; the pruned checkpoint goes to a new folder")
    disk = DiskModel.open(folder, config.calibration.blocks)
    spans, profile = _choose(disk, data, config)
    check_cuts(disk.stack, spans, config.structure, config.placement, config.objective)
    if config.objective == "identity":
        fitted, rows = [Fitted(None) for _ in spans], 0
    else:
        expected = profile.token_rows if profile is not None else None
        fitted, rows = estimate_from_disk(disk, data, config, spans, expected)
    transforms = [f.transform for f in fitted]
    if output is not None:
        write_replaceme(disk, output, spans, transforms, progress=config.calibration.progress)
    return _report(disk, config, spans, fitted, rows, profile)


def _check_supported(config: ReplaceMeConfig, output: str | os.PathLike | None) -> None:
    if config.fit == "sequential" and (config.spans is None or len(config.spans) > 1):
        if config.num_cuts > 1 or (config.spans is not None and len(config.spans) > 1):
            raise ValueError(
                "fit='sequential' re-runs the model with earlier cuts applied, which the "
                "from-disk path does not do; use fit='independent' (the default)"
            )
    if output is not None and config.placement != "fold":
        raise ValueError(
            f"placement={config.placement!r} needs modules a standard checkpoint does not "
            "have; the from-disk writer folds T into the down-projection: use placement='fold'"
        )


def _report(
    disk: DiskModel,
    config: ReplaceMeConfig,
    spans: Sequence[Span],
    fitted: Sequence[Fitted],
    rows: int,
    profile: DistanceProfile | None,
) -> ReplaceMeReport:
    tensors = disk.checkpoint.tensors
    before = sum(math.prod(info.shape) for info in tensors.values())
    removed = sum(
        math.prod(tensors[key].shape)
        for s in spans
        for b in range(s.start, s.stop)
        for key in disk.block_keys(b).values()
    )
    return ReplaceMeReport(
        objective=config.objective,
        structure=config.structure,
        placement=config.placement,
        metric=config.distance,
        spans=list(spans),
        transforms=[f.transform for f in fitted],
        conditions=[f.condition for f in fitted],
        objectives=[f.objective for f in fitted],
        blocks_before=disk.num_blocks,
        blocks_after=disk.num_blocks - sum(s.num_blocks for s in spans),
        params_before=before,
        params_after=before - removed,
        rows=rows,
        profile=profile,
        buffer_bytes=sum(f.buffer_bytes for f in fitted),
        rows_kept=sum(f.rows_kept for f in fitted),
        fit=config.fit,
        check_note="none (from disk: every batch fits and the distance chooses the cut; "
        "the check runs in memory)"
        if config.holdout and config.objective != "identity"
        else "",
    )
