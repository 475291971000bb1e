"""The options of the token reducers' methods (``toast.compress(..., method=
"tome" | "rapid" | "token-transforming" | "atm" | "pitome")``; imports no torch)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from toast._validation import Interval, Options, Predicate, validate_fields
from toast.hf.data.calibration import Calibration
from toast.methods.merge.macs import SCHEDULE_HELP, SCHEDULES

__all__ = [
    "MERGE_NORMS",
    "AtmConfig",
    "PitomeConfig",
    "RapidConfig",
    "TomeConfig",
    "TransformingConfig",
]

#: How a merged token's norm is set (:func:`toast.methods.merge.matching.merge_tokens`):
#: ``"average"``, the size-weighted mean as it comes (ToMe's); ``"max"``,
#: the mean's direction at the largest norm among the merged tokens (MLERP,
#: Token Fusion); ``"mean"``, at their size-weighted mean norm (toast's).
MERGE_NORMS = ("average", "max", "mean")
_NORM_HELP = (
    "a merged token's norm: average (the size-weighted mean as it comes, the paper's), max "
    "(MLERP: the largest norm of the merged tokens), mean (their size-weighted mean norm)"
)

#: What the options every reducer shares mean on the command line.
_SHARED_HELP = {
    "proportional_attention": "weigh the attention to a merged token by its size",
    "unmerge_output": "expand the final tokens back to every input token (outputs keep "
    "their shapes)",
    "merge_norm": _NORM_HELP,
    "image_size": "input size the MAC report counts when --data is not given (default the "
    "config's; DINOv2 checkpoints say 518 and run at 224)",
}

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
    ``"decreasing"``: ``2r`` in the first block down to 0 in the last; the
    others of :data:`~toast.methods.merge.macs.SCHEDULES`) or a list with
    one count per block. ``proportional_attention``: weigh the
    attention to a merged key by its size (the paper's). ``merge_norm``: a
    merged token's norm (:data:`MERGE_NORMS`; ``"max"`` is Token Fusion's
    MLERP, Kim et al., WACV 2024). ``unmerge_output``:
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
    merge_norm: str = "average"
    image_size: int | None = None
    calibration: Calibration = field(default_factory=Calibration)

    #: What each option means on the command line (``toast compress --method tome``).
    HELP: ClassVar[dict[str, str]] = {
        "r": "tokens merged in every block (the same r everywhere, the paper's schedule)",
        "schedule": SCHEDULE_HELP,
        **_SHARED_HELP,
    }

    _parameter_constraints: ClassVar[dict[str, list[Any]]] = {
        "r": [Interval(int, 0, None), _PER_BLOCK],
        "schedule": [Options(SCHEDULES)],
        "proportional_attention": [bool],
        "unmerge_output": [bool],
        "merge_norm": [Options(MERGE_NORMS)],
        "image_size": [Interval(int, 1, None), None],
        "calibration": [Calibration],
    }

    def __post_init__(self) -> None:
        validate_fields(self, self._parameter_constraints)
        if not isinstance(self.r, int):
            object.__setattr__(self, "r", tuple(self.r))


_THRESHOLDS = Predicate(
    lambda v: (
        isinstance(v, Sequence)
        and not isinstance(v, str)
        and all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in v)
    ),
    "a list with one cosine threshold per block",
)

#: The options every reducer shares, and their constraints.
_SHARED_CONSTRAINTS: dict[str, list[Any]] = {
    "proportional_attention": [bool],
    "unmerge_output": [bool],
    "merge_norm": [Options(MERGE_NORMS)],
    "image_size": [Interval(int, 1, None), None],
    "calibration": [Calibration],
}


def _as_tuple(config: Any, name: str) -> None:
    value = getattr(config, name)
    if value is not None and not isinstance(value, (int, float)):
        object.__setattr__(config, name, tuple(value))


@dataclass(frozen=True)
class RapidConfig:
    """How RAPID runs (Choi & Jang, arXiv 2606.08156; see
    :mod:`toast.methods.merge.rapid` for what is the paper's and what is
    toast's reading).

    ``r``: tokens removed per block (an int spread by ``schedule`` as
    ToMe's, or one count per block). Blocks before ``prune_until`` prune
    by redundancy (a token whose keys have many near-copies, cosine above
    ``tau``, goes without being merged); the rest merge by similarity
    weighed by the class token's attention. ``prune_until`` None: the
    first half of the blocks prune. Other fields as :class:`TomeConfig`.
    """

    r: int | Sequence[int] = 8
    schedule: str = "constant"
    prune_until: int | None = None
    tau: float = 0.8
    proportional_attention: bool = True
    unmerge_output: bool = True
    merge_norm: str = "average"
    image_size: int | None = None
    calibration: Calibration = field(default_factory=Calibration)

    HELP: ClassVar[dict[str, str]] = {
        "r": "tokens removed in every block (pruned in the first blocks, merged after)",
        "schedule": SCHEDULE_HELP,
        "prune_until": "blocks before this index prune, the rest merge (default half)",
        "tau": "cosine above which a destination counts as a near-copy of a token",
        **_SHARED_HELP,
    }

    _parameter_constraints: ClassVar[dict[str, list[Any]]] = {
        "r": [Interval(int, 0, None), _PER_BLOCK],
        "schedule": [Options(SCHEDULES)],
        "prune_until": [Interval(int, 0, None), None],
        "tau": [Interval(float, -1.0, 1.0)],
        **_SHARED_CONSTRAINTS,
    }

    def __post_init__(self) -> None:
        validate_fields(self, self._parameter_constraints)
        _as_tuple(self, "r")


@dataclass(frozen=True)
class TransformingConfig:
    """How Token Transforming runs (arXiv 2506.05709; see
    :mod:`toast.methods.merge.transforming` for what is the paper's and
    what is toast's reading).

    ``r``: tokens removed per block (an int spread by ``schedule``, or one
    count per block); every removed token is shared among the kept ones
    (chosen by the class token's attention) by a softmax of key cosine
    over ``temperature``. ``merge_norm`` ``"max"`` is not defined for
    shared tokens. Other fields as :class:`TomeConfig`.
    """

    r: int | Sequence[int] = 8
    schedule: str = "constant"
    temperature: float = 0.1
    proportional_attention: bool = True
    unmerge_output: bool = True
    merge_norm: str = "average"
    image_size: int | None = None
    calibration: Calibration = field(default_factory=Calibration)

    HELP: ClassVar[dict[str, str]] = {
        "r": "tokens removed in every block (each shared among the kept tokens)",
        "schedule": SCHEDULE_HELP,
        "temperature": "softmax temperature of the sharing (small: each goes to one token)",
        **_SHARED_HELP,
        "merge_norm": "an output's norm: average (the size-weighted mean as it comes, the "
        "paper's), mean (the share-and-size-weighted mean norm of what it received)",
    }

    _parameter_constraints: ClassVar[dict[str, list[Any]]] = {
        "r": [Interval(int, 0, None), _PER_BLOCK],
        "schedule": [Options(SCHEDULES)],
        "temperature": [Interval(float, 0.0, None, closed="neither")],
        **_SHARED_CONSTRAINTS,
        # a shared token has no one output whose norm it could set
        "merge_norm": [Options(("average", "mean"))],
    }

    def __post_init__(self) -> None:
        validate_fields(self, self._parameter_constraints)
        _as_tuple(self, "r")


@dataclass(frozen=True)
class AtmConfig:
    """How ATM runs (adaptive token merging, Lee & Choi, arXiv 2505.15160;
    see :mod:`toast.methods.merge.atm`).

    A block merges every token whose best match's key cosine exceeds the
    block's threshold: ``θ_l = max(alpha − (exp(beta·(l − 1)) − 1),
    theta_min)`` for blocks ``l = 1..L`` (the paper's schedule), or
    ``thresholds`` given per block. From block ``split_from`` (0-based;
    None: the last third) tokens are matched small to large by size. In a
    batch every image merges the batch's smallest count. The paper's
    values of alpha, beta and theta_min could not be read; the defaults
    here are toast's, and on DINOv2 the schedule merges half of a block's
    tokens wherever its keys are nearly parallel (see
    ``benchmarks/README.md``).
    """

    alpha: float = 0.99
    beta: float = 0.01
    theta_min: float = 0.5
    thresholds: Sequence[float] | None = None
    split_from: int | None = None
    proportional_attention: bool = True
    unmerge_output: bool = True
    merge_norm: str = "average"
    image_size: int | None = None
    calibration: Calibration = field(default_factory=Calibration)

    HELP: ClassVar[dict[str, str]] = {
        "alpha": "the first block's cosine threshold",
        "beta": "how fast the threshold falls with depth (alpha - (exp(beta (l-1)) - 1))",
        "theta_min": "the lowest threshold",
        "split_from": "first block (0-based) that matches small tokens to large (default: the "
        "last third)",
        **_SHARED_HELP,
    }

    _parameter_constraints: ClassVar[dict[str, list[Any]]] = {
        "alpha": [Interval(float, -1.0, 2.0)],
        "beta": [Interval(float, 0.0, None)],
        "theta_min": [Interval(float, -1.0, 2.0)],
        "thresholds": [_THRESHOLDS, None],
        "split_from": [Interval(int, 0, None), None],
        **_SHARED_CONSTRAINTS,
    }

    def __post_init__(self) -> None:
        validate_fields(self, self._parameter_constraints)
        _as_tuple(self, "thresholds")


@dataclass(frozen=True)
class PitomeConfig:
    """How PiToMe runs (spectrum-preserving token merging, Tran et al.,
    arXiv 2405.16148; see :mod:`toast.methods.merge.pitome`).

    ``r``: tokens merged per block (an int spread by ``schedule``, or one
    count per block; toast's constant count, so MACs compare with ToMe's,
    where the paper's code keeps a share of the tokens). Every token's
    energy is its mean ``ELU(cos − margin_l, alpha)`` over the others (key
    cosine); the ``2r`` most energetic are matched and merged, the rest
    protected. ``margin``: the first block's, falling linearly to 0 at the
    last (the paper's 0.9; the code's DeiT setting is 0.75). Other fields
    as :class:`TomeConfig`.
    """

    r: int | Sequence[int] = 8
    schedule: str = "constant"
    margin: float = 0.9
    alpha: float = 1.0
    proportional_attention: bool = True
    unmerge_output: bool = True
    merge_norm: str = "average"
    image_size: int | None = None
    calibration: Calibration = field(default_factory=Calibration)

    HELP: ClassVar[dict[str, str]] = {
        "r": "tokens merged in every block (among the most energetic)",
        "schedule": SCHEDULE_HELP,
        "margin": "the first block's energy margin (falls linearly to 0 at the last)",
        "alpha": "the ELU's alpha in the energy",
        **_SHARED_HELP,
    }

    _parameter_constraints: ClassVar[dict[str, list[Any]]] = {
        "r": [Interval(int, 0, None), _PER_BLOCK],
        "schedule": [Options(SCHEDULES)],
        "margin": [Interval(float, -1.0, 1.0)],
        "alpha": [Interval(float, 0.0, None, closed="neither")],
        **_SHARED_CONSTRAINTS,
    }

    def __post_init__(self) -> None:
        validate_fields(self, self._parameter_constraints)
        _as_tuple(self, "r")
