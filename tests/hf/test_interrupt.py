"""Ctrl-C during calibration: prompt KeyboardInterrupt, model untouched."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

torch = pytest.importorskip("torch")
hf_models = pytest.importorskip("tests._helpers.hf_models")

import toast  # noqa: E402
from tests.conftest import default_sigint  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

VIT = hf_models.FAMILIES[0]


def _interrupted_after(batches, k):
    for index, batch in enumerate(batches):
        if index == k:
            raise KeyboardInterrupt
        yield batch


def _hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize(
    "run",
    [
        lambda m, data: toast.analyze(m, data, progress=False),
        lambda m, data: toast.compress(m, data, budget=1, progress=False),
        lambda m, data: toast.compress(m, data, spans=[(1, 3)], translator="mlp", progress=False),
    ],
    ids=["analyze", "compress", "compress-trained"],
)
def test_interrupted_calibration_leaves_the_model_as_it_was(run):
    model = hf_models.build(VIT)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hooks = _hooks(model)
    with pytest.raises(KeyboardInterrupt):
        run(model, _interrupted_after(hf_models.loader(VIT, 16, batch_size=4), 2))
    assert model.training
    assert _hooks(model) == hooks
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_interrupted_sampling_removes_its_disk_buffer(tmp_path):
    model = hf_models.build(VIT)
    batches = _interrupted_after(hf_models.loader(VIT, 16, batch_size=4), 2)
    with pytest.raises(KeyboardInterrupt):
        toast.hf.capture_rows(model, batches, [1, 3], directory=tmp_path, progress=False)
    assert os.listdir(tmp_path) == []


_SCRIPT = textwrap.dedent(
    """
    import sys, time, torch, transformers, toast
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                 intermediate_size=64, image_size=16, patch_size=4)
    model = transformers.ViTModel(cfg, add_pooling_layer=False).eval()

    def endless():
        while True:
            yield torch.randn(16, 3, 16, 16)

    print("started", flush=True)
    try:
        toast.analyze(model, endless(), progress=False)
    except KeyboardInterrupt:
        hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
        print(f"interrupted hooks={hooks}", flush=True)
        sys.exit(3)
    """
)


def test_sigint_stops_calibration_promptly():
    proc = subprocess.Popen(
        [sys.executable, "-c", _SCRIPT],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )
    try:
        assert proc.stdout.readline().strip() == "started"
        time.sleep(1.0)  # well inside the endless calibration loop
        proc.send_signal(signal.SIGINT)
        # a hang fails here; the interrupt itself arrives between batches
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 3, err
    assert "interrupted hooks=0" in out
