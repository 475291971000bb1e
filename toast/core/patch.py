"""Translators in the Hadamard basis: LinearPatch's map and toast's fits
around it, from the moments of two states (float64, NumPy).

LinearPatch (Chen et al., arXiv 2505.24680) replaces a removed span by
``P = H diag(d) Hᵀ`` (row vectors: ``y = x P``), ``H`` the orthonormal
Hadamard rotation of :func:`toast.core.hadamard.hadamard` and ``d`` the
ratio of the rotated activations' mean magnitudes after and before the
span (:func:`linear_patch`; the scales themselves come from a pass over
the data, :func:`patch_scales`). A ``d``-parameter map cannot follow
what the span does beyond a per-channel gain, and an unrestricted least
squares fit over ``d²`` parameters can overfit the few rows with massive
activations; toast's fits sit between the two:

- ``"rotated_diagonal"``: the least-squares diagonal in the rotated
  basis, ``d_c = (Hᵀ XᵀY H)_cc / (Hᵀ XᵀX H)_cc``, the best map of
  LinearPatch's form on the calibration rows;
- ``"patch_ridge"``: least squares shrunk towards that map,
  ``T = argmin ‖X T − Y‖² + λ ‖T − P‖²``, i.e.
  ``T = P + (XᵀX + λ I)⁻¹ (XᵀY − XᵀX P)``, with ``λ`` chosen by
  generalised cross-validation over a grid (λ = 0 is least squares, λ → ∞
  the rotated diagonal; both are on the grid).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from toast.core.hadamard import hadamard
from toast.core.kinds import kind_names
from toast.core.solvers import Translator

__all__ = [
    "PATCH_FITS",
    "PATCH_KINDS",
    "PatchFit",
    "fit_patch",
    "fit_patch_ridge",
    "linear_patch",
    "patch_scales",
    "rotated_diagonal",
]

#: The translator kinds of this module, the Hadamard-basis kinds of
#: :data:`toast.core.kinds.KINDS` (``"linearpatch"`` needs scales from a pass
#: over the data; the others only the moments).
PATCH_KINDS = kind_names(hadamard=True)
#: The kinds :func:`fit_patch` fits from the moments alone.
PATCH_FITS = kind_names(hadamard=True, fit="moments")

#: λ grid of :func:`fit_patch_ridge`, relative to the mean eigenvalue of
#: ``XᵀX``; 0 and ∞ are added.
RIDGE_GRID = tuple(10.0**k for k in range(-6, 5))


def linear_patch(scale: np.ndarray) -> np.ndarray:
    """LinearPatch's map ``H diag(scale) Hᵀ`` (symmetric, ``d × d``)."""
    scale = np.asarray(scale, dtype=np.float64)
    if scale.ndim != 1 or not np.all(np.isfinite(scale)):
        raise ValueError(f"scale must be a finite vector; got shape {scale.shape}")
    h = hadamard(scale.shape[0])
    return (h * scale) @ h.T


def patch_scales(input_means: np.ndarray, output_means: np.ndarray) -> np.ndarray:
    """LinearPatch's ``d``: per sample, the mean magnitude of each rotated
    channel at the span's output over the same at its input, averaged
    over samples. ``*_means`` are ``(samples, d)`` mean ``|x H|`` per
    sample (over its tokens). A channel whose input is zero in a sample
    takes 1 there (the paper's ratio is undefined; no scaling)."""
    inputs, outputs = np.asarray(input_means, np.float64), np.asarray(output_means, np.float64)
    if inputs.shape != outputs.shape or inputs.ndim != 2 or not inputs.shape[0]:
        raise ValueError(
            f"input and output means must be (samples, d) of one shape; got {inputs.shape} "
            f"and {outputs.shape}"
        )
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(inputs > 0, outputs / inputs, 1.0)
    return ratio.mean(axis=0)


def rotated_diagonal(gram: np.ndarray, cross: np.ndarray) -> np.ndarray:
    """The least-squares map of LinearPatch's form from ``XᵀX`` and ``XᵀY``:
    ``H diag(d) Hᵀ`` with ``d_c = (Hᵀ XᵀY H)_cc / (Hᵀ XᵀX H)_cc`` (1 where
    a rotated channel never varies)."""
    h = hadamard(gram.shape[0])
    num = np.einsum("ic,ij,jc->c", h, cross, h)
    den = np.einsum("ic,ij,jc->c", h, gram, h)
    scale = np.where(den > 0, num / np.where(den > 0, den, 1.0), 1.0)
    return linear_patch(scale)


@dataclass(frozen=True)
class PatchFit:
    """A fit of :func:`fit_patch_ridge`: the map, the λ chosen (absolute;
    ``inf``: the prior itself), and its GCV score (mean squared error per
    row, estimated)."""

    weight: np.ndarray
    ridge: float
    gcv: float


def fit_patch_ridge(
    gram: np.ndarray, cross: np.ndarray, target_sq: float, rows: int, prior: np.ndarray
) -> PatchFit:
    """``T = P + (XᵀX + λ I)⁻¹ (XᵀY − XᵀX P)`` with ``λ`` minimising GCV.

    ``gram`` = ``XᵀX``, ``cross`` = ``XᵀY``, ``target_sq`` = ``tr(YᵀY)``,
    ``rows`` = n, ``prior`` = P. In the eigenbasis ``XᵀX = V Λ Vᵀ`` with
    ``B = Vᵀ (XᵀY − XᵀX P)``, the residual sum of squares is
    ``‖Y − X P‖² − Σ_k ‖B_k‖² (Λ_k + 2λ) / (Λ_k + λ)²`` and the degrees of
    freedom ``Σ_k Λ_k / (Λ_k + λ)`` (shared by every output column), so
    the whole grid costs one eigendecomposition."""
    gram, cross, prior = (np.asarray(a, dtype=np.float64) for a in (gram, cross, prior))
    lam, vec = np.linalg.eigh(gram)
    lam = np.clip(lam, 0.0, None)
    gp = gram @ prior
    b2 = ((vec.T @ (cross - gp)) ** 2).sum(axis=1)
    base = float(target_sq - 2.0 * np.sum(prior * cross) + np.sum(prior * gp))
    scale = max(float(lam.mean()), np.finfo(float).tiny)
    positive = lam > lam.max() * lam.shape[0] * np.finfo(float).eps
    best = (base / rows, np.inf)  # λ = ∞: the prior itself, 0 degrees of freedom
    for ridge in (0.0, *(scale * g for g in RIDGE_GRID)):
        keep = positive if ridge == 0.0 else np.ones_like(positive)
        denom = lam + ridge
        shrink = np.where(keep, (lam + 2 * ridge) / np.where(keep, denom, 1.0) ** 2, 0.0)
        rss = max(base - float(np.sum(b2 * shrink * np.where(keep, 1.0, 0.0))), 0.0)
        df = float(np.sum(np.where(keep, lam / np.where(keep, denom, 1.0), 0.0)))
        if df >= rows:
            continue
        gcv = rss / (rows * (1.0 - df / rows) ** 2)
        if gcv < best[0]:
            best = (gcv, ridge)
    gcv, ridge = best
    if not np.isfinite(ridge):
        return PatchFit(prior, ridge, gcv)
    inv = np.where(positive | (ridge > 0), 1.0 / np.where(lam + ridge > 0, lam + ridge, 1.0), 0.0)
    delta = (vec * inv) @ (vec.T @ (cross - gp))
    return PatchFit(prior + delta, ridge, gcv)


def fit_patch(
    kind: str, gram: np.ndarray, cross: np.ndarray, target_sq: float, rows: int
) -> Translator:
    """A translator of toast's Hadamard-basis kinds from ``XᵀX``, ``XᵀY``,
    ``tr(YᵀY)`` and the row count: ``"rotated_diagonal"`` or
    ``"patch_ridge"`` (see the module docstring); no bias. ``condition`` is
    that of ``XᵀX + λ I`` (1 for the diagonal: no matrix is inverted)."""
    if kind not in PATCH_FITS:
        raise ValueError(f"kind must be one of {list(PATCH_FITS)}; got {kind!r}")
    prior = rotated_diagonal(gram, cross)
    dim = prior.shape[0]
    condition, ridge = 1.0, math.inf
    weight = prior
    if kind == "patch_ridge":
        fit = fit_patch_ridge(gram, cross, target_sq, rows, prior)
        weight, ridge = fit.weight, fit.ridge
    if math.isfinite(ridge):
        lam = np.clip(np.linalg.eigvalsh(gram), 0.0, None)
        low = lam.min() + ridge
        condition = math.inf if low <= 0 else float((lam.max() + ridge) / low)
    method = "diagonal" if not math.isfinite(ridge) else f"eigh (ridge {ridge:.3g})"
    return Translator(kind, weight, np.zeros(dim), condition, dim, method)
