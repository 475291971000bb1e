"""An independent NumPy (float64) forward of RAPID's blocks, written from
the reading in ``rapid.md`` (§1.4–1.6) that toast implements, one image at
a time with plain loops: the tests compare
:class:`toast.methods.merge.rapid.RapidReducer` against it.

Per block: attention with proportional attention (sizes as ``log s`` on
the logits); ToMe's split (even positions are sources, odd destinations,
the prefix out of both); in a pruning block the ``r`` sources with the
largest ``(s·Num, s)`` are dropped (their mass lost, the source map sends
them to their best destination); in a merging block the ``r`` sources with
the largest ``s·(1 − Î)`` merge into their best destinations by size
(``Î``: the class token's attention, averaged over heads, over its maximum
on the non-prefix tokens); then the MLP."""

from __future__ import annotations

import numpy as np

from .reference import _attention, _layer_norm, cls_attention, reduce_then_mlp


def choose(metric, attention, r, prefix, prune, tau):
    """The sources removed this block: {source position: its best destination}."""
    n = len(metric)
    a_set = [i for i in range(0, n, 2) if i >= prefix]
    b_set = [j for j in range(1, n, 2) if j >= prefix]
    r = min(r, (n - prefix) // 2, len(a_set)) if b_set else 0
    unit = metric / np.linalg.norm(metric, axis=1, keepdims=True)
    peak = max(attention[prefix:])
    key, best = {}, {}
    for i in a_set:
        sims = [float(unit[i] @ unit[j]) for j in b_set]
        s = max(sims)
        best[i] = b_set[int(np.argmax(sims))]
        if prune:
            num = sum(1 for v in sims if v > tau)  # destinations similar to i
            key[i] = (-(s * num), -s)
        else:
            key[i] = (-(s * (1.0 - attention[i] / peak)),)
    chosen = sorted(a_set, key=lambda i: key[i])[:r]  # stable: ties by position
    return {i: best[i] for i in chosen}


def rapid_forward(weights, x, r_per_block, prune_until, tau, prefix, norm="average"):
    """The blocks on one image ``x`` (N, D): returns the final tokens, their
    sizes and, for every input token, the index of the token it ended in."""
    s = np.ones(len(x))
    where = np.arange(len(x))
    for block, (p, r) in enumerate(zip(weights, r_per_block, strict=True)):
        normed = _layer_norm(x, p["ln1"])
        attended, metric = _attention(normed, s, p)
        attention = cls_attention(normed, s, p)
        x = x + (attended if p["ls1"] is None else attended * p["ls1"])
        prune = block < prune_until
        pairs = choose(metric, attention, r, prefix, prune, tau)
        x, s, where = reduce_then_mlp(p, x, s, where, pairs, prune, norm)
    return x, s, where
