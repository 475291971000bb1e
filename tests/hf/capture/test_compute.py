"""What forwards compute in: the block-by-block path keeps a 16-bit
checkpoint's dtype only where its matmuls are native, and ``"bfloat16"``
runs a float32 model's forwards in bf16 while its weights and the
statistics stay as they were."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests._helpers import replaceme_models as R  # noqa: E402
from toast.hf.capture import compute  # noqa: E402
from toast.hf.capture.compute import compute_dtype, forward_dtype, native_matmul  # noqa: E402
from toast.hf.capture.sequential import DiskModel  # noqa: E402
from toast.hf.capture.states import stream_states  # noqa: E402
from toast.hf.evaluate.quality import Evaluator  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


@pytest.mark.parametrize("native", [True, False])
def test_auto_keeps_a_bf16_checkpoint_in_bf16_only_where_bf16_is_native(
    native, tmp_path, monkeypatch
):
    monkeypatch.setattr(compute, "native_matmul", lambda dtype, device="cpu": native)
    R.decoder("llama").to(torch.bfloat16).save_pretrained(tmp_path)
    disk = DiskModel.open(tmp_path)
    assert disk.dtype == (torch.bfloat16 if native else torch.float32)
    assert DiskModel.open(tmp_path, compute="float32").dtype == torch.float32


def test_a_float32_checkpoint_computes_in_float32_under_auto(monkeypatch):
    monkeypatch.setattr(compute, "native_matmul", lambda dtype, device="cpu": True)
    assert compute_dtype(torch.float32, "auto") == torch.float32
    assert compute_dtype(torch.float32, "bfloat16") == torch.bfloat16


@pytest.mark.parametrize("native", [True, False])
def test_bfloat16_asked_for_where_it_is_emulated_warns_and_still_computes_in_bf16(
    native, monkeypatch, recwarn
):
    monkeypatch.setattr(compute, "native_matmul", lambda dtype, device="cpu": native)
    model = R.decoder("llama")
    assert compute_dtype(torch.float32, "bfloat16") == torch.bfloat16
    assert forward_dtype(model, "bfloat16") == torch.bfloat16
    said = [str(w.message) for w in recwarn if issubclass(w.category, RuntimeWarning)]
    assert len(said) == (0 if native else 2)
    assert all("emulated on this CPU" in text and "'auto'" in text for text in said)


def test_native_is_decided_by_the_fastest_rounds(monkeypatch):
    # one slow float32 round (a preempted probe) does not make bf16 native:
    # the fastest round of each dtype is compared
    compute._measured.cache_clear()
    times = iter([1.0] * 2 * compute._WARMUP + [5.0, 1.0] + [1.0, 1.0] * (compute._ROUNDS - 1))
    monkeypatch.setattr(compute, "_timed", lambda a, b: next(times))
    try:
        assert native_matmul(torch.bfloat16) is False
    finally:
        compute._measured.cache_clear()


def test_an_emulated_dtype_is_judged_after_one_round(monkeypatch):
    # ten times float32's time is no near call: the probe stops there
    compute._measured.cache_clear()
    calls = []

    def timed(a, b):
        calls.append(a.dtype)
        return 1.0 if a.dtype == torch.float32 else 10.0

    monkeypatch.setattr(compute, "_timed", timed)
    try:
        assert native_matmul(torch.bfloat16) is False
    finally:
        compute._measured.cache_clear()
    assert len(calls) == 2 * (compute._WARMUP + 1)


def test_only_16bit_dtypes_can_be_native():
    assert native_matmul(torch.float32) is False and native_matmul(torch.float64) is False


def _linear_dtypes(model):
    seen = []
    handles = [
        m.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    return seen, handles


def test_bfloat16_runs_a_float32_models_calibration_matmuls_in_bf16_and_keeps_its_weights():
    model, data = R.decoder("llama").eval(), R.text_loader(16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert forward_dtype(model, "bfloat16") == torch.bfloat16
    for option, expected in (("bfloat16", torch.bfloat16), ("auto", torch.float32)):
        seen, handles = _linear_dtypes(model)
        try:
            stream_states(model, data, lambda rows, mask: 1, progress=False, compute_dtype=option)
        finally:
            for h in handles:
                h.remove()
        assert set(seen) == {expected}
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(v.dtype == torch.float32 for v in model.state_dict().values())


def test_bfloat16_held_out_measurement_is_the_autocast_forward():
    # the evaluator's bf16 pass scores what the model computes under autocast
    model, data = R.decoder("llama").eval(), R.text_loader(16)
    plain = Evaluator(data, progress=False, compute="bfloat16")
    plain.measure(model)
    seen, handles = _linear_dtypes(model)
    try:
        Evaluator(data, progress=False, compute="bfloat16").measure(model)
    finally:
        for h in handles:
            h.remove()
    assert set(seen) == {torch.bfloat16}
    wide = Evaluator(data, progress=False)
    wide.measure(model)
    narrow = plain.last["perplexity"]
    assert narrow != wide.last["perplexity"]
    assert narrow == pytest.approx(wide.last["perplexity"], rel=0.05)


def test_a_bf16_model_is_left_in_its_own_dtype():
    model = R.decoder("llama").to(torch.bfloat16)
    assert forward_dtype(model, "bfloat16") is None and forward_dtype(model, "auto") is None


def test_an_unknown_compute_dtype_names_the_choices():
    with pytest.raises(ValueError, match="'auto', 'float32', 'bfloat16', 'checkpoint'"):
        forward_dtype(R.decoder("llama"), "half")
    with pytest.raises(ValueError, match="compute"):
        Evaluator([], compute="half")


@pytest.mark.parametrize("native", [True, False])
def test_a_16bit_folder_loaded_whole_computes_as_the_disk_path_and_is_written_in_its_dtype(
    native, tmp_path, monkeypatch
):
    # where bf16 is not native the loaded checkpoint is widened to float32
    # for the passes (as the block-by-block path widens it a block at a
    # time), counted at float32's size in the plan, and written back in bf16
    from safetensors.torch import load_file

    import toast

    monkeypatch.setattr(compute, "native_matmul", lambda dtype, device="cpu": native)
    R.decoder("llama").to(torch.bfloat16).save_pretrained(tmp_path / "source")
    seen = []

    def record(module, args, out):
        if isinstance(module, torch.nn.Linear):
            seen.append(out.dtype)

    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        toast.compress(
            tmp_path / "source", R.text_loader(), output=tmp_path / "out", method="replaceme",
            spans=[(2, 4)], check_fraction=0.0, sequential=False, progress=False,
        )  # fmt: skip
    finally:
        handle.remove()
    assert set(seen) == {torch.bfloat16 if native else torch.float32}
    written = {}
    for shard in (tmp_path / "out").glob("*.safetensors"):
        written.update(load_file(shard))
    assert {t.dtype for t in written.values()} == {torch.bfloat16}


def test_the_in_memory_plan_counts_a_widened_checkpoint_at_float32s_size(tmp_path, monkeypatch):
    from toast.hf.capture.budget import memory_plan
    from toast.hf.model.checkpoint import Checkpoint

    R.decoder("llama").to(torch.bfloat16).save_pretrained(tmp_path)
    checkpoint = Checkpoint(tmp_path)
    monkeypatch.setattr(compute, "native_matmul", lambda dtype, device="cpu": True)
    narrow = memory_plan(checkpoint, "1GiB").in_memory
    monkeypatch.setattr(compute, "native_matmul", lambda dtype, device="cpu": False)
    assert memory_plan(checkpoint, "1GiB").in_memory == pytest.approx(2 * narrow, abs=2)
    assert memory_plan(checkpoint, "1GiB", compute="checkpoint").in_memory == narrow
