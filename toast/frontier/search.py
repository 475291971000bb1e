"""``toast.search``: the best compression of a model for a target, by
measurement.

Data flows one way: the calibration passes (or the cache) give moments
and ReplaceMe transforms; every applicable candidate is enumerated with
its exact size and predicted error; the best-predicted candidates of each
family are built from those calibrated pieces (no further calibration)
and measured on held-out data; the measured candidates give the Pareto
front and the chosen model.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

from toast._validation import Interval, Options, Predicate, check
from toast.hf.calibration import BACKENDS, Calibration
from toast.hf.progress import progress_bar
from toast.hf.quality import Evaluator
from toast.hf.text import as_batches
from toast.methods import available_methods
from toast.methods.base import Layout, Method, Plan, Sizes, find_layout, staged_methods
from toast.methods.runner import split_heldout, split_text_options

from .build import build, finish
from .cache import SearchCache, combine, default_cache_dir, fingerprint, fingerprint_batches
from .calibrate import Calibrated, calibrate, model_sizes
from .candidates import enumerate_candidates
from .measure import Measurement, linear_macs, measure
from .pareto import pareto_front
from .result import HIGHER as _HIGHER
from .result import Measured, SearchResult
from .selection import Bisection, Ranked
from .target import Target

__all__ = ["search"]

#: The largest share of blocks a search removes by default.
MAX_BLOCK_SHARE = 0.5


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
    latency: bool
    started: float
    max_seconds: float | None


def search(
    model: nn.Module,
    data: Any,
    heldout: Any = None,
    *,
    target: Any = 0.2,
    max_measured: int = 12,
    max_minutes: float | None = None,
    max_blocks: int | None = None,
    latency: bool = True,
    cache: bool | str | os.PathLike = True,
    output: str | os.PathLike | None = None,
    backend: str = "auto",
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
    and every closed-form fit; a second estimates ReplaceMe's transforms
    for the best cuts of every size up to ``max_blocks`` (default half the
    blocks). Candidates: plain removal, TOAST linear and affine translators
    over planned spans, ReplaceMe cuts, and for ViTs ToaSt head pruning
    alone and with block removal (and, for MAC and latency targets, Token
    Channel Selection). For a size target the ``max_measured``
    best-predicted candidates that can meet it (taken from each family in
    turn) are measured; for a quality floor each family's smallest model
    within it is found by bisection over its sizes. Candidates are built
    from the calibration and measured on ``heldout``: quality
    (perplexity, accuracy or output cosine, as :func:`toast.compress`
    reports), parameters, MACs and, with ``latency``, throughput on the
    model's device. ``max_minutes`` stops measuring when the next
    candidate would not fit in it.

    ``cache`` (True: ``$TOAST_CACHE/search`` or ``~/.cache/toast/search``;
    a folder; False: none) keeps the calibration and the measurements, so
    a call with a new target makes no calibration pass. ``output``: the
    folder :meth:`SearchResult.save` writes (chosen model, report, plot).
    ``data`` and ``heldout`` are batches or raw text read with the text
    options (``tokenizer``, ``max_length``...), and the calibration options
    (``max_samples``, ``progress``...) bound the pass, as for
    :func:`toast.compress`; a float ``heldout`` holds out that share of raw
    text. The model is left unchanged.
    """
    check("max_measured", max_measured, Interval(int, 1, None))
    check("backend", backend, Options(BACKENDS))
    options["backend"] = backend
    run = _prepare(model, data, heldout, target, max_blocks, max_minutes, latency, cache, options)
    calibrated, passes = _calibrated(run, backend, max_blocks)
    sizes = model_sizes(run.model, run.layout)
    candidates = enumerate_candidates(
        run.methods,
        calibrated,
        sizes,
        _max_blocks(run, max_blocks),
        macs_matter=run.target.kind in ("macs", "latency"),
    )
    result = _measure_all(run, calibrated, sizes, candidates, max_measured, passes)
    result.notes.extend(calibrated.notes)
    if output is not None:
        result.save(output)
    return result


def _prepare(
    model: nn.Module,
    data: Any,
    heldout: Any,
    target: Any,
    max_blocks: int | None,
    max_minutes: float | None,
    latency: bool,
    cache: bool | str | os.PathLike,
    options: dict[str, Any],
) -> _Run:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    goal = Target.parse(target)
    check("max_blocks", max_blocks, Interval(int, 1, None), None)
    check("max_minutes", max_minutes, Interval(float, 0, None, closed="neither"), None)
    check("latency", latency, bool)
    check("cache", cache, bool, Predicate(_is_path, "a folder"))
    backend = options.pop("backend")
    text, rest = split_text_options(options)
    calibration = Calibration.from_options(rest.pop("calibration", None), **rest)
    if data is None:
        raise ValueError("search needs calibration data (a loader of batches, or raw text)")
    data = as_batches(data, **text)
    heldout = _heldout(data, heldout, text)
    if isinstance(heldout, tuple):
        data, heldout = heldout
    folder = default_cache_dir() if cache is True else None if cache is False else cache
    available_methods()  # every method registered, so every method's structure is found
    methods = staged_methods()
    layout = find_layout(model, calibration.blocks)  # the call's one discovery
    settings = (
        calibration.max_samples,
        calibration.max_batches,
        calibration.sample,
        calibration.seed,
        layout.stack.path,
        max_blocks,
        backend,
        tuple(m.name for m in methods),
    )
    key = combine(fingerprint(model), fingerprint_batches(data), settings)
    return _Run(
        model,
        data,
        heldout,
        goal,
        layout,
        methods,
        calibration,
        SearchCache(folder),
        key,
        latency,
        time.perf_counter(),
        None if max_minutes is None else 60.0 * max_minutes,
    )


def _is_path(value: Any) -> bool:
    return isinstance(value, (str, os.PathLike))


def _heldout(data: Iterable, heldout: Any, text: dict[str, Any]) -> Any:
    if heldout is None:
        raise ValueError(
            "search measures candidates on held-out data: pass heldout=<batches or raw text> "
            "(or heldout=0.1 to hold out a tenth of raw text data)"
        )
    if isinstance(heldout, float):
        return split_heldout(data, heldout)
    return as_batches(heldout, **text)


def _max_blocks(run: _Run, max_blocks: int | None) -> int:
    total = run.layout.num_blocks
    chosen = max_blocks if max_blocks is not None else max(1, int(total * MAX_BLOCK_SHARE))
    return min(chosen, total - 1)


def _calibrated(run: _Run, backend: str, max_blocks: int | None) -> tuple[Calibrated, int]:
    """The calibration from the cache, else from its passes (then cached)."""
    found = run.cache.load_calibrated(run.key)
    if found is not None:
        return found, 0
    calibrated = calibrate(
        run.model,
        run.data,
        run.layout,
        run.methods,
        run.calibration,
        backend,
        _max_blocks(run, max_blocks),
    )
    run.cache.save_calibrated(run.key, calibrated)
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
    if goal.kind == "params":
        return candidate.params_after <= (1.0 - goal.value) * sizes.params
    share = (sizes.params - candidate.params_after) / sum(sizes.block_params)
    return share + candidate.unseen_share >= goal.value


def _meets(original: Measurement, m: Measurement, run: _Run, higher: bool) -> bool:
    """Whether a measured model meets the target."""
    goal = run.target
    if goal.kind == "params":
        return m.params <= (1.0 - goal.value) * original.params
    if goal.kind == "macs":
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
    measurer = _Measurer(run, calibrated)
    notes = measurer.measure(selector, max_measured)
    keys = set(measurer.store)
    measured = [
        Measured(c, Measurement.from_dict(measurer.store[c.key]), c.key in measurer.before)
        for c in eligible
        if c.key in keys
    ]
    measured.sort(key=lambda m: (m.measurement.params, m.candidate.key))
    result = _result(run, measurer.original, measured, len(eligible), passes, notes)
    if result.chosen is not None:
        chosen = measured[result.chosen].candidate
        result.model = finish(build(run.model, run.layout, chosen, calibrated), chosen, calibrated)
    if not eligible:
        result.notes.append(
            f"no candidate can meet {run.target.describe()} removing at most half the blocks: "
            "raise max_blocks= or ask for less"
        )
    return result


class _Measurer:
    """Measures candidates on the held-out data, keeping every measurement
    in the cache as it comes (an interrupted search keeps what it
    measured). ``before``: the keys the cache held at the start."""

    def __init__(self, run: _Run, calibrated: Calibrated) -> None:
        self.run, self.calibrated = run, calibrated
        self.key = combine(run.key, fingerprint_batches(run.heldout), run.latency)
        self.store = run.cache.load_measurements(self.key)
        self.before = set(self.store)
        self.example = next(iter(run.heldout))
        found = self.store.get("original")
        self.evaluator = Evaluator(
            run.heldout, None if found is None else found["metric"], progress=False
        )
        self.reference = False  # whether a cosine evaluator holds the original's outputs
        self.original = self._original(found)

    def _original(self, found: dict[str, Any] | None) -> Measurement:
        if found is not None:
            return Measurement.from_dict(found)
        measured = measure(
            self.run.model, self.evaluator, self.example, "original", self.run.latency
        )
        self.store["original"] = measured.to_dict()
        self.run.cache.save_measurements(self.key, self.store)
        self.reference = True
        return measured

    def _new(self, candidate: Plan) -> None:
        if self.evaluator.metric == "cosine" and not self.reference:
            self.evaluator.measure(self.run.model, "original")  # the reference outputs
            self.reference = True
        built = build(self.run.model, self.run.layout, candidate, self.calibrated)
        # counted before the run-time changes, which the linear layers' hooks cannot see
        macs = linear_macs(built.model, self.example) - candidate.unseen_macs
        model = finish(built, candidate, self.calibrated)
        m = measure(
            model,
            self.evaluator,
            self.example,
            candidate.label,
            self.run.latency,
            reference=self.run.model,
            macs=macs,
        )
        self.store[candidate.key] = m.to_dict()
        self.run.cache.save_measurements(self.key, self.store)

    def measure(self, selector: Ranked | Bisection, limit: int) -> list[str]:
        """Measures what ``selector`` asks for (at most ``limit``); returns notes."""
        higher = _HIGHER[self.original.metric]
        progress = self.run.calibration.progress
        bar = progress_bar("search: measuring", limit, "candidate", disable=not progress)
        spent: list[float] = []
        try:
            while (candidate := selector.next()) is not None:
                if candidate.key not in self.store:
                    if _out_of_time(self.run, spent):
                        return [f"max_minutes reached after {len(spent)} new measurements"]
                    begin = time.perf_counter()
                    self._new(candidate)
                    spent.append(time.perf_counter() - begin)
                bar.update(1)
                m = Measurement.from_dict(self.store[candidate.key])
                selector.tell(candidate, _meets(self.original, m, self.run, higher))
        finally:
            bar.close()
        return []


def _out_of_time(run: _Run, spent: list[float]) -> bool:
    if run.max_seconds is None or not spent:
        return False
    elapsed = time.perf_counter() - run.started
    return elapsed + sum(spent) / len(spent) > run.max_seconds


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
    result.timings["total"] = time.perf_counter() - run.started
    return result
