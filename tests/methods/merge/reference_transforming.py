"""An independent NumPy (float64) forward of Token Transforming blocks
(toast's reading of arXiv 2506.05709, see
``toast/methods/merge/transforming.py``), one image at a time with plain
loops: the tests compare the reducer against it.

Per block: attention with proportional attention, then the anchors (the
free tokens the class token attends to most, ties by position), then the
spread matrix (prefix and anchors: identity; every other token: softmax
over the anchors of key cosine / temperature, or a one-hot on the most
similar anchor with ``hard``), then size-weighted outputs and the MLP."""

from __future__ import annotations

import numpy as np

from .reference import _attention, _gelu, _layer_norm, cls_attention


def _cosine(u, v):
    return float(u @ v / (np.linalg.norm(u) * np.linalg.norm(v)))


def spread_matrix(attention, metric, r, prefix, temperature, hard=False):
    """The (N', N) spread matrix of one block, or None when nothing leaves."""
    n = len(metric)
    r = max(0, min(r, (n - prefix) // 2))
    if r == 0:
        return None
    free = list(range(prefix, n))
    ranked = sorted(free, key=lambda j: (-attention[j], j))
    anchors = sorted(ranked[: len(free) - r])
    outputs = list(range(prefix)) + anchors
    spread = np.zeros((len(outputs), n))
    for j in range(n):
        if j in outputs:
            spread[outputs.index(j), j] = 1.0
            continue
        logits = np.array([_cosine(metric[j], metric[a]) / temperature for a in anchors])
        if hard:
            shares = np.zeros(len(anchors))
            shares[int(np.argmax(logits))] = 1.0
        else:
            shares = np.exp(logits - logits.max())
            shares /= shares.sum()
        for i in range(len(anchors)):
            spread[prefix + i, j] = shares[i]
    return spread


def transform_forward(weights, x, r_per_block, prefix, temperature, hard=False, mean_norm=False):
    """The blocks on one image ``x`` (N, D): returns the final tokens, their
    sizes and the (N₀, N') source map (every input token's shares of the
    final tokens), plus the sizes after every block. ``mean_norm``: an
    output that received a share takes its inputs' share-and-size-weighted
    mean norm."""
    s = np.ones(len(x))
    source = np.eye(len(x))
    history = []
    for p, r in zip(weights, r_per_block, strict=True):
        normed = _layer_norm(x, p["ln1"])
        attended, metric = _attention(normed, s, p)
        x = x + (attended if p["ls1"] is None else attended * p["ls1"])
        spread = spread_matrix(cls_attention(normed, s, p), metric, r, prefix, temperature, hard)
        if spread is not None:
            outputs, n = spread.shape
            new_x, new_s = np.zeros((outputs, x.shape[1])), np.zeros(outputs)
            lengths = np.zeros(outputs)
            for o in range(outputs):
                for j in range(n):
                    new_x[o] += spread[o, j] * s[j] * x[j]
                    new_s[o] += spread[o, j] * s[j]
                    lengths[o] += spread[o, j] * s[j] * np.linalg.norm(x[j])
            new_x /= new_s[:, None]
            for o in range(outputs):
                received = np.count_nonzero(spread[o]) > 1  # beside its own token
                if mean_norm and received:
                    new_x[o] *= lengths[o] / new_s[o] / np.linalg.norm(new_x[o])
            x, s = new_x, new_s
            source = source @ spread.T
        history.append(s.copy())
        hidden = _gelu(_layer_norm(x, p["ln2"]) @ p["w1"].T + p["b1"])
        mlp = hidden @ p["w2"].T + p["b2"]
        x = x + (mlp if p["ls2"] is None else mlp * p["ls2"])
    return x, s, source, history
