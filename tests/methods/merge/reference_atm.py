"""An independent NumPy (float64) forward of ATM's merging blocks (Lee &
Choi, arXiv 2505.15160, as read in ``toast.methods.merge.atm``), one image
at a time with plain loops: the tests compare :class:`AtmReducer` against it.

Per block: attention with proportional attention, then each source token's
best destination by the cosine similarity of the keys averaged over heads;
the sources above the block's threshold merge (by size-weighted mean) into
their matches; then the MLP. Blocks from ``split_from`` on take the smaller
half of the unprotected tokens by size as sources and the rest as
destinations; the others take ToMe's even / odd positions."""

from __future__ import annotations

import numpy as np

from .reference import _attention, _layer_norm, reduce_then_mlp


def _sets(n, s, prefix, size_distinctive):
    """The source and destination positions (unprotected only)."""
    free = list(range(prefix, n))
    if size_distinctive:
        ranked = sorted(free, key=lambda i: (s[i], i))
        half = len(ranked) // 2
        return ranked[:half], ranked[half:]
    return [i for i in free if i % 2 == 0], [j for j in free if j % 2 == 1]


def atm_match(metric, s, threshold, prefix, size_distinctive, count=None):
    """One image's merges: ``({source: destination}, c)``, where ``c`` is
    how many sources are above ``threshold`` (capped as ToMe caps ``r``).
    ``count`` (None: ``c``) overrides how many of the best sources merge."""
    n = len(metric)
    a_set, b_set = _sets(n, s, prefix, size_distinctive)
    if not a_set or not b_set:
        return {}, 0
    unit = metric / np.linalg.norm(metric, axis=1, keepdims=True)
    best = {}
    for i in a_set:
        sims = [float(unit[i] @ unit[j]) for j in b_set]
        best[i] = (max(sims), b_set[int(np.argmax(sims))])
    cap = min((n - prefix) // 2, len(a_set))
    c = min(sum(1 for i in a_set if best[i][0] > threshold), cap)
    chosen = sorted(a_set, key=lambda i: -best[i][0])[: c if count is None else count]
    return {i: best[i][1] for i in chosen}, c


def atm_block(p, x, s, where, threshold, prefix, size_distinctive, count=None):
    """One block on one image: returns ``(x, s, where, c)`` (``where``: each
    input token's current index; ``c`` as :func:`atm_match` says)."""
    attended, metric = _attention(_layer_norm(x, p["ln1"]), s, p)
    x = x + (attended if p["ls1"] is None else attended * p["ls1"])
    pairs, c = atm_match(metric, s, threshold, prefix, size_distinctive, count)
    return (*reduce_then_mlp(p, x, s, where, pairs), c)


def atm_forward(weights, x, thresholds, split_from, prefix):
    """Per-image ATM through every block on one image ``x`` (N, D): the
    final tokens, their sizes, each input token's final index and the
    number merged in each block."""
    s, where, counts = np.ones(len(x)), np.arange(len(x)), []
    for block, (p, threshold) in enumerate(zip(weights, thresholds, strict=True)):
        distinctive = split_from is not None and block >= split_from
        x, s, where, c = atm_block(p, x, s, where, threshold, prefix, distinctive)
        counts.append(c)
    return x, s, where, counts
