"""Massive activations: the few rows (an attention sink's first token) whose
hidden-state norm jumps ~100-fold at one block and stays there.

A least-squares fit across a span that creates them is asked to recreate
that jump from states that do not carry it; those rows' squared error
outweighs every other row's ~10⁴-fold and every token pays (measured on
SmolLM2: ``benchmarks/bench_fits.py``). The fits that handle them ask the
span's replacement to leave those rows as plain removal leaves them.

:func:`massive` flags the rows of one batch. :class:`MassiveRows` records,
during a capture pass, every row that is massive in some state (all of its
states, so that any pair of states can be corrected later; a sink is one
row per sequence, so this stays small), and :meth:`MassiveRows.plain_fit`
solves a closed-form translator as if those rows' targets were their
inputs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from toast.core import Moments, Translator
from toast.core.solvers import solve_gram

__all__ = ["MASSIVE_RATIO", "MassiveRows", "massive"]

#: A row is massive when its norm is more than this many times the batch's
#: median row norm.
MASSIVE_RATIO = 20.0


def massive(rows: torch.Tensor) -> torch.Tensor:
    """Which rows of ``rows`` (``(n, d)``) have a norm more than
    :data:`MASSIVE_RATIO` times the median."""
    norms = rows.norm(dim=1)
    return norms > MASSIVE_RATIO * norms.median()


class MassiveRows:
    """The rows of a capture pass that are massive in some state, with all
    their states: ``states[r, k]`` is row ``r`` in state ``k`` and
    ``flags[r, k]`` whether it is massive there (host arrays; the states
    float32 where the pass's are float32 or narrower, which holds them
    exactly in half float64's bytes, else float64; the fits read them in
    float64)."""

    def __init__(self, states: np.ndarray | None = None, flags: np.ndarray | None = None) -> None:
        self._states = np.zeros((0, 0, 0)) if states is None else states
        self._flags = np.zeros((0, 0), dtype=bool) if flags is None else flags
        # each batch's rows, joined once when read: joining them batch by batch
        # would copy every row recorded so far on each batch
        self._parts: list[tuple[np.ndarray, np.ndarray]] = []

    def _joined(self) -> None:
        if self._parts:
            held = [(self._states, self._flags)] if self._flags.size else []
            parts, self._parts = held + self._parts, []
            self._states = np.concatenate([p[0] for p in parts])
            self._flags = np.concatenate([p[1] for p in parts])

    @property
    def states(self) -> np.ndarray:
        self._joined()
        return self._states

    @property
    def flags(self) -> np.ndarray:
        self._joined()
        return self._flags

    def __repr__(self) -> str:
        return f"MassiveRows(rows={len(self.flags)}, states={self.flags.shape[1:]})"

    def __call__(self, rows: list[torch.Tensor], mask: torch.Tensor | None) -> None:
        """Adds one batch (``rows[k]``: state ``k``, ``(batch, tokens, d)``;
        ``mask``: the token rows that enter the statistics)."""
        d = int(rows[0].shape[-1])
        flat = [r.reshape(-1, d) for r in rows]
        if mask is not None and not bool(mask.all()):
            # the kept rows' numbers once: a boolean index would find them per state
            keep = mask.reshape(-1).bool().nonzero().squeeze(1)
            flat = [x.index_select(0, keep) for x in flat]
        if flat[0].shape[0] == 0:
            return
        flags = torch.stack([massive(x.float()) for x in flat], dim=1)
        any_state = flags.any(dim=1)
        if not bool(any_state.any()):
            return
        wide = torch.float64 if flat[0].dtype == torch.float64 else torch.float32
        picked = torch.stack([x[any_state] for x in flat], dim=1).to(wide).cpu().numpy()
        self._parts.append((picked, flags[any_state].cpu().numpy()))

    def reduce_over(self, ranks: Any) -> None:
        """Every rank's recorded rows, in rank order (collective; after a pass
        sharded over ``ranks``, :class:`toast.hf.capture.distributed.Ranks`):
        the rows are flagged batch by batch, so the union is what one
        process records."""
        from toast.hf.capture.distributed import all_gather_rows, all_reduce_sums

        # a rank that recorded nothing knows no shape: the others say it
        mine = [0.0, 0.0, 0.0] if self.flags.size == 0 else [1.0, *self.states.shape[1:]]
        has, states, dim = all_reduce_sums(mine, ranks)
        if has == 0:
            return
        num_states, dim = round(states / has), round(dim / has)
        states, flags = self.states, self.flags
        if flags.size == 0:
            states, flags = np.zeros((0, num_states, dim)), np.zeros((0, num_states), dtype=bool)
        # float64 on every rank: one that recorded nothing knows no dtype either
        self._states = all_gather_rows(states.astype(np.float64), ranks)
        self._flags = all_gather_rows(flags, ranks)

    def of(self, i: int, j: int) -> MassiveRows:
        """The rows of states ``i`` and ``j`` alone (as states 0 and 1), for
        moments of those two states."""
        if self.flags.size == 0:
            return self
        return MassiveRows(self.states[:, [i, j]], self.flags[:, [i, j]])

    def joined(self, other: MassiveRows) -> MassiveRows:
        """These rows and ``other``'s (of the same states), as one pass over
        both sets of batches would have recorded them."""
        if other.flags.size == 0:
            return self
        if self.flags.size == 0:
            return other
        return MassiveRows(
            np.concatenate([self.states, other.states]), np.concatenate([self.flags, other.flags])
        )

    def created(self, i: int, j: int) -> np.ndarray:
        """The recorded rows massive in state ``j`` but not in state ``i``:
        the ones a replacement of ``blocks[i:j]`` would have to create."""
        if self.flags.size == 0:
            return np.zeros(0, dtype=bool)
        return self.flags[:, j] & ~self.flags[:, i]

    def _pair(self, sel: np.ndarray, i: int, j: int) -> tuple[np.ndarray, np.ndarray]:
        """The chosen rows in states ``i`` and ``j``, float64."""
        states = self.states
        return states[sel, i].astype(np.float64), states[sel, j].astype(np.float64)

    def plain_moments(
        self, moments: Moments, i: int, j: int, target_sq: float
    ) -> tuple[np.ndarray, np.ndarray, float]:
        """``XᵀX``, ``XᵀY`` and ``tr(YᵀY)`` (given uncorrected as ``target_sq``)
        from state ``i`` to state ``j`` with the target of every row the span
        would have to make massive replaced by its input, as
        :meth:`plain_fit` fits them (unchanged when there is none)."""
        gram, cross = moments.cross(i, i), moments.cross(i, j)
        sel = self.created(i, j)
        if not sel.any():
            return gram, cross, target_sq
        xi, xj = self._pair(sel, i, j)
        return gram, cross + xi.T @ (xi - xj), target_sq + float((xi**2).sum() - (xj**2).sum())

    def plain_fit(
        self,
        moments: Moments,
        i: int,
        j: int,
        center: bool,
        ridge: float,
        relative: bool,
    ) -> Translator | None:
        """The least-squares translator from state ``i`` to state ``j`` of
        ``moments`` (affine with ``center``, else linear; ``ridge`` absolute,
        or times the mean diagonal of the Gram with ``relative``, as the
        core's fit) with the target of every row the span would have to
        make massive replaced by its input. None when there is none."""
        sel = self.created(i, j)
        if not sel.any():
            return None
        xi, xj = self._pair(sel, i, j)
        n = moments.rows
        sum_i = moments.sum(i)
        sum_j = moments.sum(j) + (xi - xj).sum(axis=0)
        gram = moments.cross(i, i)
        cross = moments.cross(i, j) + xi.T @ (xi - xj)
        if center:
            gram = gram - np.outer(sum_i, sum_i) / n
            cross = cross - np.outer(sum_i, sum_j) / n
        effective = ridge * np.trace(gram) / gram.shape[0] if relative else ridge
        weight, condition, rank, method = solve_gram(gram, cross, effective)
        bias = (sum_j - sum_i @ weight) / n if center else np.zeros(gram.shape[0])
        kind = "affine" if center else "linear"
        return Translator(kind, weight, bias, condition, rank, method)
