"""An independent NumPy (float64) forward of PiToMe's blocks, written from
``pitome.md`` (§1.2–1.7, one plain PiToMe step in every block), one image
at a time with plain loops: the tests compare
:class:`toast.methods.merge.pitome.PitomeReducer` against it.

Per block: attention with proportional attention (sizes as ``log s`` on the
logits, as toast's installed forward does); the free (non-prefix) tokens'
cosine similarities of the keys averaged over heads; each free token's
energy, the mean over every free token (itself included) of
``ELU(cos − margin; alpha)``; the ``2r`` highest-energy tokens (ties by
position) split by rank, even ranks merging into their most similar odd
rank by size, the others kept; the kept tokens in positional order; then
the MLP."""

from __future__ import annotations

import math

import numpy as np

from .reference import _attention, _layer_norm, reduce_then_mlp


def energies(metric, margin, alpha, prefix):
    """{free position: its energy}, and the free tokens' unit metric rows."""
    n = len(metric)
    free = list(range(prefix, n))
    unit = {i: metric[i] / np.linalg.norm(metric[i]) for i in free}
    energy = {}
    for i in free:
        total = 0.0
        for j in free:
            x = float(unit[i] @ unit[j]) - margin
            total += x if x > 0 else alpha * (math.exp(x) - 1.0)
        energy[i] = total / len(free)
    return energy, unit


def choose(metric, r, margin, alpha, prefix):
    """The merges this block: {source position: destination position}."""
    free = len(metric) - prefix
    r = min(r, free // 2)
    if r == 0:
        return {}
    energy, unit = energies(metric, margin, alpha, prefix)
    ranked = sorted(energy, key=lambda i: -energy[i])  # stable: ties by position
    candidates = ranked[: 2 * r]
    sources, destinations = candidates[0::2], candidates[1::2]
    pairs = {}
    for a in sources:
        sims = [float(unit[a] @ unit[b]) for b in destinations]
        pairs[a] = destinations[int(np.argmax(sims))]
    return pairs


def pitome_forward(weights, x, r_per_block, margins, alpha, prefix):
    """The blocks on one image ``x`` (N, D): returns the final tokens, their
    sizes and, for every input token, the index of the token it ended in."""
    s = np.ones(len(x))
    where = np.arange(len(x))
    for p, r, margin in zip(weights, r_per_block, margins, strict=True):
        attended, metric = _attention(_layer_norm(x, p["ln1"]), s, p)
        x = x + (attended if p["ls1"] is None else attended * p["ls1"])
        pairs = choose(metric, r, margin, alpha, prefix)
        x, s, where = reduce_then_mlp(p, x, s, where, pairs)
    return x, s, where
