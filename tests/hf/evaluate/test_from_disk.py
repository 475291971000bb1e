"""Held-out quality measured block by block from a checkpoint on disk equals
the in-memory :class:`toast.hf.evaluate.quality.Evaluator`'s: for the original
model, for plain removal of blocks, and for blocks changed as they load,
with the checkpoint's blocks never all in memory."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests._helpers import replaceme_models as R  # noqa: E402
from toast.hf.capture.sequential import BlockEdits, DiskModel  # noqa: E402
from toast.hf.evaluate.from_disk import SequentialEvaluator  # noqa: E402
from toast.hf.evaluate.quality import Evaluator, skipped_blocks  # noqa: E402
from toast.hf.model.blocks import find_blocks  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

CASES = {
    "llama": lambda: (R.decoder("llama"), R.text_loader(16)),
    "gpt2": lambda: (R.decoder("gpt2"), R.text_loader(16)),
    "vit": lambda: (R.encoder("vit"), R.image_loader(16)),
}


def _both(name, tmp_path):
    model, data = CASES[name]()
    model.save_pretrained(tmp_path)
    return model, data, DiskModel.open(tmp_path)


@pytest.mark.parametrize("name", sorted(CASES))
def test_original_and_plain_removal_measured_from_disk_equal_in_memory(name, tmp_path):
    model, data, disk = _both(name, tmp_path)
    memory = Evaluator(data, progress=False)
    on_disk = SequentialEvaluator(disk, data, progress=False)
    assert on_disk.measure(disk.model) == pytest.approx(memory.measure(model), rel=1e-5)
    with skipped_blocks(find_blocks(model), [(1, 3)]):
        expected = memory.measure(model)
    got = on_disk.measure_edited(BlockEdits(skip=frozenset({1, 2})))
    assert got == pytest.approx(expected, rel=1e-5)
    assert (on_disk.metric, on_disk.count, on_disk.samples) == (
        memory.metric,
        memory.count,
        memory.samples,
    )


@pytest.mark.parametrize("name", ["llama", "gpt2", "vit"])
def test_fidelity_measured_from_disk_equals_in_memory(name, tmp_path):
    model, data, disk = _both(name, tmp_path)
    memory = Evaluator(data, progress=False, top_k=8)
    on_disk = SequentialEvaluator(disk, data, progress=False, top_k=8)
    memory.measure(model)
    on_disk.measure(disk.model)
    with skipped_blocks(find_blocks(model), [(1, 3)]):
        memory.measure(model)
    on_disk.measure_edited(BlockEdits(skip=frozenset({1, 2})))
    assert set(on_disk.last) == set(memory.last)
    for key, expected in memory.last.items():
        assert on_disk.last[key] == pytest.approx(expected, rel=1e-5, abs=1e-6), key


def test_blocks_changed_as_they_load_measure_as_the_changed_model_in_memory(tmp_path):
    model, data, disk = _both("llama", tmp_path)
    stack = find_blocks(model)
    scale = torch.full((R.HIDDEN,), 0.5)

    def halve(module, args, output):
        return output * scale

    handle = stack.blocks[3].register_forward_hook(halve)
    try:
        expected = Evaluator(data, progress=False).measure(model)
    finally:
        handle.remove()
    edits = BlockEdits(after={3: lambda hidden: hidden * scale})
    got = SequentialEvaluator(disk, data, progress=False).measure_edited(edits)
    assert got == pytest.approx(expected, rel=1e-5)


def test_at_most_one_block_holds_weights_while_the_heldout_data_is_measured(tmp_path):
    _, data, disk = _both("llama", tmp_path)
    loaded: list[int] = []

    def holding() -> int:
        return sum(any(not p.is_meta for p in b.parameters()) for b in disk.stack.blocks)

    load = disk.load_block

    def counting_load(index):
        block = load(index)
        loaded.append(holding())
        return block

    def head_forward(module, args):
        loaded.append(holding())

    disk.load_block = counting_load
    disk.model.register_forward_pre_hook(head_forward)
    SequentialEvaluator(disk, data, progress=False).measure(disk.model)
    assert max(loaded) == 1 and loaded[-1] == 0  # the head runs with no block loaded


# block calls: while embedding, while the blocks run, while the head runs
@pytest.mark.parametrize("calls", [3, 16, 30])
def test_an_interrupted_measurement_leaves_no_buffer_and_no_loaded_weights(calls, tmp_path):
    _, data, disk = _both("llama", tmp_path / "model")
    buffers = tmp_path / "buffers"
    buffers.mkdir()
    evaluator = SequentialEvaluator(disk, data, progress=False, buffer_dir=buffers)
    handle = R.interrupt_after(calls)
    try:
        with pytest.raises(KeyboardInterrupt):
            evaluator.measure(disk.model)
    finally:
        handle.remove()
    assert list(buffers.iterdir()) == []
    assert all(p.is_meta for p in disk.model.parameters())


def test_untied_input_embedding_is_never_loaded_for_the_heads_pass(tmp_path):
    # The replay hands the blocks' recorded outputs to the head: an input
    # embedding of its own (vocab x width, as large as the head) is not read.
    model, data, disk = _both("llama", tmp_path)
    assert not model.config.tie_word_embeddings
    seen = []
    handle = disk.model.lm_head.register_forward_pre_hook(
        lambda m, a: seen.append(disk.model.get_input_embeddings().weight.is_meta)
    )
    try:
        SequentialEvaluator(disk, data, progress=False).measure(disk.model)
    finally:
        handle.remove()
    assert seen and all(seen)


def test_batches_cut_to_bound_the_logits_measure_what_whole_batches_do(tmp_path, monkeypatch):
    import toast.hf.capture.budget as budget

    model, data, disk = _both("llama", tmp_path)
    expected = Evaluator(data, progress=False).measure(model)
    rows, tokens = data[0]["input_ids"].shape
    # room for one row's logits only: every batch goes to the head a row at a time
    monkeypatch.setattr(budget, "LOGIT_BYTES", tokens * model.config.vocab_size * 4)
    calls = []
    handle = disk.model.lm_head.register_forward_pre_hook(lambda m, a: calls.append(a[0].shape[0]))
    try:
        got = SequentialEvaluator(disk, data, progress=False).measure(disk.model)
    finally:
        handle.remove()
    assert rows > 1 and set(calls) == {1}
    assert len(calls) == sum(b["input_ids"].shape[0] for b in data)
    assert got == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_row_too_long_for_the_logit_bound_is_scored_in_runs_of_positions(
    name, tmp_path, monkeypatch
):
    import toast.hf.capture.budget as budget

    model, data, disk = _both(name, tmp_path)
    memory = Evaluator(data, progress=False, top_k=8)
    memory.measure(model)
    with skipped_blocks(find_blocks(model), [(1, 3)]):
        memory.measure(model)
    # room for three positions' logits: a row's go to the head three positions at a time
    monkeypatch.setattr(budget, "LOGIT_BYTES", 3 * model.config.vocab_size * 4)
    head = disk.model.get_output_embeddings()
    seen = []
    handle = head.register_forward_pre_hook(lambda m, a: seen.append(tuple(a[0].shape)))
    try:
        on_disk = SequentialEvaluator(disk, data, progress=False, top_k=8)
        on_disk.measure(disk.model)
        on_disk.measure_edited(BlockEdits(skip=frozenset({1, 2})))
    finally:
        handle.remove()
    runs = [shape[0] for shape in seen if len(shape) == 2]
    assert runs and max(runs) == 3  # runs of three positions (a shorter last)
    assert all(shape[1] == 1 for shape in seen if len(shape) == 3)  # never a row's logits whole
    for key, expected in memory.last.items():
        assert on_disk.last[key] == pytest.approx(expected, rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("name", ["llama", "gpt2", "gemma"])
def test_a_16bit_checkpoints_embedding_and_head_measure_as_the_widened_model(
    name, tmp_path, monkeypatch
):
    # A bf16 checkpoint computed in float32 keeps a plain embedding and head
    # in bf16 (half their memory), widening the looked-up rows and the head
    # a chunk of rows at a time: the scores are the float32 model's.
    import toast.hf.capture.disk_model as disk_model

    R.decoder(name).to(torch.bfloat16).save_pretrained(tmp_path)
    widened = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    data = R.text_loader(16)
    memory = Evaluator(data, progress=False, top_k=8)
    memory.measure(widened.eval())
    disk = DiskModel.open(tmp_path, compute="float32")
    head = disk.model.get_output_embeddings()
    # a chunk of 5 of the head's rows at a time
    monkeypatch.setattr(disk_model, "HEAD_CHUNK_BYTES", 5 * head.weight.shape[1] * 4)
    seen = []
    handle = head.register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))
    try:
        on_disk = SequentialEvaluator(disk, data, progress=False, top_k=8)
        on_disk.measure(disk.model)
    finally:
        handle.remove()
    narrow = name != "gemma"  # gemma scales its embedding in its forward: widened whole
    assert disk.narrow("output") is narrow and disk.narrow("input") is narrow
    assert set(seen) == {torch.bfloat16 if narrow else torch.float32}
    for key, expected in memory.last.items():
        assert on_disk.last[key] == pytest.approx(expected, rel=1e-5, abs=1e-6), key
    assert "forward" not in head.__dict__ and not head._forward_hooks  # released as it was


def test_the_plans_logit_bound_scores_what_the_default_bound_does(tmp_path):
    model, data, disk = _both("llama", tmp_path)
    memory = Evaluator(data, progress=False, top_k=8)
    memory.measure(model)
    disk.logit_bytes = 3 * model.config.vocab_size * 4  # what a tight plan sets
    seen = []
    head = disk.model.get_output_embeddings()
    handle = head.register_forward_pre_hook(lambda m, a: seen.append(tuple(a[0].shape)))
    try:
        on_disk = SequentialEvaluator(disk, data, progress=False, top_k=8)
        on_disk.measure(disk.model)
    finally:
        handle.remove()
    assert max(shape[0] for shape in seen if len(shape) == 2) == 3
    for key, expected in memory.last.items():
        assert on_disk.last[key] == pytest.approx(expected, rel=1e-5, abs=1e-6), key


def test_perplexity_alone_from_disk_equals_the_fidelity_passes_perplexity(tmp_path):
    # what the methods' checks and measured choices measure on disk, as in memory
    model, data, disk = _both("llama", tmp_path)
    full = SequentialEvaluator(disk, data, progress=False, top_k=8)
    alone = SequentialEvaluator(disk, data, progress=False, fidelity=False)
    edits = BlockEdits(skip=frozenset({1, 2}))
    for evaluator in (full, alone):
        evaluator.measure(disk.model)
        evaluator.measure_edited(edits)
    assert set(alone.last) == {"perplexity"} and "kl" in full.last
    assert alone.last["perplexity"] == full.last["perplexity"]
