"""Moments of a checkpoint's states, calibrated block by block from disk.

:func:`capture_moments_from_disk` is :func:`toast.hf.capture_moments` for a
model bigger than memory. The blocks run one at a time
(:func:`toast.hf.capture.sequential.stream_blocks`) and the chosen tokens of the
chosen states wait on disk (one file with no name per state in the
temporary directory, freed on every exit, ``kill -9`` included). Two ways, by ``pairs``:

- every pair (``pairs="all"``, or a span reaching every pair): once the
  last chosen state is known, every batch's states are read back and added
  to the same accumulator as the in-memory pass
  (:class:`toast.hf.capture.states.MomentsSink`), batch by batch in the same
  order, so the moments are the in-memory ones. The disk holds every
  chosen state of every calibration token (``states × tokens × dim``).
- moments above ``statistics_bytes`` (rows on disk,
  :class:`toast.core.chunked.ChunkedMoments`): each state's rows go
  straight into the moments' own buffer as the state arrives, written
  once; an ``observe`` then reads every batch's rows back from it.
- a bounded span ``m`` (``"consecutive"`` is 1): each state is added as it
  arrives, paired with the ``m`` states before it
  (:class:`toast.hf.capture.torch_moments.WindowedMoments`), and a state's file is
  deleted once the window has passed it, so the disk holds ``m + 1``
  states. The kept sums are the in-memory ones to rounding; the row
  statistics of pairs further apart than ``m`` are NaN (they need both
  states at once), as their linear errors already are.

Memory holds one batch of the states either way.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch

from toast._scratch import scratch_place
from toast.core import Moments, NonFiniteError, Pairs
from toast.core.chunked import ChunkedMoments, resolve_bound
from toast.core.moments import pair_span
from toast.hf.capture.sequential import DiskModel, DiskStates, stream_blocks
from toast.hf.capture.states import (
    MomentsSink,
    Tokens,
    check_states,
    naming_state,
    select_tokens,
    statistics_bound,
)
from toast.hf.capture.torch_moments import WindowedMoments
from toast.hf.data.calibration import Calibration
from toast.hf.model.blocks import BlockStack

__all__ = ["Observer", "capture_moments_from_disk"]

#: ``observe(rows, mask)``: one batch's chosen states (``rows[k]``) and the
#: token rows that enter the statistics.
Observer = Callable[[list[torch.Tensor], "torch.Tensor | None"], Any]


def capture_moments_from_disk(
    disk: DiskModel,
    loader: Iterable,
    *,
    states: Sequence[int] | None = None,
    tokens: Tokens = "all",
    folds: int = 5,
    pairs: Pairs = "all",
    precision: Literal["float64", "mixed"] = "float64",
    backend: Literal["auto", "c", "torch"] = "auto",
    calibration: Calibration | None = None,
    buffer_dir: str | os.PathLike | None = None,
    observe: Observer | None = None,
    statistics_bytes: int | str | None = None,
) -> tuple[Moments | ChunkedMoments, BlockStack]:
    """The moments :func:`toast.hf.capture_moments` gives on the loaded model,
    from the checkpoint ``disk`` (see the module docstring: with a bounded
    ``pairs`` span only that many states wait on disk). Blocks after the
    last chosen state do not run. ``observe(rows, mask)`` sees every batch
    the moments see, every chosen state at once, as in memory (so with it
    every chosen state waits on disk, whatever ``pairs``). Moments above
    ``statistics_bytes`` are kept as rows on disk, as in memory
    (:class:`toast.core.chunked.ChunkedMoments`)."""
    cal = Calibration.from_options(calibration)
    chosen = check_states(states, disk.num_blocks + 1)
    bound = statistics_bound(statistics_bytes, cal)
    sink = MomentsSink(states, folds, pairs, precision, backend, bound)
    span = pair_span(pairs, len(chosen))
    width = getattr(disk.model.config, "hidden_size", None)
    chunked = bound is not None and (
        not isinstance(width, int)
        or Moments.estimate_nbytes(len(chosen), width, folds, pairs)
        > resolve_bound(bound, width, folds)
    )
    windowed = (
        span < len(chosen) - 1 and chosen == sorted(chosen) and observe is None and not chunked
    )
    if cal.progress:
        kept = span + 1 if windowed else len(chosen)
        print(
            f"toast: keeping {kept} of {len(chosen)} states of every calibration token "
            f"in {scratch_place(buffer_dir)}",
            file=sys.stderr,
        )
    moments: Moments | ChunkedMoments | None
    if windowed:
        moments = _windowed(disk, loader, chosen, tokens, sink, span, cal, buffer_dir)
    elif chunked and isinstance(width, int):
        assert bound is not None  # chunked: there is a bound
        buffer = ChunkedMoments(
            len(chosen),
            width,
            folds,
            pairs,
            precision,
            resolve_bound(bound, width, folds),
            directory=buffer_dir,
        )
        moments = _streamed(disk, loader, chosen, tokens, sink, buffer, observe, cal, buffer_dir)
    else:
        consume = sink if observe is None else _observed(sink, observe)
        _all_pairs(disk, loader, chosen, tokens, consume, cal, buffer_dir)
        moments = sink.collected()
    return sink.finish(moments, len(chosen), cal), disk.stack


def _observed(sink: MomentsSink, observe: Observer) -> Observer:
    def consume(rows: list[torch.Tensor], mask: torch.Tensor | None) -> None:
        observe(rows, mask)
        sink(rows, mask)

    return consume


def _all_pairs(
    disk: DiskModel,
    loader: Iterable,
    chosen: list[int],
    tokens: Tokens,
    sink: Observer,
    cal: Calibration,
    buffer_dir: str | os.PathLike | None,
) -> None:
    """Every chosen state on disk, then every batch into ``sink`` in order."""
    stores = {k: DiskStates(buffer_dir, torch.float32) for k in chosen}
    masks: list[torch.Tensor | None] = []

    def on_state(state: int, batch: int, hidden: torch.Tensor, mask: torch.Tensor | None) -> None:
        if state not in stores:
            return
        (rows,), row_mask = select_tokens([hidden], mask, tokens)
        stores[state].append(rows)
        if state == chosen[0]:
            masks.append(row_mask)

    try:
        stream_blocks(
            disk, loader, on_state, cal, upto=max(chosen), buffer_dir=buffer_dir, desc="moments"
        )
        for batch, mask in enumerate(masks):
            sink([stores[k].read(batch) for k in chosen], mask)
    finally:
        for store in stores.values():
            store.close()


def _streamed(
    disk: DiskModel,
    loader: Iterable,
    chosen: list[int],
    tokens: Tokens,
    sink: MomentsSink,
    buffer: ChunkedMoments,
    observe: Observer | None,
    cal: Calibration,
    buffer_dir: str | os.PathLike | None,
) -> ChunkedMoments:
    """Every chosen state's rows written once, straight into ``buffer``
    (the moments' rows on disk) as the state arrives; ``observe`` then sees
    each batch's rows of every state, read back from it (masked already)."""
    position = {state: p for p, state in enumerate(chosen)}
    chosen_at = range(len(chosen))
    counts: list[int] = []  # rows of each batch, in order

    def on_state(state: int, batch: int, hidden: torch.Tensor, mask: torch.Tensor | None) -> None:
        p = position.get(state)
        if p is None:
            return
        (rows,), row_mask = select_tokens([hidden], mask, tokens)
        before = buffer.row_count(p)
        try:
            buffer.append_state(p, rows, row_mask)
        except NonFiniteError as exc:
            raise naming_state(p, chosen) from exc
        if p == 0:
            counts.append(buffer.row_count(p) - before)
            sink.samples += int(rows.shape[0])

    try:
        stream_blocks(
            disk, loader, on_state, cal, upto=max(chosen), buffer_dir=buffer_dir, desc="moments"
        )
        buffer.complete()
        if observe is not None:
            start = 0
            for count in counts:
                stop = start + count
                observe(
                    [torch.from_numpy(buffer.row_range(p, start, stop).copy()) for p in chosen_at],
                    None,
                )
                start = stop
    except BaseException:
        buffer.close()
        raise
    return buffer


def _windowed(
    disk: DiskModel,
    loader: Iterable,
    chosen: list[int],
    tokens: Tokens,
    sink: MomentsSink,
    span: int,
    cal: Calibration,
    buffer_dir: str | os.PathLike | None,
) -> Moments | None:
    """Each state added as it arrives, with the ``span`` states before it
    read back from disk; files closed (freed) once the window has passed them."""
    position = {state: p for p, state in enumerate(chosen)}
    stores: dict[int, DiskStates] = {}
    masks: list[torch.Tensor | None] = []
    acc: list[WindowedMoments] = []

    def on_state(state: int, batch: int, hidden: torch.Tensor, mask: torch.Tensor | None) -> None:
        p = position.get(state)
        if p is None:
            return
        (rows,), row_mask = select_tokens([hidden], mask, tokens)
        if p == 0:
            masks.append(row_mask)
            sink.samples += int(rows.shape[0])
        if not acc:
            acc.append(_open_windowed(sink, len(chosen), rows))
        if batch == 0 and p - span - 1 in stores:  # out of every later window
            stores.pop(p - span - 1).close()
        window = [stores[q].read(batch) for q in range(max(p - span, 0), p)]
        try:
            acc[0].add_state(p, [*window, rows], masks[batch])
        except NonFiniteError as exc:
            raise naming_state(p, chosen) from exc
        if p < len(chosen) - 1:
            if batch == 0:
                stores[p] = DiskStates(buffer_dir, rows.dtype)
            stores[p].append(rows)

    try:
        stream_blocks(
            disk, loader, on_state, cal, upto=max(chosen), buffer_dir=buffer_dir, desc="moments"
        )
    finally:
        for store in stores.values():
            store.close()
    return acc[0].to_moments() if acc and acc[0].rows else None


def _open_windowed(sink: MomentsSink, num_states: int, rows: torch.Tensor) -> WindowedMoments:
    return WindowedMoments(
        num_states,
        int(rows.shape[-1]),
        folds=sink.folds,
        pairs=sink.pairs,
        precision=sink.precision,
        device=rows.device,
    )
