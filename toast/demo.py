"""The embedded default job: an end-to-end analysis on synthetic activations.

A toy residual stream ``x_{k+1} = x_k + g_k(x_k)`` of ``blocks`` blocks is
generated batch by batch. Each block's update ``g_k`` mixes a linear part and
a nonlinear (tanh) part with its own strength, so some spans are almost
linear (redundant) and others are not. The states stream into
:class:`toast.Moments` (never all held), the held-out error matrix is
printed, and the best span gets a closed-form translator whose held-out
error is checked against the matrix.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from toast.core import Moments, error_matrix, fit_translator


@dataclass(frozen=True)
class ToyStream:
    """Random weights of the toy residual stream."""

    linear: list[np.ndarray]
    nonlinear: list[np.ndarray]
    strength: np.ndarray  # per block: share of the nonlinear update

    @classmethod
    def create(cls, blocks: int, dim: int, seed: int) -> ToyStream:
        rng = np.random.default_rng(seed)
        scale = 0.5 / np.sqrt(dim)
        linear = [rng.standard_normal((dim, dim)) * scale for _ in range(blocks)]
        nonlinear = [rng.standard_normal((dim, dim)) * 3 * scale for _ in range(blocks)]
        # A U-shaped profile: early and late blocks strongly nonlinear,
        # middle blocks nearly linear -- the pattern the heatmaps show on ViTs.
        t = np.linspace(-1.0, 1.0, blocks)
        strength = 0.05 + 0.9 * t**4
        return cls(linear, nonlinear, strength)

    def states(self, batch: np.ndarray) -> list[np.ndarray]:
        """States 0..L for one batch of inputs (rows, dim), float32."""
        out = [batch.astype(np.float32)]
        x = batch
        for lin, nonlin, s in zip(self.linear, self.nonlinear, self.strength, strict=True):
            x = x + (1 - s) * (x @ lin) + s * np.tanh(x @ nonlin) * 2.0
            out.append(x.astype(np.float32))
        return out


def run_demo(
    blocks: int = 8,
    dim: int = 64,
    rows: int = 20_000,
    batch_rows: int = 2_000,
    folds: int = 5,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Runs the synthetic analysis and prints a report; returns its numbers."""
    from tqdm.auto import tqdm

    stream = ToyStream.create(blocks, dim, seed)
    rng = np.random.default_rng(seed + 1)
    num_states = blocks + 1
    nbytes = Moments.estimate_nbytes(num_states, dim, folds=folds)
    print(
        f"toast demo: {blocks} toy blocks, dim {dim}, {rows} rows, {folds}-fold moments "
        f"({nbytes / 2**20:.1f} MiB)"
    )
    moments = Moments(num_states, dim, folds=folds)
    start = time.perf_counter()
    with tqdm(total=rows, unit="rows", disable=not progress, desc="moments") as bar:
        done = 0
        while done < rows:
            n = min(batch_rows, rows - done)
            moments.update(stream.states(rng.standard_normal((n, dim))))
            done += n
            bar.update(n)
    accumulate_s = time.perf_counter() - start

    start = time.perf_counter()
    E = error_matrix(moments, metric="linear", estimator="cv")
    matrix_s = time.perf_counter() - start

    print(
        f"\nHeld-out linear error E[i, j] (state i -> state j; replaces blocks i..j-1), "
        f"{accumulate_s:.2f} s to accumulate, {matrix_s:.2f} s to solve:"
    )
    print(format_matrix(E))

    iu = np.triu_indices(num_states, k=2)  # spans of >= 2 blocks
    order = np.argsort(E[iu])
    print("\nMost redundant spans of >= 2 blocks (Python slice of blocks, papers' s->e):")
    for rank in range(min(5, order.size)):
        i, j = int(iu[0][order[rank]]), int(iu[1][order[rank]])
        print(f"  blocks[{i}:{j}]  ({i - 1}->{j - 1})  error {E[i, j]:.4f}")
    best_i, best_j = int(iu[0][order[0]]), int(iu[1][order[0]])
    translator = fit_translator(moments, best_i, best_j, kind="affine")

    # Fresh held-out rows: the translator's error must match the predicted one.
    test = stream.states(np.random.default_rng(seed + 2).standard_normal((5_000, dim)))
    x, y = test[best_i].astype(np.float64), test[best_j].astype(np.float64)
    fresh = float(np.linalg.norm(y - translator(x)) / np.linalg.norm(y))
    print(
        f"\nAffine translator for blocks[{best_i}:{best_j}]: condition "
        f"{translator.condition:.3g} ({translator.method}); error on fresh rows "
        f"{fresh:.4f} vs predicted {E[best_i, best_j]:.4f}"
    )
    return {
        "errors": E,
        "best_span": (best_i, best_j),
        "fresh_error": fresh,
        "accumulate_s": accumulate_s,
        "matrix_s": matrix_s,
    }


def format_matrix(E: np.ndarray) -> str:
    """The upper triangle of an error matrix as a fixed-width text table."""
    n = E.shape[0]
    lines = ["      " + "".join(f"{j:>7d}" for j in range(1, n))]
    for i in range(n - 1):
        cells = "".join("      ." if j <= i else f"{E[i, j]:7.3f}" for j in range(1, n))
        lines.append(f"{i:>5d} {cells}")
    return "\n".join(lines)
