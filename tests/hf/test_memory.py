"""Streaming: the memory of analyze does not grow with the calibration set."""

import pytest

from tests._helpers import run_fresh

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

# Runs in a fresh interpreter so that the peak RSS (a high-water mark for the
# whole process) belongs to this analyze call alone. Batches come from a
# generator, so the data itself is never held either.
_SCRIPT = """
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

    next(iter(batches()))  # warm the allocator and the lazy imports
    toast.analyze(model, [torch.zeros(2, 3, 32, 32)], estimator="gcv", progress=False)
    before = rss_mib()
    analysis = toast.analyze(model, batches(), estimator="gcv", progress=False)
    print(json.dumps({"rows": analysis.rows, "growth": peak_mib() - before}))
"""


def _growth(samples: int) -> dict:
    return run_fresh(_SCRIPT, samples)


def test_peak_memory_of_analyze_does_not_grow_with_the_samples():
    small, large = _growth(600), _growth(2400)
    assert large["rows"] == 4 * small["rows"] == 4 * 600 * 65
    # Holding the activations would add 5 states x 65 tokens x 64 x 4 bytes
    # per sample: ~50 MiB at 600 samples, ~200 MiB at 2400.
    held = 3 * 600 * 5 * 65 * 64 * 4 / 2**20
    assert large["growth"] - small["growth"] < 0.2 * held, (small, large)
