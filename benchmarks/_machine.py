"""The machine a benchmark ran on, as its results record and print it."""

from __future__ import annotations

import os
import platform

import torch

from toast.core.blas import get_blas_threads


def machine(load_before: tuple[float, float, float]) -> dict:
    """Cores, thread counts, the load average before and now, versions."""
    return {
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "blas_threads": get_blas_threads(),
        "load_before": list(load_before),
        "load_after": list(os.getloadavg()),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def describe(m: dict) -> str:
    """One sentence for a results table."""
    return (
        f"Machine: {m['cpus']} cores, torch threads {m['torch_threads']}, BLAS threads "
        f"{m['blas_threads']}, load average before {m['load_before'][0]:.2f}, after "
        f"{m['load_after'][0]:.2f}; torch {m['torch']}, Python {m['python']}."
    )
