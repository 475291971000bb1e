"""Where a search measures its candidates: a model in memory
(:class:`MemoryBench`: each plan built on a copy, held-out quality,
parameters, linear-layer MACs and throughput) or a checkpoint on disk
(:class:`DiskBench`: each plan made as the blocks load, held-out quality
measured block by block, the exact parameter count of the plan; no MACs
or throughput, which need the model loaded). Both give
:class:`~toast.frontier.measure.Measurement` s, so the search above them
is one.

A candidate in memory changes the original only from some block on (the
first block of its spans, the block before a ReplaceMe cut, the first
block whose sub-layers it removes): the held-out states entering the
blocks before it are the original's. :class:`MemoryBench` records them on
the original's held-out pass (:class:`toast.hf.evaluate.resume.PrefixStates`,
within ``prefix_bytes``) and each candidate's pass resumes there; throughput,
MACs and an objective's extra measures run the whole model."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from torch import nn

from toast.hf.capture.sequential import BlockEdits, DiskModel
from toast.hf.evaluate.from_disk import SequentialEvaluator
from toast.hf.evaluate.quality import Evaluator
from toast.hf.evaluate.resume import PREFIX_BYTES, PrefixMismatch, PrefixStates, unchanged_blocks
from toast.methods.base import Layout, Plan, Sizes, get_method
from toast.methods.calibrate import Calibrated

from .build import build, finish
from .measure import Measurement, linear_macs, measure, timed

__all__ = ["Bench", "DiskBench", "MemoryBench"]

#: Writes the chosen model to a new folder without loading the checkpoint.
Writer = Callable[[str | os.PathLike], Path]

#: Measures more of a built model than the held-out pass does (an
#: objective's task accuracies): metrics by name, and each task's
#: per-document scores (:attr:`Measurement.documents`).
Extra = Callable[[nn.Module], tuple[dict[str, float], dict[str, list[float]]]]


#: The fields of :class:`Plan` whose changes :func:`first_changed_block` knows
#: (a method's own setting is a part of ``parts``: each says its first block).
_PLAN_FIELDS = frozenset(
    {
        "methods",
        "family",
        "spans",
        "translator",
        "params_after",
        "predicted_error",
        "unseen_macs",
        "unseen_share",
        "extendable",
        "parts",
    }
)


def first_changed_block(plan: Plan, num_blocks: int) -> int:
    """The first of the original's blocks (its numbering) that ``plan``
    changes or removes: those before it run as the original's, on the same
    inputs. 0 for plans that change every block (head pruning, Token
    Channel Selection, token merging: their parts say so) and for a plan
    setting a field this does not know (a new one of :class:`Plan`'s)."""
    defaults = {f.name: f.default for f in dataclasses.fields(Plan)}
    if any(getattr(plan, k) != v for k, v in defaults.items() if k not in _PLAN_FIELDS):
        return 0
    # ReplaceMe folds each cut's transform into the block before it
    before = 1 if "replaceme" in plan.methods else 0
    starts = [start - before for start, _ in plan.spans]
    starts += [b for b in (part.first_block() for part in plan.parts) if b is not None]
    return max(0, min(starts, default=num_blocks))


class MemoryBench:
    """Candidates built on copies of ``model`` and measured, each held-out
    pass resumed past the blocks it shares with the original where their
    states were recorded (``prefix_bytes``: the bound on those states,
    :data:`~toast.hf.evaluate.resume.PREFIX_BYTES` by default; 0: every
    candidate runs whole)."""

    def __init__(
        self,
        model: nn.Module,
        layout: Layout,
        calibrated: Calibrated,
        heldout: Iterable,
        metric: str | None,
        latency: bool | int,
        extra: Extra | None = None,
        rounds: int = 3,
        compute: str = "auto",
        prefix_bytes: int = PREFIX_BYTES,
    ) -> None:
        self.model, self.layout, self.calibrated = model, layout, calibrated
        self.latency, self.extra, self.rounds = latency, extra, rounds
        self.example = next(iter(heldout))
        self.evaluator = Evaluator(heldout, metric, progress=False, compute=compute)  # type: ignore[arg-type]
        #: seconds per phase, by ``"<label>: <phase>"`` (build, held-out, MACs, latency)
        self.timings: dict[str, float] = {}
        # whether the evaluator holds the original's outputs, which the
        # fidelity metrics (KL, agreement, cosine) compare every model with
        self.reference = False
        #: the original's held-out block inputs (None: candidates run whole)
        self.prefix = PrefixStates(layout.stack, prefix_bytes) if prefix_bytes else None
        #: per measured candidate, the block its held-out pass resumed at (0: whole)
        self.resumed: dict[str, int] = {}

    def _heldout_original(self, model: nn.Module, label: str) -> float:
        """The original's held-out pass, its block inputs recorded."""
        if self.prefix is None:
            return self.evaluator.measure(model, label)
        with self.prefix.recording(model, self.evaluator.compute):
            return self.evaluator.measure(model, label)

    def _resume_point(self, plan: Plan, model: nn.Module) -> int:
        """The recorded block ``model``'s pass resumes at (0: none)."""
        if self.prefix is None:
            return 0
        stack = self.layout.stack
        start = first_changed_block(plan, stack.num_blocks)
        # the plan says where it changes the model; the blocks must agree
        start = unchanged_blocks(stack, model, start)
        return self.prefix.resume_point(start, self.evaluator.compute)

    def _heldout_candidate(self, plan: Plan) -> Callable[[nn.Module, str], float]:
        def heldout(model: nn.Module, label: str) -> float:
            prefix, at = self.prefix, self._resume_point(plan, model)
            self.resumed[plan.key] = at
            if prefix is None or at == 0:
                return self.evaluator.measure(model, label)
            try:
                with prefix.resumed(model, at):
                    return self.evaluator.measure(model, label)
            except PrefixMismatch:
                # raised before the pass's scores were formed: measured whole instead
                self.resumed[plan.key] = 0
                return self.evaluator.measure(model, label)

        return heldout

    def _more(self, model: nn.Module, m: Measurement) -> Measurement:
        if self.extra is None:
            return m
        start = time.perf_counter()
        more, documents = self.extra(model)
        seconds = m.seconds + time.perf_counter() - start
        metrics = {**m.metrics, **more}
        return dataclasses.replace(m, metrics=metrics, documents=documents, seconds=seconds)

    def original(self) -> Measurement:
        self.reference = True
        m = measure(
            self.model,
            self.evaluator,
            self.example,
            "original",
            self.latency,
            phases=self.timings,
            rounds=self.rounds,
            heldout=self._heldout_original,
        )
        return self._more(self.model, m)

    def candidate(self, plan: Plan) -> Measurement:
        if not self.reference:  # the original was measured by an earlier call
            with timed(self.timings, "original: held-out"):
                self._heldout_original(self.model, "original")
            self.reference = True
        with timed(self.timings, f"{plan.label}: build"):
            built = build(self.model, self.layout, plan, self.calibrated)
        with timed(self.timings, f"{plan.label}: MACs"):
            # counted before the run-time changes, which the linear layers' hooks cannot see
            macs = linear_macs(built.model, self.example) - plan.unseen_macs
        model = finish(built, plan, self.calibrated)
        m = measure(
            model,
            self.evaluator,
            self.example,
            plan.label,
            self.latency,
            reference=self.model,
            macs=macs,
            phases=self.timings,
            rounds=self.rounds,
            heldout=self._heldout_candidate(plan),
        )
        return self._more(model, m)

    def chosen(self, plan: Plan) -> tuple[nn.Module | None, Writer | None]:
        """The chosen model, built."""
        built = build(self.model, self.layout, plan, self.calibrated)
        return finish(built, plan, self.calibrated), None


class DiskBench:
    """Candidates made as the checkpoint's blocks load (each method's
    ``edits``), measured block by block; sizes are the plans' exact counts
    from the skeleton (:class:`Sizes`)."""

    def __init__(
        self,
        disk: DiskModel,
        sizes: Sizes,
        calibrated: Calibrated,
        heldout: Iterable,
        metric: str | None,
        progress: bool = False,
    ) -> None:
        self.disk, self.sizes, self.calibrated = disk, sizes, calibrated
        # a sweep of every block from disk takes minutes on a wide model: counted with progress
        self.evaluator = SequentialEvaluator(disk, heldout, metric, progress=progress)  # type: ignore[arg-type]
        self.reference = False
        #: seconds per phase, by ``"<label>: <phase>"`` (held-out passes only)
        self.timings: dict[str, float] = {}

    def _measured(self, edits: BlockEdits, label: str, params: int) -> Measurement:
        start = time.perf_counter()
        with timed(self.timings, f"{label}: held-out"):
            quality = self.evaluator.measure_edited(edits, label)
        assert self.evaluator.metric is not None  # set by the measurement
        seconds = time.perf_counter() - start
        # MACs are not counted on the disk path (a macs= target is refused there)
        metrics = dict(self.evaluator.last)
        return Measurement(
            float(quality), self.evaluator.metric, params, None, None, seconds, metrics
        )

    def original(self) -> Measurement:
        self.reference = True
        return self._measured(BlockEdits(), "original", self.sizes.params)

    def _stages(self, plan: Plan) -> Any:
        if len(plan.methods) != 1:
            raise ValueError(f"{plan.label} combines methods, which the disk path does not")
        stages = get_method(plan.methods[0]).stages
        assert stages is not None  # plans come from staged methods
        return stages

    def candidate(self, plan: Plan) -> Measurement:
        if not self.reference:  # the original was measured by an earlier call
            with timed(self.timings, "original: held-out"):
                self.evaluator.measure_edited(BlockEdits(), "original")
            self.reference = True
        stats = self.calibrated.stats[plan.methods[0]]
        edits = self._stages(plan).edits(self.disk, plan, stats)
        return self._measured(edits, plan.label, plan.params_after)

    def chosen(self, plan: Plan) -> tuple[nn.Module | None, Writer | None]:
        """No model (it is never loaded): the writer of its checkpoint."""
        stats = self.calibrated.stats[plan.methods[0]]
        return None, functools.partial(self._stages(plan).save_from_disk, self.disk, plan, stats)


Bench = MemoryBench | DiskBench
