"""Smoke test of an installed toast-compress wheel (run outside the source tree).

Imports the package, checks that the C core was loaded from site-packages
(not a checkout), accumulates Moments, and compresses a tiny model with one
nn.ModuleList of residual blocks: nothing beyond the wheel's own
dependencies and torch is needed. Also finds the digits ViT's weights,
which the wheel ships as package data.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

import toast


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.1 * self.fc2(torch.relu(self.fc1(x)))


class _Tiny(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(_Block(dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return h


def main() -> int:
    core = Path(toast._core.__file__)
    assert "site-packages" in core.parts, f"toast._core loaded from {core}, not the wheel"
    rng = np.random.default_rng(0)
    moments = toast.Moments(num_states=2, dim=16, folds=2)
    x = rng.standard_normal((200, 16))
    moments.update([x, x @ rng.standard_normal((16, 16))])
    errors = toast.error_matrix(moments, metric="linear", estimator="cv")
    assert 0 <= errors[0, 1] < 1e-6, errors  # an exact linear map

    torch.manual_seed(0)
    model = _Tiny()
    data = [torch.randn(8, 12, 16) for _ in range(8)]
    model, report = toast.compress(model, data, budget=1, progress=False)
    assert report.blocks_removed == 1 and len(model.blocks) == 4  # 3 blocks + a translator
    # the digits ViT ships as package data (pyproject's package-data): the demo never trains
    from toast.zoo import digits_vit_weights

    weights = digits_vit_weights()
    assert weights.is_file() and weights.stat().st_size > 1_000_000, f"{weights} not in the wheel"
    assert weights.stat().st_mode & 0o004, f"{weights} is not readable by all"
    print(f"toast {toast.__version__} from {core.parent}: Moments, error_matrix and compress OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
