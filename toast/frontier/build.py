"""A candidate made real: the calibrated pieces applied to a copy of the
model, with no pass over the data (translators and ReplaceMe transforms
come from the calibration, head pruning from the weights)."""

from __future__ import annotations

import copy
import math
import warnings

from torch import nn

from toast.hf.blocks import find_blocks
from toast.hf.surgery import remove_blocks, replace_spans
from toast.io.guard import guard_save
from toast.methods.replaceme.fold import apply_cuts
from toast.methods.toast.config import ToastConfig
from toast.methods.toast.fitting import Fitter
from toast.methods.toast_vit.blocks import vit_blocks
from toast.methods.toast_vit.macs import toast_macs
from toast.methods.toast_vit.scwp import prune_heads
from toast.methods.toast_vit.tcs import enable_tcs
from toast.spans import Span

from .calibrate import Calibrated
from .candidates import Candidate, tcs_schedule

__all__ = ["build", "enable_schedule", "tcs_mac_saving"]


def build(
    model: nn.Module, candidate: Candidate, calibrated: Calibrated, tcs: bool = True
) -> nn.Module:
    """``candidate`` applied to a deep copy of ``model`` (which is left as
    it is); the copy's ``save_pretrained`` writes a complete save. Without
    ``tcs`` its Token Channel Selection is left for :func:`enable_schedule`."""
    built = copy.deepcopy(model)
    if candidate.spans:
        _remove(built, candidate, calibrated)
    if candidate.head_sparsity is not None:
        prune_heads(built, candidate.head_sparsity)
    if tcs:
        enable_schedule(built, candidate)
    return guard_save(built)


def enable_schedule(model: nn.Module, candidate: Candidate) -> None:
    """The candidate's Token Channel Selection, installed in ``model``."""
    if candidate.schedule is not None:
        blocks = vit_blocks(model).num_blocks
        enable_tcs(model, tcs_schedule(candidate.schedule, blocks), seed=0)
        guard_save(model)


def tcs_mac_saving(model: nn.Module, candidate: Candidate) -> int:
    """MACs per image the candidate's TCS saves in the FFNs, in ToaSt's
    count (the paper's; the dense form computes fewer still)."""
    if candidate.schedule is None:
        return 0
    config = model.config
    rho = candidate.head_sparsity or 0.0
    schedule = tcs_schedule(candidate.schedule, vit_blocks(model).num_blocks)
    full = toast_macs(config, head_sparsity=rho, schedule=None).ffn
    return int(round(full - toast_macs(config, head_sparsity=rho, schedule=schedule).ffn))


def _remove(model: nn.Module, candidate: Candidate, calibrated: Calibrated) -> None:
    analysis = calibrated.analysis
    stack = find_blocks(model, analysis.block_path)
    spans = [Span(a, b, math.nan) for a, b in candidate.spans]
    if candidate.translator == "ls":
        missing = [s for s in candidate.spans if s not in calibrated.transforms]
        if missing:
            raise KeyError(f"no ReplaceMe transform was estimated for cut(s) {missing}")
        transforms = [calibrated.transforms[s] for s in candidate.spans]
        apply_cuts(model, stack, spans, transforms, "fold", "full")
        return
    translator = candidate.translator or "identity"
    if translator == "identity":
        remove_blocks(model, list(candidate.spans), blocks=stack)
        return
    config = ToastConfig(spans=list(candidate.spans), translator=translator)
    with warnings.catch_warnings():
        # the search measures every candidate; a poorly conditioned fit just measures badly
        warnings.simplefilter("ignore")
        modules = Fitter(config).fit_all(model, [], spans, analysis, stack)
    replace_spans(model, list(candidate.spans), modules, blocks=stack)
