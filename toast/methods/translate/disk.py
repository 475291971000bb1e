"""TOAST's translators on a checkpoint that stays on disk: as edits of its
blocks while they load (:func:`translated_edits`), checked against plain
removal block by block (:func:`check_from_disk`), and the parameters the
written model has (:func:`params_on_disk`)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from toast.core import Translator
from toast.hf.capture.sequential import BlockEdits, DiskModel
from toast.hf.evaluate.check import RemovalCheck, check_against_plain
from toast.hf.evaluate.from_disk import SequentialEvaluator, replaced
from toast.spans import Span
from toast.translators.block import translator_module

__all__ = ["check_from_disk", "params_on_disk", "translated_edits"]


def translated_edits(
    disk: DiskModel, spans: Sequence[Span], fits: Sequence[Translator | None]
) -> BlockEdits:
    """Each span replaced by its translator (None: plain removal) as the
    checkpoint's blocks load, in the weights' dtype as the patched model
    has it."""
    modules = [None if t is None else translator_module(t, dtype=disk.dtype) for t in fits]
    return replaced(spans, modules)


def check_from_disk(
    disk: DiskModel,
    spans: list[Span],
    translators: list[Translator],
    heldout: Iterable,
    fallback: bool,
    progress: bool,
    buffer_dir: str | os.PathLike | None,
    removed: dict[Any, Any] | None = None,
) -> list[RemovalCheck | None]:
    """Each translator against plain removal on the held-out batches
    (:func:`toast.hf.evaluate.check.check_against_plain`), block by block;
    ``removed`` keeps plain removal's figures across calls (a sweep each)."""
    # each sweep reads every block from disk (minutes on a large model): counted
    evaluator = SequentialEvaluator(
        disk, heldout, progress=progress, buffer_dir=buffer_dir, fidelity=False
    )

    def apply(where: Sequence[Span], fits: Sequence[Any]) -> AbstractContextManager:
        return evaluator.editing(translated_edits(disk, where, fits))

    return check_against_plain(
        disk.model, spans, translators, apply, heldout, fallback, evaluator=evaluator,
        removed=removed,
    )  # fmt: skip


def params_on_disk(
    disk: DiskModel, spans: Sequence[Span], translators: Sequence[Translator]
) -> tuple[int, int]:
    """Parameters of the checkpoint, and of the model written with each span
    replaced by its translator, as the patched model counts them (an
    identity has none, a zero bias is left out)."""
    before, cut = disk.params_without((s.start, s.stop) for s in spans)
    added = sum(p.numel() for t in translators for p in translator_module(t).parameters())
    return before, cut + added
