"""The options of ``toast.compress(..., method="linearpatch")``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from toast._validation import Interval, Predicate, validate_fields
from toast.hf.data.calibration import Calibration
from toast.methods.help import NUM_BLOCKS_HELP

__all__ = ["LinearPatchConfig"]


@dataclass(frozen=True)
class LinearPatchConfig:
    """LinearPatch as published (arXiv 2505.24680, and its code's defaults).

    **Selection**: the window of ``num_blocks`` blocks whose input and
    output states are most alike: the cosine similarity of the two states
    per token (over the hidden dimension), averaged over every non-pad
    token of the calibration data; windows start at block 1 and end before
    the last block (the code's range: the state after the last block is
    never a candidate). Or explicit ``spans=[(start, stop), ...]``.

    **Patch**: the removed window is replaced by ``P = H diag(d) Hᵀ`` on
    the residual stream, ``H`` the orthonormal Hadamard rotation of the
    model's width (:func:`toast.core.hadamard.hadamard`; a Hadamard-type
    orthogonal transform where no Hadamard matrix of that width is built
    here) and ``d`` the ratio of the mean magnitudes of the rotated states
    after and before the window, per calibration sample, averaged over
    samples. ``rotate=False`` is the paper's ablation without the rotation
    (``P = diag(d)`` of the raw channels). The paper calibrates on 128
    samples of 2,048 tokens; ``calibration`` bounds the pass here.

    The patch is a ``d × d`` linear block in place of the window (``d²``
    parameters); the model saves in toast's format and reloads with
    :func:`toast.load_pretrained`.
    """

    num_blocks: int | None = None
    spans: Sequence[tuple[int, int]] | None = None
    rotate: bool = True
    calibration: Calibration = field(default_factory=Calibration)

    #: What each option means on the command line (``toast compress --method linearpatch``).
    HELP: ClassVar[dict[str, str]] = {
        "num_blocks": NUM_BLOCKS_HELP,
        "rotate": "scale the raw channels, without the Hadamard rotation (the paper's ablation)",
    }

    _parameter_constraints: ClassVar[dict[str, list[Any]]] = {
        "num_blocks": [Interval(int, 1, None), None],
        "spans": [Predicate(lambda v: isinstance(v, Sequence), "a list of (start, stop)"), None],
        "rotate": [bool],
        "calibration": [Calibration],
    }

    def __post_init__(self) -> None:
        validate_fields(self, self._parameter_constraints)
        if (self.num_blocks is None) == (self.spans is None):
            raise ValueError(
                "give num_blocks=<blocks to remove> or spans=[(start, stop), ...] (one of them)"
            )
