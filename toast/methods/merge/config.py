"""The options of ``toast.compress(..., method="tome")`` (imports no torch)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from toast._validation import Interval, Options, Predicate, validate_fields
from toast.hf.data.calibration import Calibration
from toast.methods.merge.macs import SCHEDULES

__all__ = ["TomeConfig"]

_PER_BLOCK = Predicate(
    lambda v: (
        isinstance(v, Sequence)
        and not isinstance(v, str)
        and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in v)
    ),
    "a list with one merge count (int >= 0) per block",
)


@dataclass(frozen=True)
class TomeConfig:
    """How token merging runs (ToMe, Bolya et al., ICLR 2023; see
    :func:`toast.methods.merge.enable_merging`).

    ``r``: tokens merged per block, an int spread over the blocks by
    ``schedule`` (``"constant"``: the same ``r`` in every block, the paper's;
    ``"decreasing"``: ``2r`` in the first block down to 0 in the last) or a
    list with one count per block. ``proportional_attention``: weigh the
    attention to a merged key by its size (the paper's). ``unmerge_output``:
    expand the final tokens back to every input token, so outputs keep their
    shapes. ``image_size``: the input size the report's MACs are counted at
    when no data is given (default the model config's; DINOv2 checkpoints
    say 518 and usually run at 224). Merging uses no data; ``calibration``
    is there as in every method's config.
    """

    r: int | Sequence[int] = 8
    schedule: str = "constant"
    proportional_attention: bool = True
    unmerge_output: bool = True
    image_size: int | None = None
    calibration: Calibration = field(default_factory=Calibration)

    #: What each option means on the command line (``toast compress --method tome``).
    HELP: ClassVar[dict[str, str]] = {
        "r": "tokens merged in every block (the same r everywhere, the paper's schedule)",
        "schedule": "how r spreads over the blocks: constant, or decreasing from 2r to 0",
        "proportional_attention": "weigh the attention to a merged token by its size",
        "unmerge_output": "expand the final tokens back to every input token (outputs keep "
        "their shapes)",
        "image_size": "input size the MAC report counts when --data is not given (default the "
        "config's; DINOv2 checkpoints say 518 and run at 224)",
    }

    _parameter_constraints: ClassVar[dict[str, list[Any]]] = {
        "r": [Interval(int, 0, None), _PER_BLOCK],
        "schedule": [Options(SCHEDULES)],
        "proportional_attention": [bool],
        "unmerge_output": [bool],
        "image_size": [Interval(int, 1, None), None],
        "calibration": [Calibration],
    }

    def __post_init__(self) -> None:
        validate_fields(self, self._parameter_constraints)
        if not isinstance(self.r, int):
            object.__setattr__(self, "r", tuple(self.r))
