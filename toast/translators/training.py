"""Training the MLP translators of TOAST's ablation (Adam on captured rows)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from toast._validation import Interval, Options, check
from toast.core.kinds import kind_entry, kind_names
from toast.translators.modules import FITTED_KIND, MLPTranslator, ResMLPTranslator

__all__ = ["train_translator"]


def train_translator(
    x: Any,
    y: Any,
    kind: str = "mlp",
    *,
    steps: int = 300,
    lr: float = 1e-3,
    batch_size: int | None = 8192,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    dropout: float = 0.2,
    progress: bool = True,
) -> nn.Module:
    """Trains a :class:`MLPTranslator` or :class:`ResMLPTranslator` so that
    ``module(x) ≈ y`` (mean squared error), as in TOAST's ablation.

    ``x`` and ``y`` are ``(rows, dim)`` arrays or tensors (a
    :class:`toast.hf.capture.rows.RowSample` state view works: rows are read batch by
    batch). Adam with learning rate ``lr`` takes ``steps`` steps, each on
    ``batch_size`` rows drawn without replacement from a generator seeded
    by ``seed`` (the full set when it is no larger: TOAST's full-batch
    protocol). ``dtype`` defaults to float64 for Res-MLP (TOAST's code) and
    float32 for MLP. Returns the module in eval mode, on the CPU, in
    ``dtype``. ``kind`` is a trained kind of :data:`toast.core.kinds.KINDS`.
    """
    check("kind", kind, Options(kind_names(fit="trained")))
    steps = check("steps", steps, Interval(int, 1, None))
    check("lr", lr, Interval(float, 0, None, closed="neither"))
    check("batch_size", batch_size, Interval(int, 1, None), None)
    if np.shape(x) != np.shape(y) or len(np.shape(x)) != 2:
        raise ValueError(
            f"x and y must be (rows, dim) of one shape, got {np.shape(x)} and {np.shape(y)}"
        )
    rows, dim = (int(v) for v in np.shape(x))
    if rows < 1:
        raise ValueError("x and y hold no rows")
    shape = kind_entry(kind).module
    dtype = dtype or (torch.float64 if shape == "resmlp" else torch.float32)
    gen = torch.Generator().manual_seed(seed)
    module = _untrained(kind, dim, dtype, dropout, seed)
    full = batch_size is None or batch_size >= rows
    if full:
        xs, ys = _rows_tensor(x, None, dtype), _rows_tensor(y, None, dtype)
    optimizer = torch.optim.Adam(module.parameters(), lr=lr)
    module.train()
    import sys

    from tqdm.auto import tqdm

    # A bar only on a terminal: redirected, its carriage-return frames would
    # fill the log (this layer sits below toast.hf's plain-line progress).
    shown = progress and sys.stderr.isatty()
    bar = tqdm(range(steps), desc=f"training {kind}", disable=not shown, leave=False)
    try:
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            torch.manual_seed(seed)  # dropout masks
            for _ in bar:
                if not full:
                    pick = torch.randperm(rows, generator=gen)[:batch_size].sort().values.numpy()
                    xs, ys = _rows_tensor(x, pick, dtype), _rows_tensor(y, pick, dtype)
                optimizer.zero_grad(set_to_none=True)
                loss = torch.nn.functional.mse_loss(module(xs), ys)
                if not torch.isfinite(loss):
                    raise FloatingPointError(
                        f"training the {kind} translator diverged (loss {loss.item()}); "
                        "lower lr or check the captured rows"
                    )
                loss.backward()
                optimizer.step()
                bar.set_postfix(loss=f"{loss.item():.3g}")
    finally:
        bar.close()
    return module.eval()


def _untrained(kind: str, dim: int, dtype: torch.dtype, dropout: float, seed: int) -> nn.Module:
    """The module of the shape the table stores ``kind`` as, initialised from
    ``seed``, named by its kind (its spec names it when saved)."""
    shape = kind_entry(kind).module
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if shape == "mlp":
            module: nn.Module = MLPTranslator(dim, dtype=dtype)
        elif shape == "resmlp":
            module = ResMLPTranslator(dim, dropout=dropout, dtype=dtype)
        else:
            raise ValueError(
                f"toast trains MLP and Res-MLP translators, not the {shape} of {kind!r}"
            )
    setattr(module, FITTED_KIND, kind)
    return module


def _rows_tensor(a: Any, pick: np.ndarray | None, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        t = a if pick is None else a[torch.from_numpy(pick)]
        return t.detach().to("cpu", dtype)
    arr = np.asarray(a if pick is None else a[pick])
    return torch.from_numpy(np.ascontiguousarray(arr)).to(dtype)
