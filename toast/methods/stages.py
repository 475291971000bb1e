"""The stage API every method implements, so that ``toast.search`` can run
a method in parts: what it needs captured, its calibration, the plans it
proposes and how a plan is applied.

Data flows one way. :func:`toast.methods.base.find_layout` finds the
model's structure once (:class:`Layout`); the union of the methods'
:class:`Needs` decides whether the one shared pass runs
(:func:`capture_shared`: moments of every pair of block states, and the
rows with massive activations); each method's ``calibrate`` turns that
(plus, where it must, a pass of its own) into its :class:`Stats`;
``propose`` gives :class:`Plan` s with exact sizes and predicted errors
(:mod:`toast.methods.plan`; a method's own setting rides in its
:class:`Part`);
``apply`` patches a model in place (the caller copies it first).

On a checkpoint too big to load (:class:`toast.hf.capture.disk_model.DiskModel`)
the same stages run block by block: :func:`capture_shared_from_disk`
gives the same shared pass, ``calibrate_from_disk`` the same Stats (None:
the method needs the model in memory), ``edits`` a plan as changes of the
blocks while they load (measured by
:class:`toast.hf.evaluate.from_disk.SequentialEvaluator`) and
``save_from_disk`` writes the planned model without loading it.

This module imports no torch at import time (configs and the CLI's help
read the registry without it).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from toast.core import Moments, error_matrix
from toast.core.chunked import ChunkedMoments, PairMoments, pair_moments_nbytes
from toast.hf.data.calibration import Calibration
from toast.hf.data.progress import progress_counter
from toast.methods.choice import first_choice
from toast.methods.plan import Part, Plan

if TYPE_CHECKING:
    import os
    from pathlib import Path

    import torch
    from torch import nn

    from toast.hf.capture.massive import MassiveRows
    from toast.hf.capture.sequential import BlockEdits, DiskModel
    from toast.hf.model.blocks import BlockStack
    from toast.spans import Span

__all__ = [
    "BaseStages",
    "Layout",
    "Needs",
    "Part",
    "Plan",
    "Request",
    "SHARED_BYTES",
    "SHARED_METRICS",
    "Shared",
    "Sizes",
    "Stages",
    "Stats",
    "capture_shared",
    "capture_shared_from_disk",
]


@dataclass(frozen=True)
class Layout:
    """The model's structure, found once per public call and passed down:
    the block stack, and each method's own structure found with it
    (``parts[name]``, e.g. ToaSt's ViT blocks; absent when the method has
    none or does not apply). A deep copy taken together with the model
    (``copy.deepcopy((model, layout))``) describes the copy."""

    stack: BlockStack
    parts: dict[str, Any] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return self.stack.num_blocks

    def part(self, name: str) -> Any:
        """The structure method ``name`` found (None if none)."""
        return self.parts.get(name)


@dataclass(frozen=True)
class Needs:
    """What a method needs captured before it can propose: ``moments``,
    the moments of every pair of block states (the shared pass). A
    method's own extra pass, if any, is its ``calibrate``'s business."""

    moments: bool = False

    def __or__(self, other: Needs) -> Needs:
        return Needs(moments=self.moments or other.moments)


#: The shared pass's moments above this many bytes keep the rows on disk
#: (:class:`toast.core.chunked.ChunkedMoments`): the error tables of
#: :data:`SHARED_METRICS` are then formed in one replay, a chunk at a time.
#: "auto": 1 GiB, or what one pair's errors need when wider
#: (:func:`toast.core.chunked.resolve_bound`).
SHARED_BYTES: int | str = "auto"

#: The metrics the methods read from the shared pass (linear ones by GCV, no ridge;
#: "cosine", mean 1 − cos per row, is ShortGPT's Block Influence between adjacent states).
SHARED_METRICS = ("linear", "affine", "mse", "cosine")


def _gcv_errors(moments: Moments, metric: str) -> np.ndarray:
    """Every span's GCV error in ``metric`` (no ridge), NaN beyond the pairs
    the moments reach."""
    with warnings.catch_warnings():
        # a search compares measured plans; ill-conditioned spans just rank badly
        warnings.simplefilter("ignore")
        table = error_matrix(moments, metric=metric, estimator="gcv", ridge=0.0)
    far = np.triu(np.ones(table.shape, dtype=bool), moments.layout()["span"] + 1)
    table[far] = np.nan
    return table


@dataclass
class Shared:
    """The shared pass: moments of every pair of block states (no folds:
    the generalised cross-validation estimator needs none) and the rows
    massive in some state, for the blocks at ``block_path``. Above
    :data:`SHARED_BYTES` the moments are rows on disk and ``tables`` holds
    every metric's errors (formed in one replay) and ``traces`` each
    state's ``tr(XᵀX)``; :meth:`pairs` keeps what fits of chosen spans need
    before :meth:`close` frees the rows."""

    moments: Moments | ChunkedMoments
    massive: MassiveRows | None
    block_path: str
    #: the tables computed, by metric: several methods ask for the same one
    #: (TOAST's and ReplaceMe's "linear"), and each costs a solve per span;
    #: chunked moments form every shared metric's in one replay up front
    tables: dict[str, np.ndarray] = field(default_factory=dict, repr=False, compare=False)
    traces: np.ndarray | None = field(default=None, repr=False)
    #: whether forming the tables from rows on disk counts its replays
    progress: bool = field(default=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        moments = self.moments
        if isinstance(moments, ChunkedMoments) and not self.tables:
            count = progress_counter("errors (rows on disk)", "replay", not self.progress)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # as in errors()
                requests = [(m, "gcv", 0.0) for m in SHARED_METRICS]
                found = moments.error_matrices(requests, on_replay=count)
            self.tables = dict(zip(SHARED_METRICS, found, strict=True))
            self.traces = moments.traces()

    def errors(self, metric: str) -> np.ndarray:
        """Every span's error in ``metric`` (GCV estimator, no ridge), NaN
        for spans beyond the pairs the moments reach (a copy: computed once
        per metric)."""
        if metric not in self.tables:
            moments = self.moments
            assert isinstance(moments, Moments), f"{metric} is not a shared metric"
            self.tables[metric] = _gcv_errors(moments, metric)
        return self.tables[metric].copy()

    def state_traces(self) -> np.ndarray:
        """``tr(X_jᵀ X_j)`` of every state."""
        if self.traces is None:
            m = self.moments
            assert isinstance(m, Moments)
            self.traces = np.array([np.trace(m.cross(j, j)) for j in range(m.num_states)])
        return self.traces

    def pairs(self, spans: Iterable[tuple[int, int]]) -> Moments | PairMoments:
        """What fits of ``spans`` read, kept beyond the pass: the whole
        moments, or from rows on disk the two-state moments of as many of
        ``spans``, in their order, as fit the memory the errors' replays
        held (twice the bound: :meth:`ChunkedMoments.pair` forms ``2 d²``
        doubles a span, 256 MiB at width 4,096, and a search's plans can
        name a hundred spans); :attr:`PairMoments.spans` says which."""
        if not isinstance(self.moments, ChunkedMoments):
            return self.moments
        room = max(2 * self.moments.bound // pair_moments_nbytes(self.moments.dim), 1)
        return PairMoments(self.moments, list(dict.fromkeys(spans))[:room], self.state_traces())

    def close(self) -> None:
        """Frees the rows on disk (the tables stay)."""
        if isinstance(self.moments, ChunkedMoments):
            self.moments.close()


#: What the shared pass captures, in memory and from disk alike: every token
#: of every block state, every pair, in float64, no folds.
SHARED_PASS: dict[str, Any] = {
    "tokens": "all",
    "folds": 0,
    "pairs": "all",
    "precision": "float64",
}


def shared_pass(max_blocks: int | None) -> dict[str, Any]:
    """:data:`SHARED_PASS` for plans of at most ``max_blocks`` blocks: a span
    ``(i, j)`` replaces ``j - i`` blocks, so no plan joins states further
    apart and the moments keep pairs up to that span (the same errors for
    every span a plan can hold)."""
    return {**SHARED_PASS, "pairs": "all" if max_blocks is None else max_blocks}


def capture_shared(
    model: nn.Module,
    data: Iterable,
    layout: Layout,
    calibration: Calibration,
    backend: str,
    max_blocks: int | None = None,
    statistics_bytes: int | str = SHARED_BYTES,
    observe: Callable[[list[torch.Tensor], torch.Tensor | None], Any] | None = None,
) -> Shared:
    """The one pass over ``data`` that every method needing moments shares
    (pairs up to ``max_blocks`` apart, see :func:`shared_pass`; above
    ``statistics_bytes`` the rows wait on disk, see :class:`Shared`).
    ``observe(rows, mask)`` sees every batch's states too (another
    statistic formed in the same pass)."""
    from toast.hf.capture.distributed import Observers
    from toast.hf.capture.massive import MassiveRows
    from toast.hf.capture.states import capture_moments

    recorder = MassiveRows()
    # one object, so that a sharded pass combines both statistics over the ranks
    seen = Observers(recorder, observe)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        moments, stack = capture_moments(
            model,
            data,
            backend=backend,  # type: ignore[arg-type]
            calibration=calibration,
            stack=layout.stack,
            observe=seen,
            statistics_bytes=statistics_bytes,
            **shared_pass(max_blocks),
        )
    return Shared(moments, recorder, stack.path, progress=calibration.progress)


def capture_shared_from_disk(
    disk: DiskModel,
    data: Iterable,
    calibration: Calibration,
    backend: str,
    max_blocks: int | None = None,
    statistics_bytes: int | str = SHARED_BYTES,
) -> Shared:
    """:func:`capture_shared` for a checkpoint on disk, block by block: the
    same moments and massive rows (the accumulator and its order are the
    in-memory pass's)."""
    from toast.hf.capture.disk_moments import capture_moments_from_disk
    from toast.hf.capture.massive import MassiveRows

    recorder = MassiveRows()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        moments, stack = capture_moments_from_disk(
            disk,
            data,
            backend=backend,  # type: ignore[arg-type]
            calibration=calibration,
            observe=recorder,
            statistics_bytes=statistics_bytes,
            **shared_pass(max_blocks),
        )
    return Shared(moments, recorder, stack.path, progress=calibration.progress)


@dataclass
class Stats:
    """What a method's calibration left (methods subclass it with their
    own fields): ``passes`` over the data it made beyond the shared one,
    ``note`` why it proposes nothing ("" when it does)."""

    passes: int = 0
    note: str = ""


@dataclass(frozen=True)
class Sizes:
    """What every plan's size is made of, read once from the model:
    parameters of the whole model and of each block."""

    params: int
    block_params: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.block_params)

    def after_spans(self, spans: Sequence[tuple[int, int]], added_per_span: int = 0) -> int:
        """Parameters once ``spans`` are removed, each replaced by a module
        of ``added_per_span`` parameters."""
        removed = sum(sum(self.block_params[a:b]) for a, b in spans)
        return self.params - removed + len(spans) * added_per_span


@dataclass(frozen=True)
class Request:
    """What one ``compress`` call asks of a method: a plan removing exactly
    ``count`` of the method's units (blocks, a span replaced by a
    translator counting as removed; sub-layers for ``sublayer``: see
    :meth:`BaseStages.amount`), or exactly ``spans``."""

    count: int | None = None
    spans: tuple[tuple[int, int], ...] | None = None

    @classmethod
    def of(cls, config: Any) -> Request:
        """The request a config makes through its ``num_blocks`` and
        ``spans`` fields (one of them set; the config checked that)."""
        spans = getattr(config, "spans", None)
        if spans is not None:
            return cls(spans=tuple((int(a), int(b)) for a, b in spans))
        return cls(count=getattr(config, "num_blocks", None))

    @property
    def reach(self) -> int:
        """How far calibration must cover: the widest span, or the count
        (0 when neither is set: the method's options fix its plan)."""
        if self.spans is not None:
            return max(b - a for a, b in self.spans)
        return 0 if self.count is None else self.count


@runtime_checkable
class Stages(Protocol):
    """The parts of a method ``toast.search`` runs (see the module docstring).

    ``structure(model, stack)``: the method's own view of the model, found
    once with the block stack (None: none, or the method does not apply);
    ``needs(layout)``: what it must have captured; ``calibrate(model, data,
    layout, shared, calibration, max_blocks)``: its :class:`Stats` from
    the shared pass (None when no method needed it) and any pass of its
    own; ``propose(stats, sizes, max_blocks, macs_matter)``: its plans
    removing at most ``max_blocks`` blocks (``macs_matter``: the target
    counts MACs, so plans that save only MACs are worth proposing);
    ``extend(plan, stats, sizes)``: another method's extendable plan
    combined with this method (none: ``[]``); ``apply(model, plan,
    stats, layout)``: the plan's weight changes, in place; ``finish(model,
    plan, stats, layout)``: what it changes at run time only (after any
    count of the weights' MACs).

    On a checkpoint on disk (``disk``, never loaded whole):
    ``calibrate_from_disk(disk, data, layout, shared, calibration,
    max_blocks)``: the Stats ``calibrate`` gives on the loaded model, or
    None when the method needs the model in memory (it is then left out);
    ``prepare_from_disk(disk, plan, stats)``: what applying the chosen
    plan computes before the model is measured or written (its fits and
    their checks, kept in ``stats``; ``toast.compress`` only);
    ``edits(disk, plan, stats)``: the plan as changes of the blocks while
    they load; ``save_from_disk(disk, plan, stats, output, report)``: the
    planned model written to the new folder ``output``, reloadable as the
    in-memory model's save is, with ``report`` (markdown) in its model card
    where its format has one.

    What ``toast.compress`` reads beside them (:mod:`toast.methods.driver`):
    ``configured(config)``: the stages with the user's options (the search
    runs the defaults); ``request(config)``: the size or spans the config
    asks for (:class:`Request`); ``reach(request)``: how far apart the
    states calibration pairs must be (the request's reach, by default);
    ``amount(plan)``: the plan's size in the request's unit (blocks
    removed, by default); ``choose(plans, request)``: the plan ``compress``
    applies among the proposed (None: none fits; by default
    :func:`toast.methods.choice.first_choice`, what a search of one
    measurement takes);
    ``check(request, layout)``: raises ``ValueError``,
    before any pass, for a request the method can never meet;
    ``needs_data(request)``: whether the request needs calibration data
    (given spans of plain removal do not); ``data_optional(request)``:
    whether that calibration also runs without data, ``calibrate`` then
    called with ``data=None`` (False by default: no data is an error; the
    token reducers' and ToaSt's configured stages read data only where
    given: an image's size, the fine-tune's batches);
    ``layout(model, blocks)``: the model's :class:`Layout` where the method
    finds it otherwise than the registry does, in memory (None by default:
    :func:`toast.methods.base.find_layout`; ToaSt's configured stages find
    its ViT blocks, Swin's across stages that hold no one block list);
    ``given(spans, stats, sizes)``:
    the plan of exactly those spans; ``scores(plan, stats)``: each span's
    score for the report; ``report(plan, stats, sizes, spans, params_after)``:
    the method's report of the applied plan (None: the driver's own);
    ``from_disk``: whether ``compress`` may run the stages block by block
    on a checkpoint (``calibrate_from_disk``, ``edits``, ``save_from_disk``).

    What a checkpoint folder's memory plan reads (:mod:`toast.methods.pipeline`):
    ``on_either_path(config)``: ``config`` as both paths run it (what only
    the in-memory path can do left out), so that the path memory chooses
    never changes the result (``config`` itself by default);
    ``within_memory(config, states, width, room, tokens)``: ``config`` with
    its statistics fitted to ``room`` bytes for ``states`` block states of
    width ``width`` (``tokens``: each calibration batch's, when the data
    say), and what they then take as ``(label, bytes)`` parts
    (the least they can take when even that exceeds ``room``: the plan then
    refuses the run; ``(config, [])`` by default: nothing worth planning);
    ``statistics_apart``: whether those statistics are formed after stage 0
    and freed before the held-out passes, so never beside the embedding or
    the head, except the last part ``within_memory`` returns.
    """

    from_disk: bool
    statistics_apart: bool

    def structure(self, model: nn.Module, stack: BlockStack) -> Any: ...

    def configured(self, config: Any) -> Stages: ...

    def on_either_path(self, config: Any) -> Any: ...

    def within_memory(
        self, config: Any, states: int, width: int, room: int, tokens: Sequence[int] | None = None
    ) -> tuple[Any, list[tuple[str, int]]]: ...

    def request(self, config: Any) -> Request: ...

    def reach(self, request: Request) -> int: ...

    def amount(self, plan: Plan) -> int: ...

    def choose(self, plans: Sequence[Plan], request: Request) -> Plan | None: ...

    def check(self, request: Any, layout: Layout) -> None: ...

    def needs_data(self, request: Any) -> bool: ...

    def data_optional(self, request: Any) -> bool: ...

    def layout(self, model: nn.Module, blocks: str | None) -> Layout | None: ...

    def given(self, spans: tuple[tuple[int, int], ...], stats: Stats, sizes: Sizes) -> Plan: ...

    def scores(self, plan: Plan, stats: Stats) -> list[float]: ...

    def report(
        self, plan: Plan, stats: Stats, sizes: Sizes, spans: Sequence[Span], params_after: int
    ) -> Any: ...

    def needs(self, layout: Layout) -> Needs: ...

    def calibrate(
        self,
        model: nn.Module,
        data: Iterable,
        layout: Layout,
        shared: Shared | None,
        calibration: Calibration,
        max_blocks: int,
    ) -> Stats: ...

    def propose(
        self, stats: Stats, sizes: Sizes, max_blocks: int, macs_matter: bool
    ) -> list[Plan]: ...

    def extend(self, plan: Plan, stats: Stats, sizes: Sizes) -> list[Plan]: ...

    def apply(self, model: nn.Module, plan: Plan, stats: Stats, layout: Layout) -> None: ...

    def finish(self, model: nn.Module, plan: Plan, stats: Stats, layout: Layout) -> None: ...

    def calibrate_from_disk(
        self,
        disk: DiskModel,
        data: Iterable,
        layout: Layout,
        shared: Shared | None,
        calibration: Calibration,
        max_blocks: int,
    ) -> Stats | None: ...

    def edits(self, disk: DiskModel, plan: Plan, stats: Stats) -> BlockEdits: ...

    def prepare_from_disk(self, disk: DiskModel, plan: Plan, stats: Stats) -> None: ...

    def save_from_disk(
        self,
        disk: DiskModel,
        plan: Plan,
        stats: Stats,
        output: str | os.PathLike,
        report: str | None = None,
    ) -> Path: ...


class BaseStages:
    """Defaults for :class:`Stages`: no structure of its own, nothing
    captured, no extension, nothing at run time, and no disk path (the
    method runs in memory only). ``chain_last``: the method extends other
    methods' plans after every method that does not say so (the token
    reducers, which act on a built model's tokens at run time)."""

    chain_last = False
    from_disk = False
    statistics_apart = False
    #: why ``calibrate_from_disk`` gives None with these options, for the
    #: refusal of ``compress`` on the block-by-block path ("": not said)
    in_memory_because = ""

    def structure(self, model: nn.Module, stack: BlockStack) -> Any:
        return None

    def configured(self, config: Any) -> Stages:
        assert isinstance(self, Stages)  # every subclass implements the rest
        return self

    def on_either_path(self, config: Any) -> Any:
        return config

    def within_memory(
        self, config: Any, states: int, width: int, room: int, tokens: Sequence[int] | None = None
    ) -> tuple[Any, list[tuple[str, int]]]:
        return config, []

    def request(self, config: Any) -> Request:
        return Request.of(config)

    def reach(self, request: Request) -> int:
        return request.reach

    def amount(self, plan: Plan) -> int:
        return plan.blocks_removed

    def choose(self, plans: Sequence[Plan], request: Request) -> Plan | None:
        if request.count is None:
            raise ValueError(f"{type(self).__name__} needs a size: give num_blocks=")
        return first_choice(plans, request.count, self.amount)

    def check(self, request: Any, layout: Layout) -> None:
        total, asked = layout.num_blocks, request.count
        if asked is not None and asked >= total:
            raise ValueError(f"num_blocks={asked} leaves no block of {total}; remove fewer")

    def needs_data(self, request: Any) -> bool:
        return True

    def data_optional(self, request: Any) -> bool:
        return False

    def layout(self, model: nn.Module, blocks: str | None) -> Layout | None:
        return None  # the registry's find_layout: every staged method's structure

    def given(self, spans: tuple[tuple[int, int], ...], stats: Stats, sizes: Sizes) -> Plan:
        raise ValueError(f"{type(self).__name__} takes no explicit spans; give num_blocks=")

    def scores(self, plan: Plan, stats: Stats) -> list[float]:
        return [math.nan] * len(plan.spans)

    def report(
        self, plan: Plan, stats: Stats, sizes: Sizes, spans: Sequence[Span], params_after: int
    ) -> Any:
        return None

    def needs(self, layout: Layout) -> Needs:
        return Needs()

    def extend(self, plan: Plan, stats: Stats, sizes: Sizes) -> list[Plan]:
        return []

    def finish(self, model: nn.Module, plan: Plan, stats: Stats, layout: Layout) -> None:
        return None

    def calibrate_from_disk(
        self,
        disk: DiskModel,
        data: Iterable,
        layout: Layout,
        shared: Shared | None,
        calibration: Calibration,
        max_blocks: int,
    ) -> Stats | None:
        return None

    def edits(self, disk: DiskModel, plan: Plan, stats: Stats) -> BlockEdits:
        raise NotImplementedError(f"{type(self).__name__} has no disk path")

    def prepare_from_disk(self, disk: DiskModel, plan: Plan, stats: Stats) -> None:
        return None

    def save_from_disk(
        self,
        disk: DiskModel,
        plan: Plan,
        stats: Stats,
        output: str | os.PathLike,
        report: str | None = None,
    ) -> Path:
        raise NotImplementedError(f"{type(self).__name__} has no disk path")
