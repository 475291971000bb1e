"""What a search aims at: a reduction of parameters, MACs or measured
latency, a number of blocks removed, or a quality floor.

``Target.parse`` reads what a user types: ``0.2`` or ``"params=20%"``
(parameters at most 80% of the original's), ``"macs=0.25"``,
``"latency=30%"`` (measured forward time at most 70% of the original's),
MACs counted as ``toast.macs(model, convention="linear")`` counts them
(the ``nn.Linear`` layers only),
``"quality=10%"`` (held-out quality at most 10% worse than the original's:
perplexity at most ×1.10, accuracy or output cosine at most 10% lower),
``"blocks=4"`` (exactly four blocks removed, a span replaced by a translator
counting as removed: the request ``toast.compress(..., num_blocks=4)``
makes of one method).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["MACS_CONVENTION", "TARGET_KINDS", "Target"]

TargetKind = Literal["params", "macs", "latency", "quality", "blocks"]
TARGET_KINDS: tuple[str, ...] = ("params", "macs", "latency", "quality", "blocks")


@dataclass(frozen=True)
class Target:
    """``kind`` and ``value``: the fraction of parameters, MACs or forward
    time to remove, the largest relative quality loss allowed, or (kind
    ``"blocks"``) the number of blocks to remove."""

    kind: TargetKind
    value: float

    def __post_init__(self) -> None:
        if self.kind not in TARGET_KINDS:
            raise ValueError(f"target kind must be one of {list(TARGET_KINDS)}; got {self.kind!r}")
        if not (isinstance(self.value, (int, float)) and math.isfinite(self.value)):
            raise ValueError(f"target value must be a finite number; got {self.value!r}")
        if self.kind == "blocks":
            if self.value != int(self.value) or self.value < 1:
                raise ValueError(
                    f"target blocks={self.value!r} must be a whole number of blocks, at least 1 "
                    "(e.g. 'blocks=4')"
                )
        elif not 0 < self.value < 1:
            raise ValueError(
                f"target {self.kind}={self.value!r} must be a fraction between 0 and 1 "
                "(e.g. 0.2 or '20%')"
            )

    @classmethod
    def parse(cls, target: Any) -> Target:
        """A :class:`Target` from a number (a parameter reduction), a
        ``"kind=value"`` string (value a fraction or a percentage) or a
        ``Target``."""
        if isinstance(target, Target):
            return target
        if isinstance(target, bool) or not isinstance(target, (int, float, str)):
            raise TypeError(
                "target must be a fraction of parameters to remove (0.2), a string such as "
                f"'params=20%', 'macs=25%', 'latency=30%' or 'quality=10%', or a Target; got "
                f"{type(target).__name__}"
            )
        if not isinstance(target, str):
            return cls("params", float(target))
        kind, sep, value = target.partition("=")
        if not sep:
            kind, value = "params", target
        kind = kind.strip().lower()
        if kind == "blocks":
            return cls("blocks", _count(value, target))
        return cls(kind, _fraction(value, target))  # type: ignore[arg-type]

    @property
    def is_size(self) -> bool:
        """Whether the target bounds the model's size (known before measuring)."""
        return self.kind in ("params", "macs", "blocks")

    @property
    def num_blocks(self) -> int | None:
        """The blocks a ``"blocks"`` target removes (None for other kinds)."""
        return int(self.value) if self.kind == "blocks" else None

    def describe(self) -> str:
        if self.kind == "blocks":
            return f"{int(self.value)} blocks removed"
        if self.kind == "quality":
            return f"quality at most {100 * self.value:g}% worse than the original"
        return f"{100 * self.value:g}% fewer {_NOUNS[self.kind]}"


#: The MACs a target counts: :func:`toast.macs`'s convention of that name.
MACS_CONVENTION = "linear"
_NOUNS = {
    "params": "parameters",
    "macs": f"MACs (convention={MACS_CONVENTION!r}: linear layers)",
    "latency": "seconds per forward",
}


def _fraction(text: str, whole: str) -> float:
    text = text.strip()
    try:
        if text.endswith("%"):
            return float(text[:-1]) / 100.0
        return float(text)
    except ValueError:
        raise ValueError(
            f"cannot read target {whole!r}: write kind=value with kind one of "
            f"{list(TARGET_KINDS)} and value a fraction or a percentage, e.g. 'params=20%'"
        ) from None


def _count(text: str, whole: str) -> float:
    try:
        return float(int(text.strip()))
    except ValueError:
        raise ValueError(
            f"cannot read target {whole!r}: a blocks= target is a whole number of blocks, "
            "e.g. 'blocks=4'"
        ) from None
