"""ToaSt schedules: per-block TCS ratios (FC1, FC2) and MHSA head sparsity.

Blocks are indexed **globally from 0** in forward order (a Swin model's
stages are concatenated: Swin-T's 12 blocks are 0..11). The paper's tables
number layers from 1; the named schedules below are written in the paper's
numbering and converted.

Named schedules (``"<model>@<reported GMACs>"``; from ToaSt's Tables 11-13
and 26 and the reference code's ``configs/tcs.json``):

================  =====  ===============================================
name              ρ      TCS ratios (1-based layers)
================  =====  ===============================================
deit_tiny@0.9     0.8    FC2 0.5 on L12
deit_tiny@0.8     0.8    FC1 0.3 L12; FC2 0.9 L12
deit_tiny@0.76    0.8    FC1 0.3 L11-12; FC2 0.5, 0.6, 0.9, 0.9 L9-12
deit_small@2.9    0.9    FC1 0.3 L12; FC2 0.9 L11-12
deit_small@2.7    0.9    FC1 0.3 L12; FC2 0.6, 0.7, 0.8, 0.9, 0.9 L8-12
deit_small@2.5    0.9    Table 11: FC1 0.5 L11-12; FC2 0.8 L8-9, 0.9 L10-12
deit_base@11.5    0.9    FC1 0.3 L12; FC2 0.7 L11, 0.9 L12
deit_base@10.7    0.9    FC1 0.3 L11-12; FC2 0.5, 0.8, 0.9, 0.9 L9-12
deit_base@10.4    0.9    FC1 0.3 L12; FC2 0.5, 0.8, 0.8, 0.9, 0.9 L8-12
deit_base@10.27   0.9    FC1 0.3 L11-12; FC2 as 10.4
mae_base@11.5     0.9    as deit_base@11.5
mae_base@11.0     0.9    FC2 0.5, 0.6, 0.9, 0.9 L9-12
mae_large@42.3    0.9    FC2 0.6 L24
mae_large@38.5    0.9    FC1 0.3 L24; FC2 0.6, 0.7, 0.9, 0.9, 0.9, 0.9 L19-24
mae_huge@103.4    0.9    Table 12: FC1 0.2 L32; FC2 0.8 L25, 0.9 L26-32
mae_huge@101.4    0.9    FC1 0.3 L32; FC2 0.9 L24-32
mae_huge@100.4    0.9    FC1 0.3 L32; FC2 0.7 L23, 0.8 L24, 0.9 L25-32
swin_tiny@3.1     0.8    FC1 0.3 block 12; FC2 0.5 block 10, 0.9 blocks 11-12
swin_small@5.4    0.9    FC1 0.3 block 24; FC2 0.9 blocks 18-24
swin_base@8.8     0.9    Table 13: FC1 0.3 block 24; FC2 0.9 blocks 14-24
swin_small@coco   0.6    Table 26: FC1 0.3 last block; FC2 0.9 last 3
swin_base@coco    0.6    Table 26 (config 1): FC1 0.3 last; FC2 0.9 last 4
================  =====  ===============================================

Aliases: ``table11`` = ``deit_small@2.5``, ``table12`` = ``mae_huge@103.4``
(Table 12's ratios recount to the 103.4-GMAC schedule, not the 101.4
headline), ``table13`` = ``swin_base@8.8``.

Head sparsity ρ: 0.9 except DeiT-T and Swin-T, where the paper's text and
its reported GFLOPs both say 0.8 (the reference code's config records 0.9
there, which does not reproduce the reported 0.76 / 3.1 GMACs). Block 0
keeps all its head dimensions (the paper's "except the first layer"; the
reported Swin GFLOPs also fit skipping global block 0 only).

Token sample ratio: 0.2 for DeiT-T and Swin, 0.02 otherwise (paper App. F.5).

This module does not import torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from toast._validation import Interval, Options, Predicate, check

__all__ = [
    "NAMED_SCHEDULES",
    "Schedule",
    "get_schedule",
    "head_keep",
    "per_block_sparsity",
    "skip_blocks",
    "tcs_keep",
]

# Rounds away float noise before a floor: 80 * (1 - 0.9) is 7.999999999999998
# in binary floating point, yet the paper keeps 8 of MAE-H's 80 dimensions.
_FLOOR_SLACK = 1e-9


def head_keep(head_dim: int, sparsity: float) -> int:
    """Dimensions kept per head: ``floor(d_k · (1 − ρ))`` (the reference
    code's ``int(d_k · (100 − s) / 100)``), computed without float noise.
    Raises ``ValueError`` when nothing would be left."""
    _check_ratio(sparsity, "head sparsity")
    keep = math.floor(head_dim * (1.0 - sparsity) + _FLOOR_SLACK)
    if keep < 1:
        raise ValueError(
            f"head sparsity {sparsity} leaves no dimension in heads of size {head_dim} "
            f"(floor({head_dim} · (1 − {sparsity})) = 0); use a smaller sparsity"
        )
    return keep


def tcs_keep(channels: int, ratio: float) -> int:
    """Channels TCS keeps: ``min(C, max(1, floor(C · (1 − r))))``."""
    _check_ratio(ratio, "TCS ratio")
    return min(channels, max(1, math.floor(channels * (1.0 - ratio) + _FLOOR_SLACK)))


#: A fraction to drop: head sparsity ρ, a TCS ratio (all of it would leave nothing).
RATIO = Interval(float, 0, 1, closed="left")
#: The fraction of patch tokens TCS scores on.
SAMPLE_RATIO = Interval(float, 0, 1, closed="right")


def _check_ratio(value: Any, what: str) -> float:
    return float(check(what, value, RATIO))


@dataclass(frozen=True)
class Schedule:
    """Per-block TCS ratios and the MHSA head sparsity that goes with them.

    ``fc1[b]`` is the fraction of the ``D`` channels of ``Z = LN(X')`` that
    block ``b`` drops before ``fc1``; ``fc2[b]`` the fraction of the hidden
    channels dropped before ``fc2``. ``head_sparsity`` is ρ for every
    pruned block (block 0 is skipped by :func:`per_block_sparsity`'s
    default). ``sample_ratio`` is the fraction of patch tokens TCS scores on.
    ``reported_gmacs`` is the paper's figure for a named schedule.
    """

    fc1: tuple[float, ...]
    fc2: tuple[float, ...]
    head_sparsity: float = 0.0
    sample_ratio: float = 0.02
    name: str | None = None
    reported_gmacs: float | None = None
    source: str = ""

    def __post_init__(self) -> None:
        if len(self.fc1) != len(self.fc2):
            raise ValueError(
                f"fc1 has {len(self.fc1)} ratios and fc2 {len(self.fc2)}; give one per block"
            )
        for what, ratios in (("fc1", self.fc1), ("fc2", self.fc2)):
            for b, r in enumerate(ratios):
                _check_ratio(r, f"{what} ratio of block {b}")
        _check_ratio(self.head_sparsity, "head_sparsity")
        check("sample_ratio", self.sample_ratio, SAMPLE_RATIO)

    @property
    def num_blocks(self) -> int:
        return len(self.fc1)

    @property
    def active_blocks(self) -> tuple[int, ...]:
        """Blocks with a nonzero FC1 or FC2 ratio."""
        return tuple(b for b in range(self.num_blocks) if self.fc1[b] > 0 or self.fc2[b] > 0)

    def describe(self) -> str:
        """One line per active block: ``block b: fc1 r1, fc2 r2``."""
        parts = [f"block {b}: fc1 {self.fc1[b]:g}, fc2 {self.fc2[b]:g}" for b in self.active_blocks]
        return "; ".join(parts) if parts else "no TCS"


# -- the paper's schedules ------------------------------------------------------

_MODEL_BLOCKS = {
    "deit_tiny": 12,
    "deit_small": 12,
    "deit_base": 12,
    "mae_base": 12,
    "mae_large": 24,
    "mae_huge": 32,
    "swin_tiny": 12,
    "swin_small": 24,
    "swin_base": 24,
}
_TINY = ("deit_tiny", "swin_tiny")


def _spec(
    model: str,
    gmacs: float | None,
    fc1: Mapping[int, float],
    fc2: Mapping[int, float],
    source: str,
    head_sparsity: float | None = None,
    tag: str | None = None,
) -> Schedule:
    """A schedule from 1-based ``{layer: ratio}`` maps."""
    n = _MODEL_BLOCKS[model]
    r1, r2 = [0.0] * n, [0.0] * n
    for layer, r in fc1.items():
        r1[layer - 1] = r
    for layer, r in fc2.items():
        r2[layer - 1] = r
    if head_sparsity is None:
        head_sparsity = 0.8 if model in _TINY else 0.9
    sample = 0.2 if model in _TINY or model.startswith("swin") else 0.02
    name = f"{model}@{tag if tag is not None else f'{gmacs:g}'}"
    return Schedule(tuple(r1), tuple(r2), head_sparsity, sample, name, gmacs, source)


def _span(first: int, values: Sequence[float]) -> dict[int, float]:
    return {first + k: v for k, v in enumerate(values)}


_CODE = "reference code configs/tcs.json"
_NAMED = [
    _spec("deit_tiny", 0.9, {}, {12: 0.5}, _CODE),
    _spec("deit_tiny", 0.8, {12: 0.3}, {12: 0.9}, _CODE),
    _spec("deit_tiny", 0.76, {11: 0.3, 12: 0.3}, _span(9, [0.5, 0.6, 0.9, 0.9]), _CODE),
    _spec("deit_small", 2.9, {12: 0.3}, {11: 0.9, 12: 0.9}, _CODE),
    _spec("deit_small", 2.7, {12: 0.3}, _span(8, [0.6, 0.7, 0.8, 0.9, 0.9]), _CODE),
    _spec(
        "deit_small",
        2.5,
        {11: 0.5, 12: 0.5},
        _span(8, [0.8, 0.8, 0.9, 0.9, 0.9]),
        "paper Table 11 (= " + _CODE + " deit_small@2.5)",
    ),
    _spec("deit_base", 11.5, {12: 0.3}, {11: 0.7, 12: 0.9}, _CODE),
    _spec("deit_base", 10.7, {11: 0.3, 12: 0.3}, _span(9, [0.5, 0.8, 0.9, 0.9]), _CODE),
    _spec("deit_base", 10.4, {12: 0.3}, _span(8, [0.5, 0.8, 0.8, 0.9, 0.9]), _CODE),
    _spec("deit_base", 10.27, {11: 0.3, 12: 0.3}, _span(8, [0.5, 0.8, 0.8, 0.9, 0.9]), _CODE),
    _spec("mae_base", 11.5, {12: 0.3}, {11: 0.7, 12: 0.9}, _CODE),
    _spec("mae_base", 11.0, {}, _span(9, [0.5, 0.6, 0.9, 0.9]), _CODE),
    _spec("mae_large", 42.3, {}, {24: 0.6}, _CODE),
    _spec("mae_large", 38.5, {24: 0.3}, _span(19, [0.6, 0.7, 0.9, 0.9, 0.9, 0.9]), _CODE),
    _spec(
        "mae_huge",
        103.4,
        {32: 0.2},
        {25: 0.8, **_span(26, [0.9] * 7)},
        "paper Table 12 (= " + _CODE + " mae_huge@103.4)",
    ),
    _spec("mae_huge", 101.4, {32: 0.3}, _span(24, [0.9] * 9), _CODE),
    _spec("mae_huge", 100.4, {32: 0.3}, {23: 0.7, 24: 0.8, **_span(25, [0.9] * 8)}, _CODE),
    _spec("swin_tiny", 3.1, {12: 0.3}, {10: 0.5, 11: 0.9, 12: 0.9}, _CODE),
    _spec("swin_small", 5.4, {24: 0.3}, _span(18, [0.9] * 7), _CODE),
    _spec(
        "swin_base",
        8.8,
        {24: 0.3},
        _span(14, [0.9] * 11),
        "paper Table 13 (= " + _CODE + " swin_base@8.8)",
    ),
    _spec(
        "swin_small",
        None,
        {24: 0.3},
        _span(22, [0.9] * 3),
        "paper Table 26 (COCO backbone)",
        0.6,
        "coco",
    ),
    _spec(
        "swin_base",
        None,
        {24: 0.3},
        _span(21, [0.9] * 4),
        "paper Table 26 (COCO backbone, config 1)",
        0.6,
        "coco",
    ),
]

#: Every named schedule by name (see the module docstring).
NAMED_SCHEDULES: dict[str, Schedule] = {s.name: s for s in _NAMED if s.name}
_ALIASES = {"table11": "deit_small@2.5", "table12": "mae_huge@103.4", "table13": "swin_base@8.8"}


def _by_name(name: str) -> Schedule:
    key = _ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in NAMED_SCHEDULES:
        # "deit_small@2.50" == "deit_small@2.5"
        model, _, gm = key.partition("@")
        try:
            key = f"{model}@{float(gm):g}"
        except ValueError:
            pass
    if key not in NAMED_SCHEDULES:
        known = ", ".join(sorted(NAMED_SCHEDULES) + sorted(_ALIASES))
        raise ValueError(f"unknown schedule {name!r}; named schedules: {known}")
    return NAMED_SCHEDULES[key]


def _ratios(value: Any, num_blocks: int, what: str) -> tuple[float, ...]:
    if value is None:
        return (0.0,) * num_blocks
    if isinstance(value, Mapping):
        out = [0.0] * num_blocks
        for b, r in value.items():
            if not isinstance(b, int) or not 0 <= b < num_blocks:
                raise ValueError(
                    f"{what} names block {b!r}; blocks are 0-based global indices "
                    f"below {num_blocks}"
                )
            out[b] = float(r)
        return tuple(out)
    if isinstance(value, (int, float)):
        return (float(value),) * num_blocks
    ratios = tuple(float(r) for r in value)
    if len(ratios) != num_blocks:
        raise ValueError(f"{what} has {len(ratios)} ratios for a model with {num_blocks} blocks")
    return ratios


def get_schedule(spec: Any, num_blocks: int | None = None) -> Schedule:
    """A :class:`Schedule` from a name (``"deit_small@2.5"``, ``"table11"``),
    a :class:`Schedule`, a mapping ``{"fc1": ..., "fc2": ..., "head_sparsity":
    ..., "sample_ratio": ...}`` (ratios as one list per block, a
    ``{block: ratio}`` map with 0-based global blocks, or one number for
    every block) or ``None`` (no TCS; needs ``num_blocks``).

    With ``num_blocks``, the schedule must have that many blocks.
    """
    if spec is None:
        if num_blocks is None:
            raise ValueError("schedule=None needs num_blocks")
        sched = Schedule((0.0,) * num_blocks, (0.0,) * num_blocks)
    elif isinstance(spec, Schedule):
        sched = spec
    elif isinstance(spec, str):
        sched = _by_name(spec)
    elif isinstance(spec, Mapping):
        unknown = set(spec) - {"fc1", "fc2", "head_sparsity", "sample_ratio", "name"}
        if unknown:
            raise ValueError(
                f"unknown schedule keys {sorted(unknown)}; use fc1, fc2, head_sparsity, "
                "sample_ratio, name"
            )
        n = num_blocks
        for key in ("fc1", "fc2"):
            v = spec.get(key)
            if n is None and v is not None and not isinstance(v, (Mapping, int, float)):
                n = len(v)
        if n is None:
            raise ValueError("a schedule given as {block: ratio} maps needs num_blocks")
        sched = Schedule(
            _ratios(spec.get("fc1"), n, "fc1"),
            _ratios(spec.get("fc2"), n, "fc2"),
            float(spec.get("head_sparsity", 0.0)),
            float(spec.get("sample_ratio", 0.02)),
            spec.get("name"),
        )
    else:
        raise ValueError(
            f"schedule must be a name, a Schedule, a mapping or None, got {type(spec).__name__}"
        )
    if num_blocks is not None and sched.num_blocks != num_blocks:
        raise ValueError(
            f"schedule {sched.name or ''} has {sched.num_blocks} blocks but the model has "
            f"{num_blocks}"
        )
    return sched


def per_block_sparsity(
    sparsity: float | Sequence[float] | Mapping[int, float],
    num_blocks: int,
    skip: Sequence[int] = (0,),
) -> tuple[float, ...]:
    """Head sparsity ρ per global block: one number for every block but
    those in ``skip`` (default block 0), a list with one ρ per block, or a
    ``{block: ρ}`` map (missing blocks 0). ``skip`` applies to all forms."""
    if isinstance(sparsity, Mapping):
        rho = list(_ratios(sparsity, num_blocks, "head_sparsity"))
    elif isinstance(sparsity, (int, float)):
        rho = [float(sparsity)] * num_blocks
    else:
        rho = list(_ratios(sparsity, num_blocks, "head_sparsity"))
    for b in skip:
        if not 0 <= int(b) < num_blocks:
            raise ValueError(f"skip names block {b}, outside 0..{num_blocks - 1}")
        rho[int(b)] = 0.0
    for b, r in enumerate(rho):
        _check_ratio(r, f"head sparsity of block {b}")
    return tuple(rho)


#: ``skip``: block indices, or ``"stage_first"`` (the first block of every Swin stage).
SKIP = (
    Predicate(
        lambda v: (
            isinstance(v, Sequence)
            and not isinstance(v, str)
            and all(isinstance(b, int) and not isinstance(b, bool) for b in v)
        ),
        "a list of block indices",
    ),
    Options(("stage_first",)),
)


def skip_blocks(skip: Sequence[int] | str, stage_firsts: Callable[[], list[int]]) -> list[int]:
    """The blocks ``skip`` keeps dense: its indices, or for ``"stage_first"``
    those ``stage_firsts()`` returns (the Table 13 caption's reading)."""
    check("skip", skip, *SKIP)
    if isinstance(skip, str):
        return stage_firsts()
    return [int(b) for b in skip]
