"""What forward passes compute in, decided by measurement.

A 16-bit matmul is the fast path on some CPUs (AMX or AVX-512 BF16: several
times float32's rate) and the slow one on others (emulated: tens of times
slower). :func:`native_matmul` times one small matmul in the 16-bit dtype
against float32 on the device, once per process, so the choice follows the
machine rather than a list of CPU flags.

Two places read the choice (``Calibration.compute_dtype``):

- the block-by-block path from a checkpoint (:func:`compute_dtype`):
  ``"auto"`` computes a 16-bit checkpoint in its own dtype where that dtype
  is native, and widens it to float32 where it is not;
- passes over a model in memory (calibration and held-out measurement,
  :func:`forwards_in`): ``"bfloat16"`` runs a float32 model's matmuls in
  bf16 under ``torch.autocast`` (the weights stay float32, norms and the
  residual stream keep float32); ``"auto"`` leaves the model's own dtype.

Statistics are float64 whatever the forwards compute in.
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from toast.hf.data.calibration import COMPUTE_DTYPES

__all__ = [
    "COMPUTE_DTYPES",
    "NARROW_DTYPES",
    "compute_dtype",
    "forward_dtype",
    "forwards_in",
    "loaded_dtype",
    "native_matmul",
    "widen_loaded",
]

#: The 16-bit dtypes whose matmuls may or may not be native.
NARROW_DTYPES = (torch.float16, torch.bfloat16)
# m x k @ k x n of the probe (1 GFLOP): large enough that a native kernel
# beats float32 clearly (a smaller one is dominated by the kernel's setup:
# 256 x 512 x 512 in bf16 took 4 ms against 0.5 ms for this on AMX), and a
# few emulated rounds cost well under a second
_PROBE = (512, 1024, 1024)
_WARMUP = 2
_ROUNDS = 5
# a 16-bit dtype counts as native when its matmul takes at most this share of
# float32's time (native: ~0.15 on AMX; emulated: 5 to 40)
_NATIVE_SHARE = 0.8


def _timed(a: torch.Tensor, b: torch.Tensor) -> float:
    start = time.perf_counter()
    torch.mm(a, b)
    if a.device.type == "cuda":
        torch.cuda.synchronize(a.device)
    return time.perf_counter() - start


@functools.cache
def _measured(dtype: torch.dtype, device: str) -> bool:
    generator = torch.Generator().manual_seed(0)
    m, k, n = _PROBE
    a = torch.randn(m, k, generator=generator).to(device)
    b = torch.randn(k, n, generator=generator).to(device)
    narrow_a, narrow_b = a.to(dtype), b.to(dtype)
    for _ in range(_WARMUP):  # the first calls pick and build kernels
        _timed(a, b), _timed(narrow_a, narrow_b)
    wide, narrow = [], []
    for _ in range(_ROUNDS):  # interleaved, fastest of each: robust to load
        wide.append(_timed(a, b))
        narrow.append(_timed(narrow_a, narrow_b))
        if min(narrow) > 2 * min(wide):  # clearly emulated: no need to wait
            break
    return min(narrow) <= _NATIVE_SHARE * min(wide)


def native_matmul(dtype: torch.dtype, device: str | torch.device = "cpu") -> bool:
    """Whether matmuls in the 16-bit ``dtype`` on ``device`` are faster than
    float32 ones: measured once per process on the CPU (a 512 x 1024 x 1024
    product, fastest of up to 5 interleaved rounds after 2 to warm up, at
    most 0.8 of float32's time),
    read from the driver on CUDA (bf16 where ``torch.cuda.is_bf16_supported``;
    float16 always). False for any other dtype."""
    if dtype not in NARROW_DTYPES:
        return False
    kind = torch.device(device).type
    if kind == "cuda":
        return dtype == torch.float16 or torch.cuda.is_bf16_supported()
    if kind != "cpu":
        return False
    return _measured(dtype, "cpu")


def _warn_if_emulated(device: str | torch.device) -> None:
    """Says so when bf16 was asked for where its matmuls are emulated: the
    pass then takes several times float32's (tens of times on AVX2 only)."""
    if not native_matmul(torch.bfloat16, device):
        warnings.warn(
            "compute_dtype='bfloat16' was asked for, but bf16 matmuls are emulated on this "
            "CPU (no AMX or AVX-512 BF16: measured slower than float32), so the passes run "
            "several times slower than in float32; compute_dtype='auto' keeps float32 here",
            RuntimeWarning,
            stacklevel=3,
        )


def compute_dtype(
    weights: torch.dtype, option: str = "auto", device: str | torch.device = "cpu"
) -> torch.dtype:
    """The dtype forwards on ``device`` (the block-by-block path's: the CPU)
    compute in for weights of dtype ``weights``: ``"auto"`` keeps a 16-bit
    checkpoint's dtype where :func:`native_matmul` finds it native there and
    widens it to float32 where not; ``"float32"`` and ``"bfloat16"`` compute
    in that dtype; ``"checkpoint"`` in the weights' own."""
    if option not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be one of {list(COMPUTE_DTYPES)}; got {option!r}")
    if option == "checkpoint":
        return weights
    if option == "float32":
        return torch.float32
    if option == "bfloat16":
        _warn_if_emulated(device)
        return torch.bfloat16
    if weights in NARROW_DTYPES:
        return weights if native_matmul(weights, device) else torch.float32
    return weights


def forward_dtype(model: nn.Module, option: str = "auto") -> torch.dtype | None:
    """The dtype ``model``'s matmuls run in under :func:`forwards_in`:
    bfloat16 when ``option`` is ``"bfloat16"`` and the model's floating
    weights are float32 (autocast), else None (the model's own dtype)."""
    if option not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be one of {list(COMPUTE_DTYPES)}; got {option!r}")
    if option != "bfloat16":
        return None
    floating = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if floating != {torch.float32}:
        return None
    _warn_if_emulated(next(model.parameters()).device)
    return torch.bfloat16


@contextlib.contextmanager
def forwards_in(model: nn.Module, option: str = "auto") -> Iterator[None]:
    """Runs the enclosed forwards of ``model`` in the dtype
    :func:`forward_dtype` chooses: ``torch.autocast`` to bf16 for a float32
    model asked for ``"bfloat16"`` (float64 tensors are never cast, so
    statistics kept in float64 stay exact), nothing otherwise."""
    dtype = forward_dtype(model, option)
    if dtype is None:
        yield
        return
    device = next(model.parameters()).device.type
    with torch.autocast(device_type=device, dtype=dtype):
        yield


def loaded_dtype(
    weights: torch.dtype, option: str = "auto", device: str | torch.device = "cpu"
) -> torch.dtype:
    """What a checkpoint of dtype ``weights`` loaded whole from a folder onto
    ``device`` computes in (:func:`widen_loaded`): float32 where a 16-bit
    checkpoint is widened (as :func:`compute_dtype` decides, with ``"auto"``
    measured on ``device``), else the weights' own dtype (a float32 model
    asked for ``"bfloat16"`` stays float32 and runs under autocast)."""
    widened = weights in NARROW_DTYPES and compute_dtype(weights, option, device) == torch.float32
    return torch.float32 if widened else weights


def widen_loaded(
    model: nn.Module, option: str = "auto", device: str | torch.device = "cpu"
) -> torch.dtype | None:
    """A model toast loaded whole from a 16-bit checkpoint to run on
    ``device``, widened in place to float32 where :func:`loaded_dtype` says
    so (the block-by-block path widens the same checkpoint one block at a
    time); returns the dtype to write it back in, or None when it is left
    as it is. A model the user passes is never widened: its dtype is the
    user's choice."""
    floating = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(floating) != 1:
        return None
    (weights,) = floating
    if loaded_dtype(weights, option, device) == weights:
        return None
    model.to(torch.float32)
    return weights
