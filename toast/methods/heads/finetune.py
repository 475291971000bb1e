"""Optional recovery fine-tuning after head pruning (ToaSt: "The compressed
weights are fine-tuned using AdamW with a cosine learning rate scheduler";
Table 10 gives the cost; the reference code's defaults: lr 1e-3 → 1e-5,
weight decay 1e-4, no warm-up).

ToaSt itself needs no data; this loop is for users who have some. Masks of
``form="masked"`` pruning are re-applied after every optimiser step, so
pruned weights stay zero (the reference code only re-projects before each
evaluation; the paper says nothing). A dense-pruned model needs no masks:
the pruned dimensions do not exist.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from toast._validation import Interval, check
from toast.methods.heads.scwp import apply_masks

__all__ = ["cosine_lr", "finetune"]


def cosine_lr(step: int, steps: int, lr: float, min_lr: float, warmup: int = 0) -> float:
    """Learning rate at ``step`` (0-based) of ``steps``: linear warm-up over
    ``warmup`` steps, then cosine from ``lr`` to ``min_lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, steps - warmup)
    t = min(1.0, (step - warmup) / span)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * t))


def _batches(loader: Iterable, steps: int) -> Iterator[Any]:
    """``steps`` batches, iterating ``loader`` again as often as needed."""
    done = 0
    while done < steps:
        empty = True
        for batch in loader:
            empty = False
            yield batch
            done += 1
            if done == steps:
                return
        if empty:
            raise ValueError("the loader yielded no batch")


def _default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    if isinstance(batch, dict):
        out = model(**batch)
        loss = getattr(out, "loss", None)
        if loss is None:
            raise ValueError(
                "the model returned no loss for a dict batch; include 'labels' or pass loss_fn"
            )
        return loss
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        pixels, labels = batch
        logits = model(pixel_values=pixels).logits
        return nn.functional.cross_entropy(logits, labels)
    raise ValueError(
        "batches must be dicts with 'labels' or (pixel_values, labels) pairs; otherwise pass "
        "loss_fn(model, batch)"
    )


def finetune(
    model: nn.Module,
    loader: Iterable[Any],
    *,
    steps: int,
    lr: float = 1e-3,
    min_lr: float = 1e-5,
    weight_decay: float = 1e-4,
    warmup: int = 0,
    max_grad_norm: float | None = None,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    seed: int | None = None,
) -> list[float]:
    """Fine-tunes ``model`` for ``steps`` optimiser steps with AdamW and a
    cosine schedule (the loader is iterated again as needed), re-applying SCWP
    masks after every step. Returns the loss of every step. The model is
    left in eval mode. ``seed`` seeds torch's generators for the run
    (dropout, stochastic depth) and restores them afterwards."""
    check("steps", steps, Interval(int, 1, None))
    check("lr", lr, Interval(float, 0, None, closed="neither"))
    check("min_lr", min_lr, Interval(float, 0, lr))
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    cuda = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda, enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
        schedule = [cosine_lr(step, steps, lr, min_lr, warmup) for step in range(steps)]
        batches = _batches(loader, steps)
        return _train(model, opt, batches, schedule, loss_fn or _default_loss, max_grad_norm)


def _train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batches: Iterator[Any],
    schedule: list[float],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    max_grad_norm: float | None,
) -> list[float]:
    """The optimiser loop: one step per learning rate of ``schedule``."""
    params = [p for group in opt.param_groups for p in group["params"]]
    losses: list[float] = []
    model.train()
    try:
        for step, (batch, lr) in enumerate(zip(batches, schedule, strict=False)):
            for group in opt.param_groups:
                group["lr"] = lr
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model, batch)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"the loss is {loss.item()} at step {step}")
            loss.backward()
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            opt.step()
            apply_masks(model)
            losses.append(float(loss.detach()))
    finally:
        model.eval()
    return losses
