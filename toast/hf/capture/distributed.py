"""Moments across processes: sum :class:`toast.Moments` over torch.distributed ranks.

Every quantity a :class:`~toast.Moments` keeps is a float64 sum (row counts,
column sums, row statistics, cross blocks), so combining the moments of
several processes is one element-wise sum: each rank accumulates its shard of
the rows, then :func:`all_reduce_moments` (``toast.hf.all_reduce_moments``)
replaces every rank's moments by the sum over all ranks, after which every
rank computes the same error matrices and translators.

::

    import torch.distributed as dist, toast

    dist.init_process_group("gloo")              # or "nccl", see below
    m = toast.Moments(S, d, folds=5)
    for batch in my_shard_of_the_data:           # e.g. rows rank::world_size
        m.update(states_of(batch), fold=global_row_ids % 5)
    toast.hf.all_reduce_moments(m)                  # every rank: moments of all rows
    E = toast.error_matrix(m, "linear", "cv")

Notes:

* All ranks must hold moments of the same layout: ``num_states``, ``dim``,
  ``folds``, ``span`` (from ``pairs``) and ``precision``. This is checked
  first (one all_gather of six int64 values: those and the storage length
  the core reports); on a mismatch every rank raises
  the same :class:`ValueError`, which names the field and the ranks' values,
  and nothing is summed.
* Folds: without explicit ``fold=`` ids, rows are dealt to folds by each
  process's own row counter, so a sharded run gets a valid K-fold split but
  not the one a single process would have made. Pass ``fold=`` ids computed
  from global row numbers to reproduce the single-process split exactly.
* The reduction is in place: after it, each rank holds the total. Calling it
  again (after more updates) would count the earlier rows ``world_size``
  times; to keep streaming, all_reduce fresh per-step moments and
  :meth:`~toast.Moments.merge` them into a running total.
* The storage (``Moments.nbytes``) is copied once into a torch tensor and
  reduced with one ``all_reduce(SUM)`` in float64; the row counter travels in
  the same buffer (exact up to 2**53 rows). Results are identical on every
  rank (the collective delivers the same sum everywhere), and equal a
  single-process run to rounding (the order of the additions differs).
* Backends: with ``gloo`` (or ``mpi``/``ucc``) the tensors stay on the CPU.
  With ``nccl`` they are moved to the current CUDA device
  (``torch.cuda.current_device()``: call ``torch.cuda.set_device(local_rank)``
  first, as usual with NCCL) and copied back afterwards; NCCL supports
  float64 sums. The moments themselves always live in host memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from toast import _core
from toast.core.moments import PRECISIONS

if TYPE_CHECKING:
    from toast.hf.data.calibration import Calibration

__all__ = [
    "Observers",
    "Ranks",
    "all_gather_rows",
    "all_reduce_moments",
    "all_reduce_sums",
    "broadcast_object",
    "owned_batches",
    "checked_batches",
    "check_same_batch",
    "ranks_of",
]

# Layout fields that must agree on every rank, in the order they are gathered
# (the layout's, then what the moments form: precision, row statistics, sources).
_FIELDS = (
    "num_states",
    "dim",
    "folds",
    "span",
    "storage_len",
    "precision",
    "row_stats",
    "sources",
)
_PRECISION_NAMES = {code: name for name, code in PRECISIONS.items()}


def _layout(moments: _core.Moments) -> list[int]:
    layout = moments.layout()
    formed = [moments._precision_code, moments._rowstats, moments._sources]
    return [*(int(layout[name]) for name in _FIELDS[:5]), *formed]


def _device_for(dist: Any, group: Any) -> Any:
    import torch

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_moments(moments: Any, group: Any = None) -> Any:
    """Sums ``moments`` over the ranks of ``group`` in place; returns ``moments``.

    Collective: every rank of ``group`` (default: the default process group)
    must call it. Raises :class:`ValueError` (on every rank) when the ranks'
    moments differ in num_states, dim, folds, span, precision, row statistics
    or sources, and
    :class:`RuntimeError` when torch.distributed is not initialised.
    """
    if not isinstance(moments, _core.Moments):
        raise TypeError(f"moments must be a toast.Moments, got {type(moments).__name__}")
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group() "
            "on every rank before all_reduce"
        )
    device = _device_for(dist, group)
    world = dist.get_world_size(group)

    # 1. Same layout everywhere? Every rank sees every layout, so all raise together.
    mine = torch.tensor(_layout(moments), dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    layouts = [[int(v) for v in t.cpu().tolist()] for t in gathered]
    for k, name in enumerate(_FIELDS):
        seen = [layout[k] for layout in layouts]
        if len(set(seen)) > 1:
            shown = [_PRECISION_NAMES.get(v, v) if name == "precision" else v for v in seen]
            per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(shown))
            raise ValueError(
                f"all_reduce: the ranks' moments differ in {name} ({per_rank}); every rank "
                "must build Moments with the same num_states, dim, folds, pairs, precision, "
                "row_stats and sources"
            )

    # 2. One float64 SUM of [storage..., rows].
    data = moments._get_data()
    buf = np.empty(len(data) + 1, dtype=np.float64)
    buf[:-1] = data
    buf[-1] = float(moments.rows)
    tensor = torch.from_numpy(buf).to(device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    total = tensor.cpu().numpy() if tensor.device.type != "cpu" else tensor.numpy()
    moments._set_data(np.ascontiguousarray(total[:-1]), int(round(float(total[-1]))))
    return moments


def is_distributed() -> bool:
    """Whether a torch.distributed default process group is initialised."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return dist.is_available() and dist.is_initialized()


def reduce_captured(
    moments: Any,
    num_states: int,
    folds: int,
    pairs: Any,
    precision: Literal["float64", "mixed"],
    group: Any = None,
) -> Any:
    """Sums the moments each rank captured from its shard of the data.

    ``moments`` is this rank's :class:`toast.Moments`, or None when its shard
    held no rows; such a rank joins with zero moments of the width the other
    ranks saw, so that no rank waits forever. Returns the summed moments on
    every rank, or None on every rank when no rank saw a row.
    """
    import torch
    import torch.distributed as dist

    from toast.core import Moments

    device = _device_for(dist, group)
    dim = torch.tensor([0 if moments is None else moments.dim], dtype=torch.int64, device=device)
    dist.all_reduce(dim, op=dist.ReduceOp.MAX, group=group)
    width = int(dim.item())
    if width == 0:
        return None
    if moments is None:
        moments = Moments(num_states, width, folds=folds, pairs=pairs, precision=precision)
    return all_reduce_moments(moments, group=group)


def broadcast_module(module: Any, group: Any = None, src: int = 0) -> Any:
    """Copies ``module``'s parameters and buffers from rank ``src`` to every
    rank (collective), so that a translator trained on one rank's sample is
    the same everywhere."""
    import torch.distributed as dist

    device = _device_for(dist, group)
    for tensor in [*module.parameters(), *module.buffers()]:
        staged = tensor.detach().to(device).contiguous()
        dist.broadcast(staged, src=src, group=group)
        with __import__("torch").no_grad():
            tensor.copy_(staged.to(tensor.device))
    return module


# -- sharding a pass over ranks ----------------------------------------------
#
# The one rule every sharded pass follows (calibration passes through
# toast.hf.capture.states.stream_states, held-out passes through
# toast.hf.evaluate.quality.Evaluator): every rank is given the same data,
# makes the same deterministic split a single process makes (held-out
# fraction, CheckSplit, max_batches / max_samples), and then forwards only
# the batches ``k`` of that list with ``k % world == rank``. Sums (counts,
# moments, distance and loss sums) are all_reduced in float64, so that
# whatever is chosen from them is the same on every rank and equal to one
# process's choice up to the order of the additions.


@dataclass(frozen=True)
class Ranks:
    """The ranks a pass is sharded over: this process is ``rank`` of
    ``world`` in ``group`` (None: the default group)."""

    rank: int
    world: int
    group: Any = None

    def owns(self, index: int) -> bool:
        """Whether batch ``index`` (of the list every rank sees) is this rank's."""
        return index % self.world == self.rank


def ranks_of(calibration: Calibration | None = None) -> Ranks | None:
    """The ranks a pass with ``calibration`` shards over: None for one
    process (no process group, ``distributed=False``, or a group of one),
    and for ``shard=False`` (each rank passes its own shard, used whole)."""
    from toast.hf.data.calibration import Calibration

    cal = calibration if calibration is not None else Calibration()
    if not cal.is_distributed or not cal.shard:
        return None
    import torch.distributed as dist

    world = dist.get_world_size(cal.group)
    return Ranks(dist.get_rank(cal.group), world, cal.group) if world > 1 else None


def owned_batches(batches: Iterable, ranks: Ranks | None) -> Iterator[Any]:
    """The batches of ``batches`` that are this rank's (all of them without ``ranks``)."""
    for index, batch in enumerate(batches):
        if ranks is None or ranks.owns(index):
            yield batch


def checked_batches(batches: Iterable, ranks: Ranks | None) -> Iterator[Any]:
    """:func:`owned_batches` of a sharded pass, its first batch checked to be
    every rank's (:func:`check_same_batch`; collective)."""
    for index, batch in enumerate(batches):
        if ranks is not None and index == 0:
            check_same_batch(batch, ranks)
        if ranks is None or ranks.owns(index):
            yield batch


def _tensors_in(value: Any) -> list[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    return []


def check_same_batch(batch: Any, ranks: Ranks) -> None:
    """Raises the same ``ValueError`` on every rank when ``batch`` (the first
    of a sharded pass) is not the same on every rank (collective): toast
    shards the data itself, so every rank must pass all of it; a rank
    passing only its own shard would calibrate on a fraction of it, silently.
    Compared by each tensor's element count, sum and sum of squares."""
    tensors = [t.detach() for t in _tensors_in(batch)]
    stats = [float(len(tensors))]
    for t in tensors:
        x = t.double()
        stats += [float(t.numel()), float(x.sum()), float((x * x).sum())]
    # ranks compare a fixed-length summary: the first tensors' only
    summary = np.full(1 + 3 * 8, np.nan)
    summary[: min(len(stats), summary.size)] = stats[: summary.size]
    seen = all_gather_rows(summary[None, :], ranks)
    if not all(np.array_equal(row, seen[0], equal_nan=True) for row in seen):
        raise ValueError(
            "under torch.distributed toast shards the data itself: every rank must pass the "
            "same batches, but the first batch differs between ranks; to calibrate each rank "
            "on its own shard instead, pass shard=False (toast.Calibration(shard=False))"
        )


def all_reduce_sums(values: Any, ranks: Ranks) -> np.ndarray:
    """``values`` (numbers or an array) summed over the ranks in float64;
    collective. Counts travel exactly up to 2**53."""
    import torch
    import torch.distributed as dist

    buf = np.ascontiguousarray(np.asarray(values, dtype=np.float64))
    device = _device_for(dist, ranks.group)
    tensor = torch.from_numpy(buf.copy()).to(device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=ranks.group)
    return tensor.cpu().numpy().reshape(buf.shape)


def all_gather_rows(array: np.ndarray, ranks: Ranks) -> np.ndarray:
    """Every rank's ``array`` (the same trailing shape and dtype; any number
    of rows, none included) concatenated in rank order; collective."""
    import torch
    import torch.distributed as dist

    if array.dtype == np.bool_:  # not every backend gathers bools: as bytes
        return all_gather_rows(array.astype(np.uint8), ranks).astype(np.bool_)
    device = _device_for(dist, ranks.group)
    array = np.ascontiguousarray(array)
    count = torch.tensor([array.shape[0]], dtype=torch.int64, device=device)
    counts = [torch.empty_like(count) for _ in range(ranks.world)]
    dist.all_gather(counts, count, group=ranks.group)
    sizes = [int(c.item()) for c in counts]
    most = max(sizes)
    if most == 0:
        return array[:0]
    # all_gather needs equal shapes: pad every rank's rows to the most any has
    padded = np.zeros((most, *array.shape[1:]), dtype=array.dtype)
    padded[: array.shape[0]] = array
    mine = torch.from_numpy(padded).to(device)
    parts = [torch.empty_like(mine) for _ in range(ranks.world)]
    dist.all_gather(parts, mine, group=ranks.group)
    return np.concatenate([p.cpu().numpy()[:n] for p, n in zip(parts, sizes, strict=True)])


def broadcast_object(value: Any, ranks: Ranks, src: int = 0) -> Any:
    """Rank ``src``'s ``value`` on every rank (collective; picklable values):
    for what is measured by the clock (throughput, time left), which
    differs between processes, so that every rank decides alike."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=src, group=ranks.group)
    return box[0]


class Observers:
    """Several ``observe(rows, mask)`` callables as one, each seeing every
    batch; :meth:`reduce_over` combines each one's statistic over the ranks
    of a sharded pass (those that define ``reduce_over``)."""

    def __init__(self, *observers: Callable[[list[Any], Any], Any] | None) -> None:
        self.observers = [o for o in observers if o is not None]

    def __call__(self, rows: list[Any], mask: Any) -> None:
        for observe in self.observers:
            observe(rows, mask)

    def reduce_over(self, ranks: Any) -> None:
        for observe in self.observers:
            reduce = getattr(observe, "reduce_over", None)
            if callable(reduce):
                reduce(ranks)
