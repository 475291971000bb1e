"""The options of ``toast.compress(..., method="remove")``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from toast._validation import Interval, Options, Predicate, validate_fields
from toast.hf.data.calibration import BACKEND_HELP, BACKENDS, Calibration
from toast.methods.help import NUM_BLOCKS_HELP

__all__ = ["RemoveConfig", "SELECTIONS"]

#: How plain removal chooses its blocks (see :class:`RemoveConfig`).
SELECTIONS = ("error", "block_influence", "sleb")


@dataclass(frozen=True)
class RemoveConfig:
    """Which blocks plain removal deletes: ``num_blocks`` chosen by the
    identity-span error (``‖Y − X‖ / ‖Y‖`` between a span's first and last
    state, from one pass over the calibration data; block 0 is kept, as
    the papers keep it), or explicit ``spans`` (no data needed).
    ``backend`` is the pass's (see :func:`toast.hf.capture_moments`),
    ``calibration`` bounds it.

    ``selection`` is how ``num_blocks`` blocks are chosen from the data:
    ``"error"`` (default, unchanged): the best plan by identity-span error;
    ``"block_influence"``: ShortGPT (arXiv 2403.03853), the blocks of
    lowest ``BI_i = 1 − mean cos(x_i, x_{i+1})`` over non-pad tokens;
    ``"sleb"``: SLEB (arXiv 2402.09025), ``num_blocks`` greedy steps each
    removing the block whose removal gives the lowest calibration
    perplexity of the model pruned so far (one forward of the data per
    remaining block per step). Both choose blocks anywhere from block 1
    on; each run of consecutive ones is one span. The scoring is
    :mod:`toast.methods.selection`'s (shared with ReplaceMe)."""

    num_blocks: int | None = None
    spans: Sequence[tuple[int, int]] | None = None
    backend: str = "auto"
    selection: Literal["error", "block_influence", "sleb"] = "error"
    calibration: Calibration = field(default_factory=Calibration)

    #: What each option means on the command line (``toast compress --method remove``).
    HELP: ClassVar[dict[str, str]] = {
        "num_blocks": NUM_BLOCKS_HELP,
        "backend": BACKEND_HELP,
        "selection": "how the blocks to remove are chosen (error: the identity-span error; "
        "block_influence: ShortGPT's; sleb: SLEB's greedy measured removal)",
    }

    _parameter_constraints: ClassVar[dict[str, list[Any]]] = {
        "num_blocks": [Interval(int, 1, None), None],
        "spans": [Predicate(lambda v: isinstance(v, Sequence), "a list of (start, stop)"), None],
        "backend": [Options(BACKENDS)],
        "selection": [Options(SELECTIONS)],
        "calibration": [Calibration],
    }

    def __post_init__(self) -> None:
        validate_fields(self, self._parameter_constraints)
        if (self.num_blocks is None) == (self.spans is None):
            raise ValueError(
                "give num_blocks=<blocks to remove> or spans=[(start, stop), ...] (one of them)"
            )
