"""Time and memory of TOAST's bounded error matrix at a wide width (issue 30).

Synthetic states of a random walk (``x_{k+1} = x_k + noise``, a few massive
channels), ``--rows`` token rows of width ``--dim``, kept on disk by
:class:`toast.core.chunked.ChunkedMoments` under ``--bound`` bytes; prints the
replay plan, the seconds the error matrix took and its pairs. Watch the peak
resident memory from outside::

    python benchmarks/_peak.py -- python benchmarks/bench_chunked_wide.py \\
        --dim 4096 --states 3 --span 2 --rows 4000 --folds 5 --estimator gcv --bound 2GiB
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from toast.core.chunked import ChunkedMoments, pair_nbytes
from toast.hf.capture.budget import parse_size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--states", type=int, default=3)
    p.add_argument("--span", type=int, default=2)
    p.add_argument("--rows", type=int, default=4000)
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--estimator", default="cv", choices=("cv", "gcv"))
    p.add_argument("--bound", default="2GiB")
    a = p.parse_args()
    bound = parse_size(a.bound)
    rng = np.random.default_rng(0)
    chunked = ChunkedMoments(a.states, a.dim, folds=a.folds, pairs=a.span, bound=bound)
    batch = 500
    x = None
    for start in range(0, a.rows, batch):
        n = min(batch, a.rows - start)
        x = rng.standard_normal((n, a.dim), dtype=np.float32)
        x[:, :4] *= 100.0  # massive channels
        states = [x]
        for _ in range(a.states - 1):
            states.append(states[-1] + 0.3 * rng.standard_normal((n, a.dim), dtype=np.float32))
        chunked.update(states)
    folds = a.folds if a.estimator == "cv" else 0
    plan = chunked.chunk(folds)
    print(f"pair_nbytes: {pair_nbytes(a.dim, folds) / 2**30:.2f} GiB; replays: {len(plan)}")
    t = time.perf_counter()
    table = chunked.error_matrices([("linear", a.estimator, 0.0)])[0]
    took = time.perf_counter() - t
    pairs = int(np.isfinite(table).sum())
    print(f"error matrix: {took:.1f} s for {pairs} pairs ({took / max(pairs, 1):.1f} s/pair)")


if __name__ == "__main__":
    main()
