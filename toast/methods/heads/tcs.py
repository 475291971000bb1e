"""Token Channel Selection (TCS): ToaSt's training-free FFN pruning at inference.

In every block with nonzero ratios, the MLP's input ``Z = LN(X')`` (``D``
channels) and its hidden activation ``H = act(fc1(Z))`` (``F`` channels)
are each cut to their most important channels before the next matmul:

1. a sample ``S`` of patch tokens (``max(1, floor(P · sample_ratio))`` of the
   ``P`` patch tokens, without replacement by default) is drawn;
2. channel scores over ``S``:

   - Eq. 6 (models with a CLS token): ``I_c = λ_cls·|x_cls,c| + λ_patch ·
     mean_{i∈S} A_cls,i·|x_i,c|`` with ``A_cls`` the CLS row of the block's
     attention map averaged over heads. ``weights="paper"`` uses λ as given
     (default λ_cls = 2, λ_patch = 1); ``"normalized"`` is the reference
     code's ``λ_cls/(1+P)`` and ``λ_patch·P/(1+P)``;
   - Eq. 7 (Swin, or ``score="eq7"``): ``I_c = mean_{i∈S} |x_i,c|``;

3. FC1 keeps the top ``floor(D (1 − r_FC1))`` channels of ``Z`` (the
   contraction of ``fc1`` shrinks; all ``F`` outputs stay), FC2 the top
   ``floor(F (1 − r_FC2))`` channels of ``H``; the residual is untouched.

**Scope.** ``scope="image"`` (default): every image scores and selects its
own channels, so an image's output never depends on the other images in its
batch. ``scope="batch"``: scores are averaged over the batch (with the
batch-mean attention row) and one channel set serves every image — the
reference code's behaviour, whose results change with batch composition.

**Sample.** ``resample="fixed"`` (default): each block draws its token
positions once per sequence length from a generator seeded by ``seed`` and
the block index, so results are reproducible and independent of call
order. ``resample="call"``: a fresh draw every forward pass from one
generator seeded by ``seed`` (call :meth:`TcsHandle.reseed` to replay).
FC2 scores on the same sample as FC1 (the paper) unless
``fc2_sample="fresh"`` (the reference code). ``replace=True`` samples with
replacement (the reference code).

**Forms.** ``form="dense"`` (default) gathers the kept channels and the
matching weight rows / columns and runs smaller (batched) matmuls;
``form="masked"`` zeroes the dropped channels and runs the full matmuls
(same function up to rounding). In blocks with an FC2 ratio the dense form
by default (``hidden="kept"``) evaluates ``fc1`` on the scored tokens first
(that is all FC2's scores need), selects, and then computes only the kept
hidden channels for every token: the same output as Algorithm 1 with FC1's
cost cut by ``r_FC2`` as well (fewer MACs than the paper counts).
``hidden="all"`` executes as the paper does: ``fc1`` computes every hidden
channel for every token, then FC2 drops most of them.

**Backend.** The CLS attention row, the channel scores and the top-k run in
the C core (``toast._core.tcs_cls_attention`` / ``tcs_select``: one call on
the calling thread instead of a dozen small tensor operations) for float32
CPU activations (``backend="auto"``, the default, or ``"c"``), and in torch
otherwise (``backend="torch"``, GPUs, other dtypes). Scores are accumulated
in float64 in C and in the activations' dtype in torch, so near-ties can
rank differently; equal scores keep the lower channel in C.

**CLS attention row.** Blocks that score by Eq. 6 capture the outputs of
their ``q_proj`` (CLS row only) and ``k_proj`` with forward hooks and form
``softmax(q_cls Kᵀ · scaling)`` themselves: ``O(N · D')`` per image, so the
attention keeps its fused kernel, and blocks without TCS get no hook.

This module checks the options and installs TCS in a model's blocks
(:func:`enable_tcs`, :func:`disable_tcs`, :func:`tcs_ratios`); the MLP that
does the work, its options and the handle are
:mod:`toast.methods.heads.tcs_mlp` (importable from here too).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from toast._validation import Interval, Options, check
from toast.hf.model.vit import VitBlock, VitModel, vit_blocks
from toast.io.guard import guard_save
from toast.methods.heads.choices import TCS_CHOICES
from toast.methods.heads.schedules import SAMPLE_RATIO, Schedule, get_schedule
from toast.methods.heads.tcs_mlp import HANDLE_ATTR, TcsHandle, TcsMLP, TcsOptions, mlp_parts

__all__ = [
    "TCS_CHOICES",
    "TcsHandle",
    "TcsMLP",
    "TcsOptions",
    "disable_tcs",
    "enable_tcs",
    "tcs_ratios",
]


def _block_timer(
    handle: TcsHandle,
) -> tuple[Callable[[nn.Module, Any], None], Callable[[nn.Module, Any, Any], None]]:
    """Forward pre- and post-hooks adding a block's wall time to
    ``handle.timings["block"]`` while ``handle.profile`` is set."""
    starts: list[float] = []

    def pre(module: nn.Module, args: Any) -> None:
        if handle.profile:
            starts.append(time.perf_counter())

    def post(module: nn.Module, args: Any, out: Any) -> None:
        if handle.profile and starts:
            handle.timings["block"] = handle.timings.get("block", 0.0) + (
                time.perf_counter() - starts.pop()
            )

    return pre, post


def enable_tcs(
    model: nn.Module,
    schedule: Any,
    scope: str = "image",
    seed: int = 0,
    *,
    score: str = "auto",
    weights: str = "paper",
    lambda_cls: float = 2.0,
    lambda_patch: float = 1.0,
    form: str = "dense",
    sample_ratio: float | None = None,
    replace: bool = False,
    resample: str = "fixed",
    fc2_sample: str = "same",
    hidden: str = "kept",
    backend: str = "auto",
    blocks: VitModel | None = None,
) -> TcsHandle:
    """Installs Token Channel Selection in ``model``'s MLPs, in place.

    ``schedule``: a named schedule (``"deit_small@2.5"``, ``"table11"``), a
    :class:`~toast.methods.heads.schedules.Schedule`, or ``{"fc1": ...,
    "fc2": ...}`` (see :func:`toast.methods.heads.schedules.get_schedule`;
    0-based global blocks). ``score="auto"`` is Eq. 6 for models with a CLS
    token and Eq. 7 for Swin. ``sample_ratio`` defaults to the schedule's.
    The other options (``weights``, ``form``, ``replace``, ``resample``,
    ``fc2_sample``, ``hidden``, ``backend``) are described in the module
    docstring. Blocks whose two ratios are 0 are left untouched, so an
    all-zero schedule is an exact no-op. Returns a :class:`TcsHandle`
    (``handle.disable()`` or :func:`disable_tcs` undoes it). ``blocks``:
    ``model``'s blocks when found already (:func:`vit_blocks`).
    """
    vm = vit_blocks(model) if blocks is None else blocks
    if getattr(model, HANDLE_ATTR, None) is not None:
        raise ValueError(
            "TCS is already enabled on this model; call "
            "toast.methods.heads.tcs.disable_tcs(model) first"
        )
    choices = {
        "score": score,
        "weights": weights,
        "scope": scope,
        "form": form,
        "resample": resample,
        "fc2_sample": fc2_sample,
        "hidden": hidden,
        "backend": backend,
    }
    for key, value in choices.items():
        check(key, value, Options(TCS_CHOICES[key]))
    sched = get_schedule(schedule, vm.num_blocks)
    ratio = sched.sample_ratio if sample_ratio is None else sample_ratio
    options = TcsOptions(
        score=_score(vm, score),
        weights=weights,
        lambda_cls=float(check("lambda_cls", lambda_cls, Interval(float, 0, None))),
        lambda_patch=float(check("lambda_patch", lambda_patch, Interval(float, 0, None))),
        scope=scope,
        form=form,
        sample_ratio=float(check("sample_ratio", ratio, SAMPLE_RATIO)),
        replace=bool(replace),
        resample=resample,
        fc2_sample=fc2_sample,
        hidden=hidden,
        seed=int(seed),
        backend=backend,
    )
    handle = TcsHandle(model, sched, options, vm.prefix)
    handle.reset_timings()
    for blk in _tcs_blocks(vm, sched):
        _install(handle, blk)
    setattr(model, HANDLE_ATTR, handle)
    guard_save(model)  # model.save_pretrained now records the TCS state
    return handle


def _score(vm: VitModel, score: str) -> str:
    """The scoring equation ``score`` names for this model (``"auto"``:
    Eq. 6 with a CLS token, Eq. 7 without)."""
    if score == "auto":
        return "eq6" if vm.has_cls else "eq7"
    if score == "eq6" and not vm.has_cls:
        raise ValueError(f"score='eq6' needs a CLS token; {vm.model_type} has none (use eq7)")
    return score


def _tcs_blocks(vm: VitModel, sched: Schedule) -> list[VitBlock]:
    """The blocks with a nonzero ratio, every MLP checked before any changes."""
    chosen = [b for b in vm.blocks if sched.fc1[b.index] > 0 or sched.fc2[b.index] > 0]
    for blk in chosen:
        mlp_parts(blk)
    return chosen


def _install(handle: TcsHandle, blk: VitBlock) -> None:
    """Swaps ``blk``'s MLP for a :class:`TcsMLP` and hooks what it needs."""
    r1, r2 = handle.schedule.fc1[blk.index], handle.schedule.fc2[blk.index]
    tcs = TcsMLP(blk, r1, r2, handle, handle.options.score == "eq6")
    handle.originals[blk.index] = (blk.block, blk.mlp)
    handle.modules[blk.index] = tcs
    blk.block.mlp = tcs
    if tcs.eq6:
        handle.hooks.append(blk.attention.q_proj.register_forward_hook(tcs.capture_q))
        handle.hooks.append(blk.attention.k_proj.register_forward_hook(tcs.capture_k))
    pre, post = _block_timer(handle)
    handle.hooks.append(blk.block.register_forward_pre_hook(pre))
    handle.hooks.append(blk.block.register_forward_hook(post))


def disable_tcs(model: nn.Module) -> bool:
    """Removes TCS from ``model`` (the original MLPs come back); returns
    whether it was enabled."""
    handle = getattr(model, HANDLE_ATTR, None)
    if not isinstance(handle, TcsHandle):
        return False
    handle.disable()
    return True


def tcs_ratios(model: nn.Module) -> Mapping[int, tuple[float, float]]:
    """The ``(fc1, fc2)`` ratios of the TCS blocks of ``model`` ({} without TCS)."""
    handle = getattr(model, HANDLE_ATTR, None)
    if not isinstance(handle, TcsHandle):
        return {}
    return {b: (m.r1, m.r2) for b, m in handle.modules.items()}
