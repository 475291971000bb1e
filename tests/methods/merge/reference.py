"""An independent NumPy (float64) forward of merging blocks, written from the
ToMe paper's equations (Bolya et al., ICLR 2023, §3), one image at a time
with plain loops: the tests compare toast's token merging against it.

It runs from the hidden states entering the first merging block to the last
block's output, reading every weight from the model's modules (so pruned
heads, layer scales and timm's fused qkv are read as they are)."""

from __future__ import annotations

import numpy as np
from scipy.special import erf


def _np(t):
    return None if t is None else t.detach().double().numpy()


def block_weights(block) -> dict:
    """The weights of one ViT block (HF ViT/DeiT/DINOv2 or timm layout)."""
    if hasattr(block, "attn"):  # timm
        a = block.attn
        heads = a.num_heads
        w, b = _np(a.qkv.weight), _np(a.qkv.bias)
        d = w.shape[0] // 3
        wq, wk, wv = w[:d], w[d : 2 * d], w[2 * d :]
        bq, bk, bv = b[:d], b[d : 2 * d], b[2 * d :]
        wo, bo = _np(a.proj.weight), _np(a.proj.bias)
        head_dim = d // heads
        scale = head_dim**-0.5
        norms = (block.norm1, block.norm2)
        ls = (None, None)
    else:
        a = block.attention
        heads, head_dim, scale = a.num_attention_heads, a.head_dim, a.scaling
        wq, bq = _np(a.q_proj.weight), _np(a.q_proj.bias)
        wk, bk = _np(a.k_proj.weight), _np(a.k_proj.bias)
        wv, bv = _np(a.v_proj.weight), _np(a.v_proj.bias)
        wo, bo = _np(a.o_proj.weight), _np(a.o_proj.bias)
        if hasattr(block, "norm1"):
            norms = (block.norm1, block.norm2)
            ls = (_np(block.layer_scale1.lambda1), _np(block.layer_scale2.lambda1))
        else:
            norms = (block.layernorm_before, block.layernorm_after)
            ls = (None, None)
    return {
        "heads": heads,
        "head_dim": head_dim,
        "scale": scale,
        "wq": wq,
        "bq": bq,
        "wk": wk,
        "bk": bk,
        "wv": wv,
        "bv": bv,
        "wo": wo,
        "bo": bo,
        "ln1": (_np(norms[0].weight), _np(norms[0].bias), norms[0].eps),
        "ln2": (_np(norms[1].weight), _np(norms[1].bias), norms[1].eps),
        "ls1": ls[0],
        "ls2": ls[1],
        "w1": _np(block.mlp.fc1.weight),
        "b1": _np(block.mlp.fc1.bias),
        "w2": _np(block.mlp.fc2.weight),
        "b2": _np(block.mlp.fc2.bias),
    }


def _layer_norm(x, ln):
    w, b, eps = ln
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def _gelu(x):
    return 0.5 * x * (1.0 + erf(x / np.sqrt(2.0)))


def _attention(x, s, p):
    """Multi-head attention with proportional attention (keys weighted by
    their sizes s): softmax(q kᵀ · scale + log s)."""
    n = x.shape[0]
    h, d = p["heads"], p["head_dim"]
    q = (x @ p["wq"].T + p["bq"]).reshape(n, h, d)
    k = (x @ p["wk"].T + p["bk"]).reshape(n, h, d)
    v = (x @ p["wv"].T + p["bv"]).reshape(n, h, d)
    out = np.zeros((n, h, d))
    for head in range(h):
        logits = q[:, head] @ k[:, head].T * p["scale"] + np.log(s)[None, :]
        logits -= logits.max(axis=1, keepdims=True)
        weights = np.exp(logits)
        weights /= weights.sum(axis=1, keepdims=True)
        out[:, head] = weights @ v[:, head]
    return out.reshape(n, h * d) @ p["wo"].T + p["bo"], k.mean(axis=1)


def cls_attention(x, s, p):
    """The first token's attention over the keys, proportional to the sizes
    ``s`` (``softmax(q₀·kᵀ·scale + log s)``), averaged over the heads
    (``x``: the normed tokens); what RAPID and Token Transforming read."""
    n = x.shape[0]
    h, d = p["heads"], p["head_dim"]
    q0 = (x[0] @ p["wq"].T + p["bq"]).reshape(h, d)
    k = (x @ p["wk"].T + p["bk"]).reshape(n, h, d)
    mean = np.zeros(n)
    for head in range(h):
        logits = np.array([q0[head] @ k[j, head] * p["scale"] + np.log(s[j]) for j in range(n)])
        weights = np.exp(logits - logits.max())
        mean += weights / weights.sum()
    return mean / h


def _match(metric, r, prefix):
    """Bipartite soft matching: {source position: destination position}."""
    n = len(metric)
    a_set = [i for i in range(0, n, 2) if i >= prefix]
    b_set = [j for j in range(1, n, 2) if j >= prefix]
    r = min(r, (n - prefix) // 2, len(a_set)) if b_set else 0
    unit = metric / np.linalg.norm(metric, axis=1, keepdims=True)
    best = {}
    for i in a_set:
        sims = [unit[i] @ unit[j] for j in b_set]
        best[i] = (max(sims), b_set[int(np.argmax(sims))])
    chosen = sorted(a_set, key=lambda i: -best[i][0])[:r]
    return {i: best[i][1] for i in chosen}


def merge_forward(weights, x, r_per_block, prefix, norm="average"):
    """The blocks on one image ``x`` (N, D): returns the final tokens, their
    sizes and, for every input token, the index of the token it ended in."""
    s = np.ones(len(x))
    where = np.arange(len(x))
    for p, r in zip(weights, r_per_block, strict=True):
        attended, metric = _attention(_layer_norm(x, p["ln1"]), s, p)
        x = x + (attended if p["ls1"] is None else attended * p["ls1"])
        x, s, where = reduce_then_mlp(p, x, s, where, _match(metric, r, prefix), norm=norm)
    return x, s, where


def reduce_then_mlp(p, x, s, where, pairs, prune=False, norm="average"):
    """The rest of a block after its attention: every source of ``pairs``
    ({source: destination}) goes into its destination by size (``prune``:
    its mass dropped instead; it still maps to the destination), the kept
    tokens in order; then the MLP. ``norm``: a merged token's norm, as
    computed (``"average"``), the largest of its group's tokens (``"max"``,
    Token Fusion's MLERP) or their size-weighted mean (``"mean"``). Returns
    ``(x, s, where)``, ``where`` each input token's current index."""
    kept = [i for i in range(len(x)) if i not in pairs]
    slot = {i: k for k, i in enumerate(kept)}
    new_x, new_s = np.zeros((len(kept), x.shape[1])), np.zeros(len(kept))
    groups = {k: [] for k in range(len(kept))}
    for i in range(len(x)):
        if prune and i in pairs:
            continue  # a pruned token's mass is dropped
        dst = slot[pairs.get(i, i)]
        new_x[dst] += s[i] * x[i]
        new_s[dst] += s[i]
        groups[dst].append(i)
    new_x = new_x / new_s[:, None]
    for dst, members in groups.items():
        if norm == "average" or len(members) < 2:
            continue
        lengths = [np.linalg.norm(x[i]) for i in members]
        if norm == "max":
            target = max(lengths)
        else:
            target = sum(s[i] * n for i, n in zip(members, lengths, strict=True)) / new_s[dst]
        new_x[dst] *= target / np.linalg.norm(new_x[dst])
    x, s = new_x, new_s
    where = np.array([slot[pairs.get(i, i)] for i in where])
    hidden = _gelu(_layer_norm(x, p["ln2"]) @ p["w1"].T + p["b1"])
    mlp = hidden @ p["w2"].T + p["b2"]
    return x + (mlp if p["ls2"] is None else mlp * p["ls2"]), s, where
