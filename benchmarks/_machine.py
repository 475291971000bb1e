"""The machine a benchmark ran on, as its results record and print it."""

from __future__ import annotations

import os
import platform

import torch

from toast.core.blas import get_blas_threads


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the platform's word elsewhere):
    figures from an AVX2-only CPU and from one with AMX differ by kind."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine(load_before: tuple[float, float, float]) -> dict:
    """The CPU, cores, thread counts, the load average before and now, versions."""
    return {
        "cpu": cpu_model(),
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
    cpu = f"{m['cpu']}, " if "cpu" in m else ""
    return (
        f"Machine: {cpu}{m['cpus']} cores, torch threads {m['torch_threads']}, BLAS threads "
        f"{m['blas_threads']}, load average before {m['load_before'][0]:.2f}, after "
        f"{m['load_after'][0]:.2f}; torch {m['torch']}, Python {m['python']}."
    )
