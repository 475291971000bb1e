"""``torchrun -m toast compress|search ...``: the command line under
several processes.

torchrun starts one process per rank with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` in each one's environment. The commands
that calibrate then initialise the process group themselves (gloo on the
CPU, NCCL when they compute on CUDA), every rank reads the same data and
runs the same command, each forwarding its share of the batches
(:mod:`toast.hf.capture.distributed`), and only rank 0 writes the output
folder and prints the report; the group is destroyed at the end.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

__all__ = ["TORCHRUN_VARIABLES", "is_writer", "launched_group", "quiet_unless_writer"]

#: What torchrun sets in every process it starts.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _launched() -> bool:
    return all(os.environ.get(name) for name in TORCHRUN_VARIABLES)


@contextlib.contextmanager
def launched_group(device: str | None) -> Iterator[None]:
    """Within the block, the default process group torchrun's environment
    describes, when it describes one and none is initialised yet (then
    destroyed on the way out); otherwise nothing changes. ``device``: where
    the command computes (``"cuda..."``: NCCL, else gloo)."""
    if not _launched():
        yield
        return
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError(
            "launched by torchrun, but this torch has no torch.distributed: run one process"
        )
    if dist.is_initialized():  # the caller's own group
        yield
        return
    cuda = device is not None and device.startswith("cuda")
    if cuda:  # one GPU per rank, as NCCL wants
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()


def is_writer() -> bool:
    """Whether this process writes output and prints: one process, or rank 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def quiet_unless_writer(args: Any) -> bool:
    """Whether this process writes the command's output (:func:`is_writer`);
    the other ranks are made quiet (``--no-progress``, ``--quiet``): rank 0
    reports for all."""
    writer = is_writer()
    if not writer:
        args.no_progress = args.quiet = True
    return writer
