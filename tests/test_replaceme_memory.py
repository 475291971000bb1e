"""ReplaceMe's least-squares calibration streams: its peak memory does not
grow with the number of calibration samples (fresh processes; the full
measurement is ``benchmarks/bench_replaceme.py``)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

_SCRIPT = textwrap.dedent(
    """
    import copy, json, os, resource, sys
    import torch, transformers, toast

    torch.set_num_threads(1)
    samples = int(sys.argv[1])
    cfg = transformers.LlamaConfig(vocab_size=500, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()

    class Batches:
        def __init__(self, n):
            self.n = n
        def __iter__(self):  # regenerated on every pass: the data is never held
            gen = torch.Generator().manual_seed(1)
            for _ in range(self.n // 8):
                ids = torch.randint(3, 500, (8, 128), generator=gen)
                yield {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    # The cut is given: one pass, the LS estimation alone.
    options = {"spans": [(2, 3)], "progress": False}
    toast.replaceme(copy.deepcopy(model), Batches(16), **options)  # warm-up
    before = rss_mib()
    _, report = toast.replaceme(model, Batches(samples), **options)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"rows": report.rows, "growth": peak - before}))
    """
)


def _growth(samples: int) -> dict:
    # One BLAS thread: small updates run faster, and steadier, on a busy machine.
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(samples)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_ls_calibration_peak_memory_does_not_grow_with_the_samples():
    small, large = _growth(48), _growth(384)
    assert large["rows"] == 8 * small["rows"] == 8 * 48 * 128
    # Holding M and L − Y in float32 would add 2 x 128 x 128 x 4 bytes per
    # sample: 6 MiB at 48 samples, 48 MiB at 384.
    held = (384 - 48) * 2 * 128 * 128 * 4 / 2**20
    assert large["growth"] - small["growth"] < 0.25 * held, (small, large)
