"""ReplaceMe's cosine objective: a transform trained on rows, not moments.

Shopkhoev et al., "ReplaceMe" (arXiv 2505.02819), §3.2: Eq. 7 (exact)
``min_T Σ_k 1 − cos(M_k T + Y_k, L_k)`` and Eq. 8 (approximate, the
default) ``min_T Σ_k 1 − cos(M_k T, L_k − Y_k)``, with the optional
regularisers of Eq. 15; Table 13 gives the Adam settings and Table 7 the
L-BFGS alternative. Rows are read one batch at a time, so memory-mapped
buffers of any size work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from toast._validation import Interval, Options, validate_params
from toast.hf.data.progress import progress_bar

__all__ = ["CosineFit", "fit_cosine"]


@dataclass
class CosineFit:
    """Result of :func:`fit_cosine`: the transform and the objective (mean
    ``1 − cos`` plus the penalty) before training and after each epoch (or
    after L-BFGS)."""

    transform: np.ndarray = field(repr=False)
    history: list[float]

    @property
    def initial(self) -> float:
        return self.history[0]

    @property
    def final(self) -> float:
        return self.history[-1]


class _CosineLoss:
    """``mean_k [1 − cos(a_k T + c_k, b_k)] + α R(T)`` over batches of rows,
    with T (or its diagonal) as the one trainable tensor."""

    def __init__(
        self,
        inputs: np.ndarray,
        targets: np.ndarray,
        offsets: np.ndarray | None,
        start: np.ndarray,
        diagonal: bool,
        penalty: str | None,
        penalty_weight: float,
        device: torch.device,
    ) -> None:
        self.inputs, self.targets, self.offsets = inputs, targets, offsets
        self.rows = int(inputs.shape[0])
        self.diagonal = diagonal
        self.penalty, self.penalty_weight = penalty, penalty_weight
        self.device = device
        value = np.diagonal(start).copy() if diagonal else start
        self.param = torch.tensor(value, dtype=torch.float32, device=device)
        self.param.requires_grad_(True)

    def matrix(self) -> torch.Tensor:
        return torch.diag(self.param) if self.diagonal else self.param

    def _fetch(self, arr: np.ndarray, idx: np.ndarray | slice) -> torch.Tensor:
        return torch.from_numpy(np.asarray(arr[idx], dtype=np.float32)).to(self.device)

    def loss_sum(self, idx: np.ndarray | slice) -> torch.Tensor:
        """Sum of ``1 − cos`` over the rows ``idx``."""
        pred = self._fetch(self.inputs, idx) @ self.matrix()
        if self.offsets is not None:
            pred = pred + self._fetch(self.offsets, idx)
        target = self._fetch(self.targets, idx)
        cos = torch.nn.functional.cosine_similarity(pred, target, dim=1, eps=1e-8)
        return (1.0 - cos).sum()

    def penalty_term(self) -> torch.Tensor:
        """``α Σ|T|`` (l1) or ``α Σ T²`` (l2), zero without a penalty."""
        if self.penalty is None or self.penalty_weight == 0:
            return self.param.new_zeros(())
        t = self.matrix()
        return self.penalty_weight * (t.abs().sum() if self.penalty == "l1" else t.pow(2).sum())

    def value(self, batch_size: int) -> float:
        """The objective on every row, without gradients."""
        total = 0.0
        with torch.no_grad():
            for lo in range(0, self.rows, batch_size):
                total += float(self.loss_sum(slice(lo, lo + batch_size)))
            return total / self.rows + float(self.penalty_term())

    def transform(self) -> np.ndarray:
        return self.matrix().detach().to("cpu", torch.float64).numpy()


def _adam(
    loss: _CosineLoss,
    history: list[float],
    lr: float,
    batch_size: int,
    epochs: int,
    seed: int,
    progress: bool,
) -> None:
    """Table 13: Adam on shuffled, seeded batches; the objective after each epoch."""
    opt = torch.optim.Adam([loss.param], lr=lr)
    rng = np.random.default_rng(seed)
    bar = progress_bar("replaceme: cosine (Adam)", epochs, "epoch", not progress)
    try:
        for _ in range(epochs):
            order = rng.permutation(loss.rows)
            for lo in range(0, loss.rows, batch_size):
                idx = np.sort(order[lo : lo + batch_size])
                opt.zero_grad(set_to_none=True)
                step = loss.loss_sum(idx) / len(idx) + loss.penalty_term()
                step.backward()
                opt.step()
            history.append(loss.value(batch_size))
            bar.set_postfix(objective=f"{history[-1]:.5g}")
            bar.update(1)
    finally:
        bar.close()


def _lbfgs(
    loss: _CosineLoss, history: list[float], batch_size: int, steps: int, tol: float
) -> None:
    """Table 7: full-batch L-BFGS with a strong Wolfe line search, the
    gradient summed over batches of rows, until the largest entry of the
    gradient, the change of the objective or the largest entry of the step
    is below ``tol`` (or ``steps`` iterations)."""
    opt = torch.optim.LBFGS(
        [loss.param],
        lr=1.0,
        max_iter=steps,
        history_size=20,
        tolerance_grad=tol,
        tolerance_change=tol,
        line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        total = loss.param.new_zeros(())
        for lo in range(0, loss.rows, batch_size):
            part = loss.loss_sum(slice(lo, lo + batch_size)) / loss.rows
            part.backward()
            total = total + part.detach()
        r = loss.penalty_term()
        if r.requires_grad:
            r.backward()
        return total + r.detach()

    opt.step(closure)
    history.append(loss.value(batch_size))


@validate_params(
    {
        "structure": [Options(("full", "diagonal"))],
        "solver": [Options(("adam", "lbfgs"))],
        "lr": [Interval(float, 0, math.inf, closed="neither")],
        "batch_size": [Interval(int, 1, None)],
        "epochs": [Interval(int, 0, None)],
        "lbfgs_steps": [Interval(int, 1, None)],
        "tol": [Interval(float, 0, math.inf, closed="left")],
        "penalty": [Options(("l1", "l2")), None],
        "penalty_weight": [Interval(float, 0, math.inf, closed="left")],
    }
)
def fit_cosine(
    inputs: np.ndarray,
    targets: np.ndarray,
    offsets: np.ndarray | None = None,
    *,
    init: np.ndarray | None = None,
    structure: Literal["full", "diagonal"] = "full",
    solver: Literal["adam", "lbfgs"] = "adam",
    lr: float = 1e-4,
    batch_size: int = 1024,
    epochs: int = 10,
    lbfgs_steps: int = 100,
    tol: float = 1e-7,
    penalty: Literal["l1", "l2"] | None = None,
    penalty_weight: float = 0.0,
    seed: int = 0,
    device: torch.device | str = "cpu",
    progress: bool = True,
) -> CosineFit:
    """Minimises ``mean_k [1 − cos(a_k T + c_k, b_k)] + α R(T)`` over T.

    ``inputs`` (rows ``a_k``), ``targets`` (``b_k``) and optional
    ``offsets`` (``c_k``) are ``(rows, d)`` arrays (memory-mapped files
    work: rows are read one batch at a time). ReplaceMe's approximate loss
    (Eq. 8/15, the default) is ``a = M``, ``b = L − Y``; the exact one
    (Eq. 7/14) is ``a = M``, ``c = Y``, ``b = L``. T starts at ``init``
    (default the identity, Table 13) and is trained in float32 on
    ``device``: ``solver="adam"`` (Table 13: lr 1e-4, shuffled batches of
    1024 rows, 10 epochs, seeded) or ``"lbfgs"`` (Table 7: full-batch,
    strong Wolfe line search, until the largest gradient entry, the change
    of the objective (a mean over rows) or the largest step entry is below
    ``tol``, at most ``lbfgs_steps`` iterations; the gradient is summed over
    batches). ``penalty`` adds ``α Σ|T|``
    (``"l1"``) or ``α Σ T²`` (``"l2"``) with ``α = penalty_weight``, on T
    itself (the paper does not say sum or mean, T or T − I).
    ``structure="diagonal"`` trains only the diagonal of T.
    """
    n, d = inputs.shape
    if targets.shape != (n, d) or (offsets is not None and offsets.shape != (n, d)):
        raise ValueError("inputs, targets and offsets must all have shape (rows, d)")
    if n == 0:
        raise ValueError("no rows to fit the cosine objective on")
    start = np.eye(d) if init is None else np.asarray(init, dtype=np.float64)
    if start.shape != (d, d):
        raise ValueError(f"init must have shape ({d}, {d}), got {start.shape}")
    loss = _CosineLoss(
        inputs,
        targets,
        offsets,
        start,
        structure == "diagonal",
        penalty,
        float(penalty_weight),
        torch.device(device),
    )
    history = [loss.value(batch_size)]
    if solver == "adam":
        _adam(loss, history, float(lr), int(batch_size), int(epochs), seed, progress)
    else:
        _lbfgs(loss, history, int(batch_size), int(lbfgs_steps), float(tol))
    return CosineFit(loss.transform(), history)
