"""``toast.search``: the best compression of a model for a target, by
measurement.

Data flows one way: the calibration passes (or the cache) give moments
and ReplaceMe transforms; every applicable candidate is enumerated with
its exact size and predicted error; the best-predicted candidates of each
family are built from those calibrated pieces (no further calibration)
and measured on held-out data; the measured candidates give the Pareto
front and the chosen model.

A checkpoint folder goes the way ``toast.compress`` takes it
(:func:`toast.hf.capture.budget.plan_checkpoint`, said once): loaded when it fits
``max_memory``, else searched block by block from disk (the same stages,
:class:`~toast.frontier.bench.DiskBench`), never loaded.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from toast._validation import Interval, Options, Predicate, check
from toast.hf.capture.budget import ShapeOnce
from toast.hf.capture.distributed import broadcast_object, ranks_of
from toast.hf.capture.sequential import DiskModel
from toast.hf.data.calibration import BACKENDS, Calibration
from toast.hf.data.progress import progress_bar
from toast.hf.data.text import as_batches
from toast.hf.evaluate.paired import paired_stderr
from toast.methods.base import Layout, Method, Plan, Sizes, staged_methods
from toast.methods.calibrate import Calibrated, calibrate, calibrate_from_disk, model_sizes
from toast.methods.runner import heldout_batches, split_text_options
from toast.methods.stages import SHARED_BYTES

from .bench import Bench, DiskBench, MemoryBench
from .cache import (
    SearchCache,
    combine,
    default_cache_dir,
    fingerprint_batches,
)
from .candidates import enumerate_candidates
from .measure import Measurement, timed
from .objective import Objective, higher_is_better
from .pareto import pareto_front
from .result import Measured, SearchResult
from .selection import Bisection, Ranked
from .source import computed_in, is_path, open_source, plan_statistics
from .target import Target

#: Paired timing rounds of each candidate and the original when the target
#: is latency (their median ranks the candidates); one round otherwise.
LATENCY_ROUNDS = 3

__all__ = ["search"]

#: The largest share of blocks a search removes by default.
MAX_BLOCK_SHARE = 0.5

#: What decides between candidates whose task accuracies are within one
#: paired standard error of the best (:func:`_within_noise`): the held-out
#: metric of every causal LM, measured on every candidate.
TIE_BREAK = "perplexity"


@dataclass
class _Run:
    """What one call shares across its phases, found once."""

    model: nn.Module
    data: Iterable
    heldout: Iterable
    target: Target
    layout: Layout
    methods: list[Method]
    calibration: Calibration
    cache: SearchCache
    key: str
    latency: bool | int
    started: float
    max_seconds: float | None
    objective: Objective
    tokenizer: Any = None
    disk: DiskModel | None = None
    notes: list[str] = field(default_factory=list)
    #: seconds per phase (:attr:`SearchResult.timings`)
    timings: dict[str, float] = field(default_factory=dict)
    #: the shared moments pass's bound (:attr:`toast.frontier.source.Opened.statistics_bytes`)
    statistics_bytes: int | str = SHARED_BYTES
    #: the dtype the chosen model is returned in (:attr:`toast.frontier.source.Opened.written`)
    written: torch.dtype | None = None


def search(
    model: nn.Module | str | os.PathLike,
    data: Any,
    heldout: Any = None,
    *,
    target: Any = 0.2,
    max_measured: int = 12,
    max_minutes: float | None = None,
    max_blocks: int | None = None,
    latency: bool | int = True,
    cache: bool | str | os.PathLike = True,
    output: str | os.PathLike | None = None,
    backend: str = "auto",
    max_memory: int | str | None = None,
    sequential: bool | None = None,
    objective: str | None = None,
    task_options: dict[str, Any] | None = None,
    methods: Sequence[str] | None = None,
    **options: Any,
) -> SearchResult:
    """Finds the best compression of ``model`` for ``target``, measured.

    ``target``: a fraction of parameters to remove (``0.2``), or
    ``"params=20%"``, ``"macs=25%"`` (linear-layer MACs: what
    ``toast.macs(model, convention="linear")`` counts), ``"latency=30%"``
    (measured forward time), ``"quality=10%"`` (held-out quality at most
    10% worse than the original: the smallest model that keeps it). See
    :class:`toast.frontier.Target`.

    One calibration pass over ``data`` gives every span's predicted error
    and closed-form fit; a second, ReplaceMe's transforms for the best cuts
    of every size up to ``max_blocks`` (default half the blocks; the largest
    cut considered, not a number to remove like ``num_blocks``). Each
    method's stages propose its candidates (docs/search.md). For a size
    target the ``max_measured`` best-predicted ones that can meet it (each
    family in turn) are measured; for a quality floor, each family's
    smallest model within it, by bisection. Each is built from the
    calibration and measured on ``heldout``: quality (as
    :func:`toast.compress` reports it), parameters, MACs and, with
    ``latency``, throughput paired with the original's (an int: at that
    batch size). ``max_minutes`` stops when the next would not fit.

    ``cache`` (True: ``$TOAST_CACHE/search`` or ``~/.cache/toast/search``;
    a folder; False: none) keeps the calibration and the measurements, so
    a call with a new target makes no calibration pass. ``output``: the
    folder :meth:`SearchResult.save` writes (chosen model, report, plot).
    ``data`` and ``heldout``: batches or raw text with the text and
    calibration options of :func:`toast.compress` (a float ``heldout``
    holds out that share of raw text). The model is left unchanged.

    A checkpoint folder is loaded when it fits ``max_memory`` (``"16GiB"``;
    default the memory available), else searched block by block from disk,
    never loaded (``sequential`` forces a path; the choice is said once, as
    for :func:`toast.compress`): methods that need the model in memory
    (ToaSt, LinearPatch, sub-layers) are left out, nothing is timed
    (``latency=``, ``macs=`` targets refused) and :meth:`SearchResult.save`
    writes the chosen model from the checkpoint. ``objective``: what the
    front, target and choice follow (``"kl"``, ``"task:replaceme"``...;
    :class:`toast.frontier.objective.Objective`). ``methods``: the methods
    searched (default every staged one)."""
    check("max_measured", max_measured, Interval(int, 1, None))
    check("backend", backend, Options(BACKENDS))
    aim = Objective.parse(objective, task_options)
    aim.check_tasks()  # a task whose data is missing fails before any work
    asked = _Asked(backend, max_memory, sequential, aim, _check_methods(methods))
    begin = time.perf_counter()
    run = _prepare(
        model, data, heldout, target, max_blocks, max_minutes, latency, cache, asked, options
    )
    run.timings["preparation"] = time.perf_counter() - begin  # loading a model file included
    run.started = begin
    with timed(run.timings, "calibration"):
        calibrated, passes = _calibrated(run, backend, max_blocks)
    sizes = model_sizes(run.model, run.layout)
    candidates = _candidates(run, calibrated, sizes, max_blocks)
    result = _measure_all(run, calibrated, sizes, candidates, max_measured, passes)
    _hand_back(run, result, calibrated.notes)
    if output is not None:
        result.save(output)
    return result


def _hand_back(run: _Run, result: SearchResult, notes: list[str]) -> None:
    """``result`` as the caller gets it: the chosen model in the dtype of the
    checkpoint it was widened from (:attr:`toast.frontier.source.Opened.written`), and the notes
    of the calibration and of the run."""
    if run.written is not None and result.model is not None:
        result.model.to(run.written)
    result.notes.extend(notes + run.notes)


def _candidates(
    run: _Run, calibrated: Calibrated, sizes: Sizes, max_blocks: int | None
) -> list[Plan]:
    macs_matter = run.target.kind in ("macs", "latency")
    limit = _limit(run.layout, run.target, max_blocks)
    return enumerate_candidates(run.methods, calibrated, sizes, limit, macs_matter=macs_matter)


@dataclass(frozen=True)
class _Asked:
    """What the caller asked of the search beside the calibration and text
    options: the backend, where the model may live (``max_memory``,
    ``sequential``), what the search follows and which methods it compares."""

    backend: str
    max_memory: int | str | None
    sequential: bool | None
    objective: Objective
    methods: tuple[str, ...] | None


def _prepare(
    model: nn.Module | str | os.PathLike,
    data: Any,
    heldout: Any,
    target: Any,
    max_blocks: int | None,
    max_minutes: float | None,
    latency: bool | int,
    cache: bool | str | os.PathLike,
    asked: _Asked,
    options: dict[str, Any],
) -> _Run:
    """The search's run: the source opened, the data prepared, the cache
    key; ``options`` are the calibration and text options alone."""
    goal = Target.parse(target)
    check("max_blocks", max_blocks, Interval(int, 1, None), None)
    check("max_minutes", max_minutes, Interval(float, 0, None, closed="neither"), None)
    check("latency", latency, bool, Interval(int, 1, None))
    check("cache", cache, bool, Predicate(is_path, "a folder"))
    backend, objective, wanted = asked.backend, asked.objective, asked.methods
    objective.check_target(goal.kind)
    check("sequential", asked.sequential, bool, None)
    text, rest = split_text_options(options)
    calibration = Calibration.from_options(rest.pop("calibration", None), **rest)
    if data is None:
        raise ValueError("search needs calibration data (a loader of batches, or raw text)")
    data, heldout = _heldout(as_batches(data, **text), heldout, text)
    shape = ShapeOnce(lambda: data, lambda: heldout)
    opened = open_source(model, goal, asked.max_memory, asked.sequential, calibration, shape)
    if wanted is not None:
        opened.methods = [m for m in opened.methods if m.name in wanted]
    if opened.disk is not None and opened.plan is not None:
        opened.statistics_bytes = plan_statistics(
            opened.plan, opened.disk, opened.layout, opened.methods, shape(opened.disk.model.config)
        )
    tokenizer = text.get("tokenizer") or getattr(data, "tokenizer", None)
    kind = "loaded" if opened.disk is None else "disk"
    objective.check(opened.model, next(iter(heldout)), kind, tokenizer)
    notes: list[str] = []
    folder = _cache_folder(cache, calibration, notes)
    settings = (
        calibration.max_samples,
        calibration.max_batches,
        calibration.sample,
        calibration.seed,
        opened.layout.stack.path,
        _limit(opened.layout, goal, max_blocks),  # what the calibration covers
        backend,
        tuple(m.name for m in opened.methods),
        computed_in(opened, calibration),
    )
    key = combine(opened.fingerprint, fingerprint_batches(data), settings)
    if opened.disk is not None:
        latency = False
        notes.append(
            "latency not measured: the block-by-block path never loads the model "
            "(give max_memory enough to load it to time candidates)"
        )
    return _Run(
        opened.model,
        data,
        heldout,
        goal,
        opened.layout,
        opened.methods,
        calibration,
        SearchCache(folder),
        key,
        latency,
        time.perf_counter(),
        None if max_minutes is None else 60.0 * max_minutes,
        objective,
        tokenizer,
        opened.disk,
        notes,
        statistics_bytes=opened.statistics_bytes,
        written=opened.written,
    )


def _cache_folder(
    cache: bool | str | os.PathLike, calibration: Calibration, notes: list[str]
) -> str | os.PathLike | None:
    """The cache's folder (None: no cache). None under torch.distributed:
    ranks reading and writing one cache could see different entries (one
    skipping a pass the other runs, and the collectives hang)."""
    folder = default_cache_dir() if cache is True else None if cache is False else cache
    if folder is not None and ranks_of(calibration) is not None:
        notes.append("cache not used under torch.distributed: every rank calibrates")
        return None
    return folder


def _check_methods(methods: Sequence[str] | None) -> tuple[str, ...] | None:
    """``methods`` as a tuple of registered staged methods' names (None: all)."""
    if methods is None:
        return None
    names = [m.name for m in staged_methods()]
    if isinstance(methods, str) or not all(isinstance(m, str) for m in methods):
        raise TypeError(f"methods must be a list of method names from {names}; got {methods!r}")
    unknown = sorted(set(methods) - set(names))
    if unknown or not methods:
        raise ValueError(f"methods must name some of {names}; got {list(methods)!r}")
    return tuple(methods)


def _heldout(data: Iterable, heldout: Any, text: dict[str, Any]) -> tuple[Any, Any]:
    if heldout is None:
        raise ValueError(
            "search measures candidates on held-out data: pass heldout=<batches or raw text> "
            "(or heldout=0.1 to hold out a tenth of raw text data)"
        )
    return heldout_batches(data, heldout, text)


def _limit(layout: Layout, goal: Target, max_blocks: int | None) -> int:
    """The most blocks a plan removes: ``max_blocks``, by default half the
    blocks, or a blocks= target's count when that is more."""
    total = layout.num_blocks
    chosen = max_blocks if max_blocks is not None else max(1, int(total * MAX_BLOCK_SHARE))
    asked = goal.num_blocks
    if asked is not None and asked >= total:
        raise ValueError(f"target blocks={asked} leaves no block of {total}; remove fewer")
    return min(max(chosen, asked or 0), total - 1)


def _calibrated(run: _Run, backend: str, max_blocks: int | None) -> tuple[Calibrated, int]:
    """The calibration from the cache, else from its passes (then cached)."""
    found = run.cache.load_calibrated(run.key)
    if found is not None:
        return found, 0
    limit = _limit(run.layout, run.target, max_blocks)
    if run.disk is not None:
        calibrated = calibrate_from_disk(
            run.disk,
            run.data,
            run.layout,
            run.methods,
            run.calibration,
            backend,
            limit,
            run.statistics_bytes,
        )
    else:
        calibrated = calibrate(
            run.model, run.data, run.layout, run.methods, run.calibration, backend, limit
        )
    said = run.cache.save_calibrated(run.key, calibrated)
    if said and run.calibration.progress:
        print(f"toast search: {said}", file=sys.stderr)
    return calibrated, calibrated.passes


def _eligible(run: _Run, sizes: Sizes, candidate: Plan) -> bool:
    """Whether ``candidate`` can meet a size target, before measuring:
    parameters directly; MACs and latency by the share of the blocks'
    parameters removed plus the share of MACs it saves unseen by the
    parameters (Token Channel Selection; checked again on the measured
    model)."""
    goal = run.target
    if goal.kind == "quality":
        return True
    if goal.kind == "blocks":
        return candidate.blocks_removed == goal.num_blocks
    if goal.kind == "params":
        return candidate.params_after <= (1.0 - goal.value) * sizes.params
    share = (sizes.params - candidate.params_after) / sum(sizes.block_params)
    return share + candidate.unseen_share >= goal.value


def _meets(original: Measurement, m: Measurement, run: _Run, higher: bool) -> bool:
    """Whether a measured model meets the target (a blocks= target: every
    candidate measured, each eligible by its plan)."""
    goal = run.target
    if goal.kind == "blocks":
        return True
    if goal.kind == "params":
        return m.params <= (1.0 - goal.value) * original.params
    if goal.kind == "macs":  # refused before any work where MACs are not counted
        assert m.macs is not None and original.macs is not None
        return m.macs <= (1.0 - goal.value) * original.macs
    if goal.kind == "latency":
        speedup = m.speedup(original)
        return speedup is not None and 1.0 / speedup <= 1.0 - goal.value
    if higher:
        return m.quality >= (1.0 - goal.value) * original.quality
    return m.quality <= (1.0 + goal.value) * original.quality


def _measure_all(
    run: _Run,
    calibrated: Calibrated,
    sizes: Sizes,
    candidates: list[Plan],
    max_measured: int,
    passes: int,
) -> SearchResult:
    """Measures the selection (what the cache lacks), then the front and
    the chosen model."""
    eligible = [c for c in candidates if _eligible(run, sizes, c)]
    selector = (Bisection if run.target.kind == "quality" else Ranked)(eligible, max_measured)
    measurer = _Measurer(run, calibrated, sizes)
    notes = measurer.measure(selector, max_measured)
    found = {c.key: measurer.stored(c.key) for c in eligible}
    measured = [
        Measured(c, m, c.key not in measurer.fresh)
        for c in eligible
        if (m := found[c.key]) is not None
    ]
    measured.sort(key=lambda m: (m.measurement.params, m.candidate.key))
    run.timings.update(measurer.bench.timings)
    result = _result(run, measurer.original, measured, len(eligible), passes, notes)
    if result.chosen is not None:
        chosen = measured[result.chosen].candidate
        with timed(result.timings, "chosen: build"):
            result.model, result.writer = measurer.bench.chosen(chosen)
    result.timings["total"] = time.perf_counter() - run.started
    if not eligible:
        result.notes.append(
            f"no candidate can meet {run.target.describe()} removing at most half the blocks: "
            "raise max_blocks= or ask for less"
        )
    return result


class _Measurer:
    """Measures candidates on the held-out data, keeping every measurement
    in the cache as it comes (an interrupted search keeps what it
    measured). ``fresh``: the keys this call measured. The cache keeps
    what was measured; the objective picks its quality on reading, and an
    entry without the objective's value is measured again."""

    def __init__(self, run: _Run, calibrated: Calibrated, sizes: Sizes) -> None:
        self.run = run
        # task accuracies depend on the harness's settings: their own entries
        tasks = run.objective.key() if run.objective.is_task else None
        self.key = combine(run.key, fingerprint_batches(run.heldout), run.latency, tasks)
        self.store = run.cache.load_measurements(self.key)
        self.fresh: set[str] = set()
        found = self.store.get("original")
        metric = None if found is None else found["metric"]
        extra = run.objective.extra(run.tokenizer)
        self.bench: Bench
        if run.disk is not None:
            self.bench = DiskBench(
                run.disk, sizes, calibrated, run.heldout, metric, run.calibration.progress
            )
        else:
            # a latency target ranks by the timings: paired rounds for their
            # median; otherwise throughput is reported, one paired round each
            rounds = LATENCY_ROUNDS if run.target.kind == "latency" else 1
            self.bench = MemoryBench(
                run.model,
                run.layout,
                calibrated,
                run.heldout,
                metric,
                run.latency,
                extra,
                rounds,
                run.calibration.compute_dtype,
            )
        self.original = self._original()

    def stored(self, key: str) -> Measurement | None:
        """The cache's measurement of ``key`` seen through the objective
        (None when it lacks the objective's value)."""
        found = self.store.get(key)
        if found is None or (self.run.objective.is_task and "documents" not in found):
            return None  # a task entry cached before per-document scores were kept: again
        return self.run.objective.project(Measurement.from_dict(found))

    def _original(self) -> Measurement:
        found = self.stored("original")
        if found is not None:
            return found
        raw = self.bench.original()
        self.store["original"] = raw.to_dict()
        self.run.cache.save_measurements(self.key, self.store)
        measured = self.stored("original")
        if measured is None:
            raise self.run.objective.missing(raw)
        return measured

    def _new(self, candidate: Plan) -> None:
        m = self.bench.candidate(candidate)
        # the built candidate is gone with its frame, but modules hold cycles (hooks,
        # parents): collected now, so that no two candidates are ever held at once
        gc.collect()
        self.fresh.add(candidate.key)
        self.store[candidate.key] = m.to_dict()
        self.run.cache.save_measurements(self.key, self.store)

    def measure(self, selector: Ranked | Bisection, limit: int) -> list[str]:
        """Measures what ``selector`` asks for (at most ``limit``); returns notes."""
        higher = higher_is_better(self.original.metric)
        progress = self.run.calibration.progress
        bar = progress_bar("search: measuring", limit, "candidate", disable=not progress)
        spent: list[float] = []
        frozen = _freeze_held()
        try:
            while (candidate := selector.next()) is not None:
                if self.stored(candidate.key) is None:
                    if _out_of_time(self.run, spent):
                        return [f"max_minutes reached after {len(spent)} new measurements"]
                    begin = time.perf_counter()
                    self._new(candidate)
                    spent.append(time.perf_counter() - begin)
                bar.update(1)
                m = self.stored(candidate.key)
                assert m is not None  # measured just now, or found
                selector.tell(candidate, _meets(self.original, m, self.run, higher))
        finally:
            if frozen:
                gc.unfreeze()
            bar.close()
        return []


def _freeze_held() -> bool:
    """Moves what the search holds (model, calibration, every object alive
    now) out of the collector's reach for the measurements, so that the
    collection after each candidate scans only what came since: on SmolLM2
    each scanned everything, 0.7 s a candidate. Not where the caller froze
    objects already (unfreezing would thaw theirs too); returns whether it froze."""
    if gc.get_freeze_count():
        return False
    gc.collect()
    gc.freeze()
    return True


def _out_of_time(run: _Run, spent: list[float]) -> bool:
    if run.max_seconds is None or not spent:
        return False
    elapsed = time.perf_counter() - run.started
    late = elapsed + sum(spent) / len(spent) > run.max_seconds
    ranks = ranks_of(run.calibration)
    # each process has its own clock: rank 0's decides for all, so all stop together
    return late if ranks is None else bool(broadcast_object(late, ranks))


def _result(
    run: _Run,
    original: Measurement,
    measured: list[Measured],
    enumerated: int,
    passes: int,
    notes: list[str],
) -> SearchResult:
    axis = {"params": "params", "macs": "macs", "latency": "latency"}.get(run.target.kind, "params")
    result = SearchResult(
        target=run.target,
        original=original,
        measured=measured,
        front=[],
        chosen=None,
        size_axis=axis,
        enumerated=enumerated,
        calibration_passes=passes,
        notes=notes,
        timings=run.timings,
    )
    higher = result.higher_is_better
    points = [(result.size(m.measurement), m.measurement.quality) for m in measured]
    result.front = pareto_front(points, higher)
    meeting = [k for k, m in enumerate(measured) if _meets(original, m.measurement, run, higher)]
    if meeting:
        sign = 1.0 if higher else -1.0
        if run.target.kind == "quality":
            result.chosen = min(meeting, key=lambda k: (points[k][0], -sign * points[k][1]))
        else:
            # equal quality: the larger model, the one nearest the target (a tie
            # on a few held-out batches is weak evidence for more compression)
            result.chosen = max(meeting, key=lambda k: (sign * points[k][1], points[k][0]))
            if run.objective.is_task:
                result.chosen = _within_noise(measured, meeting, result.chosen, result.notes)
    return result


def _within_noise(measured: list[Measured], meeting: list[int], best: int, notes: list[str]) -> int:
    """The candidate a task objective chooses: of those meeting the target
    whose accuracy is within one paired standard error of the best's (the
    same documents scored), the one of best held-out perplexity. An
    accuracy on a few documents a task cannot tell apart models a few
    points apart; choosing its noise chose, on SmolLM2 at 4 blocks with 10
    documents a task, a plan that then scored 3.2 points lower on the next
    75 (``benchmarks/results/accuracy_75docs.md``). With many documents
    the error is small and the accuracy decides."""
    top = measured[best].measurement
    errors = {k: paired_stderr(top.documents, measured[k].measurement.documents) for k in meeting}
    tied = [best] + [
        k
        for k, se in errors.items()
        if k != best and se is not None and top.quality - measured[k].measurement.quality <= se
    ]
    scored = [k for k in tied if TIE_BREAK in measured[k].measurement.metrics]
    if len(scored) < 2 or best not in scored:
        return best
    chosen = min(scored, key=lambda k: (measured[k].measurement.metrics[TIE_BREAK], k != best))
    if chosen != best:
        m, se = measured[chosen].measurement, errors[chosen]
        notes.append(
            f"chosen: {measured[chosen].candidate.label}, task accuracy {m.quality:.3f} within "
            f"one paired standard error ({se:.3f}) of the best, "
            f"{measured[best].candidate.label}'s {top.quality:.3f}, and of lower held-out "
            f"{TIE_BREAK} ({m.metrics[TIE_BREAK]:.4g} against {top.metrics[TIE_BREAK]:.4g}); "
            "more documents (task_options limit) narrow the error"
        )
    return chosen
