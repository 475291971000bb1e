"""Block-by-block streaming from a checkpoint on disk hands its consumer
exactly the states the in-memory hooks see: the same tensors, bit for bit,
for every state of every batch, with the model's own masks, rotary
embeddings and per-layer attention types."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests._helpers import replaceme_models as R  # noqa: E402
from toast.hf.capture.sequential import DiskModel, stream_blocks  # noqa: E402
from toast.hf.capture.states import stream_states  # noqa: E402
from toast.hf.data.calibration import Calibration  # noqa: E402
from toast.hf.model.checkpoint import Checkpoint  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

QUIET = Calibration(progress=False)


def _gemma3():
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=R.VOCAB,
        intermediate_size=64,
        sliding_window=3,
        pad_token_id=0,
    )
    return transformers.Gemma3ForCausalLM(config).eval()


CASES = {
    "llama": lambda: (R.decoder("llama"), R.text_loader(16)),
    "mistral_sliding": lambda: (R.decoder("mistral"), R.text_loader(16)),
    "gemma3": lambda: (_gemma3(), R.text_loader(16)),
    "gpt2": lambda: (R.decoder("gpt2"), R.text_loader(16)),
    "vit": lambda: (R.encoder("vit"), R.image_loader(16)),
}


def _in_memory(model, data) -> dict[int, list[torch.Tensor]]:
    states: dict[int, list[torch.Tensor]] = {}

    def consume(rows, mask):
        for k, r in enumerate(rows):
            states.setdefault(k, []).append(r.clone())
        return 0

    stream_states(model, data, consume, QUIET, tokens="all")
    return states


@pytest.mark.parametrize("name", sorted(CASES))
def test_streamed_states_from_disk_equal_in_memory_states_bit_for_bit(name, tmp_path):
    model, data = CASES[name]()
    model.save_pretrained(tmp_path)
    expected = _in_memory(model, data)
    got: dict[int, list[torch.Tensor]] = {}

    def on_state(state, batch, hidden, mask):
        got.setdefault(state, []).append(hidden.clone())

    stream_blocks(DiskModel.open(tmp_path), data, on_state, QUIET)
    assert sorted(got) == sorted(expected)
    for k in expected:
        assert all(torch.equal(a, b) for a, b in zip(got[k], expected[k], strict=True)), k


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("per", [1, 3])
def test_a_forward_on_fewer_rows_at_once_gives_the_whole_batchs_states(name, per, tmp_path):
    # batches of 8 padded rows cut into runs of `per` (3: a shorter last run),
    # with each row's mask, positions and rotary tables cut alike
    model, data = CASES[name]()
    model.save_pretrained(tmp_path)
    whole = _streamed(DiskModel.open(tmp_path), data)
    disk = DiskModel.open(tmp_path)
    disk.rows_at_once = per
    cut = _streamed(disk, data)
    assert sorted(cut) == sorted(whole)
    for k in whole:
        for a, b in zip(cut[k], whole[k], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{name} state {k}")


def test_stream_stops_after_the_requested_block_and_removes_its_buffer(tmp_path):
    model, data = CASES["llama"]()
    model.save_pretrained(tmp_path / "model")
    buffers = tmp_path / "buffers"
    buffers.mkdir()
    states = set()
    stream_blocks(
        DiskModel.open(tmp_path / "model"),
        data,
        lambda k, b, h, m: states.add(k),
        QUIET,
        upto=2,
        buffer_dir=buffers,
    )
    assert states == {0, 1, 2}
    assert list(buffers.iterdir()) == []


def test_blocks_are_freed_after_they_run(tmp_path):
    model, data = CASES["llama"]()
    model.save_pretrained(tmp_path)
    disk = DiskModel.open(tmp_path)
    stream_blocks(disk, data, lambda *a: None, QUIET)
    assert all(p.is_meta for p in disk.stack.blocks.parameters())


def test_folder_without_config_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        Checkpoint(tmp_path)


def test_pickled_weights_are_refused_with_the_fix(tmp_path):
    R.decoder("llama").save_pretrained(tmp_path)
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ValueError, match="save_pretrained"):
        Checkpoint(tmp_path)


def test_checkpoint_reads_tensors_equal_to_the_saved_ones(tmp_path):
    model = R.decoder("llama")
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    checkpoint = Checkpoint(tmp_path)
    assert len(checkpoint.shards) > 1
    state = model.state_dict()
    for key in checkpoint.tensors:
        assert torch.equal(checkpoint.read(key), state[key]), key


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_recorded_block_inputs_hold_no_kv_cache(name, tmp_path):
    # A KV cache recorded with block 0's inputs would be appended to by
    # every later block: a block's worth of memory kept per block run.
    model, data = CASES[name]()
    model.save_pretrained(tmp_path)
    disk = DiskModel.open(tmp_path)
    caches: list[str] = []

    def look(module, args, kwargs):
        caches.extend(k for k, v in kwargs.items() if isinstance(v, transformers.Cache))

    handles = [b.register_forward_pre_hook(look, with_kwargs=True) for b in disk.stack.blocks]
    try:
        stream_blocks(disk, data, lambda *a: None, QUIET)
    finally:
        for h in handles:
            h.remove()
    assert caches == []


def _bf16_llama(tmp_path):
    model, data = CASES["llama"]()
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    widened = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    return widened.eval(), data


def _streamed(disk, data) -> dict[int, list[torch.Tensor]]:
    got: dict[int, list[torch.Tensor]] = {}
    stream_blocks(disk, data, lambda k, b, h, m: got.setdefault(k, []).append(h.clone()), QUIET)
    return got


def test_bf16_checkpoint_computes_in_float32_equal_to_the_model_loaded_in_float32(tmp_path):
    widened, data = _bf16_llama(tmp_path)
    expected = _in_memory(widened, data)
    disk = DiskModel.open(tmp_path, compute="float32")
    assert disk.dtype == torch.float32 and disk.checkpoint.dtype == torch.bfloat16
    got = _streamed(disk, data)
    for k in expected:
        assert all(torch.equal(a, b) for a, b in zip(got[k], expected[k], strict=True)), k


def test_compute_dtype_checkpoint_keeps_bf16(tmp_path):
    _bf16_llama(tmp_path)
    disk = DiskModel.open(tmp_path, compute="checkpoint")
    got = _streamed(disk, R.text_loader(16))
    assert disk.dtype == torch.bfloat16
    assert {t.dtype for ts in got.values() for t in ts} == {torch.bfloat16}


def test_unknown_compute_dtype_names_the_choices(tmp_path):
    _bf16_llama(tmp_path)
    with pytest.raises(ValueError, match="'auto', 'float32', 'bfloat16', 'checkpoint'"):
        DiskModel.open(tmp_path, compute="half")
