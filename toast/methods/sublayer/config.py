"""The options of ``toast.compress(..., method="sublayer")``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from toast._validation import Interval, Options, validate_fields
from toast.hf.data.calibration import Calibration

__all__ = ["KIND_CHOICES", "SELECTIONS", "SublayerConfig"]

#: Which sub-layers may go: attention only, MLP only, or either.
KIND_CHOICES = ("attention", "mlp", "any")
#: How they are chosen: by score (one pass) or by measured loss (greedy).
SELECTIONS = ("score", "measured")


@dataclass(frozen=True)
class SublayerConfig:
    """Which sub-layers (a block's attention or its MLP, each with its
    pre-norm) sub-layer pruning removes, keeping the residual stream.

    ``num_sublayers``: how many to remove (required; at most the number of
    sub-layers of ``kind`` in the model). ``kind``: ``"attention"``,
    ``"mlp"`` or ``"any"`` (either kind, whichever scores lower).
    ``selection``: ``"score"`` removes the ``num_sublayers`` lowest-scored
    sub-layers, each scored in one calibration pass by how little it changes
    the residual stream, ``1 − cos(h, h + f(h))`` averaged over tokens (the
    sub-layer analogue of ShortGPT's Block Influence, Men et al. 2024,
    arXiv 2403.03853; FinerCut, Zhang et al. 2024, arXiv 2405.18218, prunes
    at this granularity); ``"measured"`` removes them one at a time, each
    step the remaining sub-layer whose removal keeps the calibration quality
    best (perplexity for causal LMs, else output cosine to the original:
    BlockPruner's greedy search, Zhong et al. 2024, arXiv 2406.10594), at
    one pass per candidate per step, so bound it with ``max_batches`` /
    ``max_samples``. ``calibration`` bounds either pass (and names the block
    list with ``blocks=`` when discovery is ambiguous).
    """

    num_sublayers: int | None = None
    kind: str = "any"
    selection: str = "score"
    calibration: Calibration = field(default_factory=Calibration)

    #: What each option means on the command line (``toast compress --method sublayer``).
    HELP: ClassVar[dict[str, str]] = {
        "num_sublayers": "attention or MLP sub-layers to remove",
        "kind": "which sub-layers may go (any: either kind, whichever scores lower)",
        "selection": "how they are chosen (score: the lowest-scored in one pass; measured: one "
        "at a time, each keeping the calibration quality best)",
    }

    _parameter_constraints: ClassVar[dict[str, list[Any]]] = {
        "num_sublayers": [Interval(int, 1, None), None],
        "kind": [Options(KIND_CHOICES)],
        "selection": [Options(SELECTIONS)],
        "calibration": [Calibration],
    }

    def __post_init__(self) -> None:
        validate_fields(self, self._parameter_constraints)
        if self.num_sublayers is None:
            raise ValueError("give num_sublayers=<how many attention or MLP sub-layers to remove>")
