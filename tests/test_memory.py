"""Streaming: the memory of analyze does not grow with the calibration set."""

import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

# Runs in a fresh interpreter so that the peak RSS (a high-water mark for the
# whole process) belongs to this analyze call alone. Batches come from a
# generator, so the data itself is never held either.
_SCRIPT = textwrap.dedent(
    """
    import json, os, resource, sys
    import torch, transformers, toast

    torch.set_num_threads(1)
    samples = int(sys.argv[1])
    cfg = transformers.ViTConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                 intermediate_size=128, image_size=32, patch_size=4)
    torch.manual_seed(0)
    model = transformers.ViTModel(cfg, add_pooling_layer=False).eval()

    def batches():
        gen = torch.Generator().manual_seed(1)
        for _ in range(samples // 50):
            yield torch.randn(50, 3, 32, 32, generator=gen)

    def rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    next(iter(batches()))  # warm the allocator and the lazy imports
    toast.analyze(model, [torch.zeros(2, 3, 32, 32)], estimator="gcv", progress=False)
    before = rss_mib()
    analysis = toast.analyze(model, batches(), estimator="gcv", progress=False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"rows": analysis.rows, "growth": peak - before}))
    """
)


def _growth(samples: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(samples)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_peak_memory_of_analyze_does_not_grow_with_the_samples():
    small, large = _growth(600), _growth(2400)
    assert large["rows"] == 4 * small["rows"] == 4 * 600 * 65
    # Holding the activations would add 5 states x 65 tokens x 64 x 4 bytes
    # per sample: ~50 MiB at 600 samples, ~200 MiB at 2400.
    held = 3 * 600 * 5 * 65 * 64 * 4 / 2**20
    assert large["growth"] - small["growth"] < 0.2 * held, (small, large)
