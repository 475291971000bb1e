"""Peak memory of one ``toast.search`` on SmolLM2-135M-Instruct: the data
of ``bench_search.py`` (32 × 256 calibration tokens, 16 × 256 held-out),
a 20% parameter target, a cold cache, 12 candidates measured with
throughput. Its own process, so that the maximum resident set size is the
search's and not the by-hand runs' of ``bench_search.py``.

Usage: ``python benchmarks/bench_search_memory.py`` (about 6 minutes on 2 cores).
"""

from __future__ import annotations

import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _machine  # noqa: E402

import toast  # noqa: E402
import toast.zoo  # noqa: E402


def _gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def main() -> None:
    from toast.data import stdlib_sentences
    from toast.hf.data.text import TextData

    load = os.getloadavg()
    gguf = toast.zoo.smollm2_gguf()
    model = toast.load_model(gguf).eval()
    tokenizer = toast.load_tokenizer(gguf)
    loaded = _gib()
    sentences = stdlib_sentences(limit=None)
    half, quarter = len(sentences) // 2, len(sentences) // 4
    options: dict[str, Any] = {"max_length": 256, "pack": True, "batch_size": 4}
    calib = TextData(sentences[:half], tokenizer, num_samples=32, **options)
    heldout = TextData(sentences[half : half + quarter], tokenizer, num_samples=16, **options)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache:
        result = toast.search(model, calib, heldout, target=0.2, cache=cache, progress=False)
    seconds = time.perf_counter() - start
    assert result.best is not None
    print(
        f"peak RSS {_gib():.2f} GiB ({loaded:.2f} GiB after loading the model); search "
        f"{seconds:.0f} s; chosen {result.best.candidate.label}, held-out perplexity "
        f"{result.best.measurement.quality:.2f}"
    )
    print(_machine.describe(_machine.machine(load)))


if __name__ == "__main__":
    main()
