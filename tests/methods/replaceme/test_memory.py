"""ReplaceMe's least-squares calibration streams: its peak memory does not
grow with the number of calibration samples (fresh processes; the full
measurement is ``benchmarks/bench_replaceme.py``)."""

import os

import pytest

from tests._helpers import run_fresh

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

_SCRIPT = """
    import copy
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

    # The cut is given: one pass, the LS estimation alone.
    options = {"spans": [(2, 3)], "check_fraction": 0.0, "progress": False}  # every batch fits
    toast.compress(copy.deepcopy(model), Batches(16), method="replaceme", **options)  # warm-up
    before = rss_mib()
    _, report = toast.compress(model, Batches(samples), method="replaceme", **options)
    print(json.dumps({"rows": report.rows, "growth": peak_mib() - before}))
"""


def _growth(samples: int) -> dict:
    # One BLAS thread: small updates run faster, and steadier, on a busy machine.
    return run_fresh(_SCRIPT, samples, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})


def test_ls_calibration_peak_memory_does_not_grow_with_the_samples():
    small, large = _growth(48), _growth(1536)
    assert large["rows"] == 32 * small["rows"] == 32 * 48 * 128
    # Holding M and L − Y in float32 would add 2 x 128 x 128 x 4 bytes per
    # sample: 6 MiB at 48 samples, 192 MiB at 1,536. The heap's own noise
    # between two fresh runs reaches 12 MiB here, so the signal must be far
    # above it (at 384 samples a quarter of it was 10.5 MiB, and a busy CI run
    # failed on noise alone).
    held = (1536 - 48) * 2 * 128 * 128 * 4 / 2**20
    assert large["growth"] - small["growth"] < 0.25 * held, (small, large)


_DISK_SCRIPT = """
    import tempfile
    import torch, transformers
    from toast.hf.capture.sequential import DiskModel
    from toast.methods.replaceme.config import ReplaceMeConfig
    from toast.methods.replaceme.disk import profile_from_disk

    from toast._malloc import return_freed_memory

    torch.set_num_threads(1)
    return_freed_memory()  # as the block-by-block path sets it (plan_checkpoint)
    samples = int(sys.argv[1])
    cfg = transformers.LlamaConfig(vocab_size=500, hidden_size=1024, intermediate_size=64,
                                   num_hidden_layers=3, num_attention_heads=8,
                                   num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    scratch = tempfile.TemporaryDirectory()  # removed at exit: nothing left in /tmp
    folder = scratch.name
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)

    def batches(n):
        gen = torch.Generator().manual_seed(1)
        for _ in range(n // 64):
            ids = torch.randint(3, 500, (64, 4), generator=gen)
            yield {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    config = ReplaceMeConfig.from_options(None, {"num_blocks": 1, "progress": False})
    profile_from_disk(DiskModel.open(folder), list(batches(64)), config)  # warm-up
    before = rss_mib()
    profile = profile_from_disk(DiskModel.open(folder), list(batches(samples)), config)
    data = 4 * samples * 4 * 4  # the batches' ids and masks themselves
    print(json.dumps({"rows": profile.rows, "growth": peak_mib() - before - data / 2**20}))
"""


def test_distance_profile_from_disk_peak_memory_does_not_grow_with_the_samples():
    small, large = (
        run_fresh(_DISK_SCRIPT, n, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
        for n in (512, 4096)
    )
    assert (small["rows"], large["rows"]) == (512, 4096)
    # Holding every state's last-token rows in memory: 4 states x 1024 x 4
    # bytes a sample, 56 MiB more at 4,096 samples than at 512.
    held = (4096 - 512) * 4 * 1024 * 4 / 2**20
    assert large["growth"] - small["growth"] < 0.25 * held, (small, large)


_SOLVE_SCRIPT = """
    import warnings

    import torch
    from toast.methods.replaceme.config import ReplaceMeConfig
    from toast.methods.replaceme.estimate import Cut, Estimator, solve_cut
    from toast.spans import Span

    torch.set_num_threads(1)
    d, rows = int(sys.argv[1]), int(sys.argv[2])
    config = ReplaceMeConfig.from_options(None, {"num_blocks": 1, "progress": False})
    cut = Cut(Span(1, 2, 0.0))
    estimator = Estimator([cut], config, {}, None, None)
    estimator.open_cut(cut, d, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        x = torch.randn(rows, d, generator=gen)
        estimator.add_rows(cut, x, x @ torch.randn(d, d, generator=gen) * 0.01, None)
    del x
    held = cut.moments.nbytes
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = rss_mib()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a singular Gram says so
        solve_cut(cut, config, torch.device("cpu"))
    print(json.dumps({"moments": held / 2**20, "solve": peak_mib() - before}))
"""


@pytest.mark.parametrize("rows", [2048, 128], ids=["cholesky", "eigendecomposition"])
def test_the_plan_counts_a_cuts_moments_and_its_solve_as_measured(rows):
    # The block-by-block plan sizes ReplaceMe's statistics by these counts;
    # fewer rows than the width make the Gram singular: the eigensolver's
    # workspace is touched too, the most a solve holds. The default full T
    # frees its moments before the solve.
    from toast.methods.replaceme import memory

    d = 1024
    panel = d * d * 8 / 2**20
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    found = run_fresh(_SOLVE_SCRIPT, d, rows // 2, env=env)
    assert found["moments"] <= memory.PANELS_PER_CUT * panel * 1.01
    assert found["solve"] <= memory.SOLVE_MATRICES_FULL * panel * 1.05  # the allocator's own
    if rows < d:
        assert found["solve"] > (memory.SOLVE_MATRICES_FULL - 2) * panel  # not a loose count
