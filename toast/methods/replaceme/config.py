"""The options of ``toast.compress(..., method="replaceme")``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from toast.hf.calibration import Calibration

__all__ = ["ReplaceMeConfig"]


@dataclass(frozen=True)
class ReplaceMeConfig:
    """How ReplaceMe cuts and estimates; see :func:`toast.replaceme` for
    each field."""

    num_blocks: int | None = None
    objective: Literal["ls", "cosine", "identity"] = "ls"
    num_cuts: int = 1
    adjacent: Literal["merge", "forbid"] = "merge"
    spans: Sequence[tuple[int, int]] | None = None
    distance: Literal["angular", "cosine", "l2"] = "angular"
    distance_tokens: str = "last"
    min_start: int = 1
    structure: Literal["full", "diagonal", "orthogonal"] = "full"
    ridge: float = 0.0
    loss: Literal["approximate", "exact"] = "approximate"
    solver: Literal["adam", "lbfgs"] = "adam"
    lr: float = 1e-4
    batch_size: int = 1024
    epochs: int = 10
    lbfgs_steps: int = 100
    penalty: Literal["l1", "l2"] | None = None
    penalty_weight: float = 0.0
    init: Literal["identity", "ls"] = "identity"
    placement: Literal["fold", "mlp", "block"] = "fold"
    fit: Literal["independent", "sequential"] = "independent"
    include_padding: bool = False
    max_buffer_bytes: int = 8 * 2**30
    buffer_dtype: Any = np.float32
    buffer_dir: str | os.PathLike | None = None
    backend: Literal["auto", "c", "torch"] = "auto"
    check: bool = True
    calibration: Calibration = field(default_factory=Calibration)
