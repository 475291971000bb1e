"""Orthonormal Hadamard-type rotations of any width.

LinearPatch (Chen et al., "A Simple Linear Patch Revives Layer-Pruned Large
Language Models", NeurIPS 2025, arXiv 2505.24680) scales the residual
stream per channel in a Hadamard basis, where the few massive activations
of special tokens (about 1e3 against about 1 elsewhere) are spread over
every channel. Widths of real models are often not powers of two (SmolLM2
576 = 16 · 36, MiniLM 384 = 32 · 12, ViT-B 768 = 64 · 12), so the rotation
is ``H_{2^a} ⊗ H_K / √n``: Sylvester's construction for the power of two
and a Paley construction for ``K`` (order ``q + 1`` for a prime
``q ≡ 3 (mod 4)``, order ``2(q + 1)`` for a prime ``q ≡ 1 (mod 4)``). A
width with no such factorisation (not a multiple of 4, or one that needs
another construction) takes the orthonormal discrete Hartley transform for
its odd part instead: still exactly orthogonal and dense (every entry at
most ``√(2/n)`` in magnitude), no longer ±1/√n; :func:`is_hadamard` says
which a width gets.
"""

from __future__ import annotations

import functools

import numpy as np

from toast._validation import Interval, check

__all__ = ["hadamard", "hadamard_order", "is_hadamard"]


def _is_prime(q: int) -> bool:
    if q < 2:
        return False
    return all(q % p for p in range(2, int(q**0.5) + 1))


def _jacobsthal(q: int) -> np.ndarray:
    """``Q[i, j] = χ(j − i)``, χ the quadratic character modulo the prime ``q``."""
    squares = {(x * x) % q for x in range(1, q)}
    chi = np.array([0] + [1 if r in squares else -1 for r in range(1, q)], dtype=np.int64)
    idx = np.arange(q)
    return chi[(idx[None, :] - idx[:, None]) % q]


def _paley(order: int) -> np.ndarray | None:
    """A ±1 Hadamard matrix of ``order`` by Paley's first or second
    construction over a prime field, or None when neither applies."""
    q = order - 1
    if _is_prime(q) and q % 4 == 3:  # Paley I: I + S, S skew
        s = np.zeros((order, order), dtype=np.int64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = 1, -1, _jacobsthal(q)
        return np.eye(order, dtype=np.int64) + s
    q = order // 2 - 1
    if order % 2 == 0 and _is_prime(q) and q % 4 == 1:  # Paley II, S symmetric
        s = np.zeros((order // 2, order // 2), dtype=np.int64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = 1, 1, _jacobsthal(q)
        plus = np.array([[1, 1], [1, -1]], dtype=np.int64)
        zero = np.array([[1, -1], [-1, -1]], dtype=np.int64)
        return np.kron(s, plus) + np.kron(np.eye(order // 2, dtype=np.int64), zero)
    return None


def hadamard_order(n: int) -> int | None:
    """The smallest ``K`` with ``n = 2^a · K`` for which a Hadamard matrix of
    order ``K`` is built here (1, 2, or a Paley order), None when there is
    none (:func:`hadamard` then uses the Hartley transform)."""
    n = check("n", n, Interval(int, 1, None))
    k = n
    candidates = []
    while True:
        if k in (1, 2) or _paley(k) is not None:
            candidates.append(k)
        if k % 2:
            break
        k //= 2
    return min(candidates) if candidates else None


def is_hadamard(n: int) -> bool:
    """Whether :func:`hadamard` of width ``n`` is a true Hadamard matrix
    (every entry ±1/√n)."""
    return hadamard_order(n) is not None


def _sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1), dtype=np.int64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def _hartley(m: int) -> np.ndarray:
    """The orthonormal discrete Hartley transform ``cas(2π jk / m) / √m``."""
    angle = 2 * np.pi * np.outer(np.arange(m), np.arange(m)) / m
    return (np.cos(angle) + np.sin(angle)) / np.sqrt(m)


@functools.lru_cache(maxsize=8)
def _cached(n: int) -> np.ndarray:
    k = hadamard_order(n)
    if k is None:
        odd = n
        while odd % 2 == 0:
            odd //= 2
        h = np.kron(_sylvester(n // odd), _hartley(odd)) / np.sqrt(n // odd)
    else:
        core = np.ones((1, 1), dtype=np.int64) if k == 1 else _paley(k)
        if k == 2:
            core = _sylvester(2)
        assert core is not None  # hadamard_order found it
        h = np.kron(_sylvester(n // k), core) / np.sqrt(n)
    h.setflags(write=False)
    return h


def hadamard(n: int) -> np.ndarray:
    """The orthonormal ``n × n`` rotation (float64, ``H Hᵀ = I``; read-only,
    cached): a Hadamard matrix scaled by ``1/√n`` when :func:`is_hadamard`,
    else Sylvester's matrix times the Hartley transform of the odd part."""
    return _cached(check("n", n, Interval(int, 1, None)))
