"""Moments of a checkpoint's states, calibrated block by block from disk.

:func:`capture_moments_from_disk` is :func:`toast.capture_moments` for a
model bigger than memory. The blocks run one at a time
(:func:`toast.hf.sequential.stream_blocks`); the chosen tokens of every
chosen state wait on disk (one file per state in a temporary directory,
removed on every exit); once the last chosen state is known, every batch's
states are read back and added to the same accumulator as the in-memory
pass (:class:`toast.hf.capture.MomentsSink`), batch by batch in the same
order, so the moments are the in-memory ones. The disk holds every chosen
state of every calibration token (``states × tokens × dim`` in the model's
dtype); memory holds one batch of them.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Sequence
from typing import Literal

import torch

from toast.core import Moments, Pairs
from toast.hf.blocks import BlockStack
from toast.hf.calibration import Calibration
from toast.hf.capture import MomentsSink, Tokens, _check_states, select_tokens
from toast.hf.sequential import DiskModel, DiskStates, stream_blocks

__all__ = ["capture_moments_from_disk"]


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
) -> tuple[Moments, BlockStack]:
    """The moments :func:`toast.capture_moments` gives on the loaded model,
    from the checkpoint ``disk`` (see the module docstring). Blocks after
    the last chosen state do not run."""
    cal = Calibration.from_options(calibration)
    chosen = _check_states(states, disk.num_blocks + 1)
    sink = MomentsSink(states, folds, pairs, precision, backend)
    folder = tempfile.mkdtemp(prefix="toast-moments-", dir=buffer_dir)
    stores = {k: DiskStates(os.path.join(folder, f"state{k}.bin"), torch.float32) for k in chosen}
    masks: list[torch.Tensor | None] = []
    if cal.progress:
        print(
            f"toast: keeping {len(chosen)} states of every calibration token in {folder}",
            file=sys.stderr,
        )

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
        shutil.rmtree(folder, ignore_errors=True)
    return sink.result(len(chosen), cal), disk.stack
