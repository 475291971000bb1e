"""ReplaceMe from a checkpoint on disk equals ReplaceMe in memory: the same
cut, the same transform, and a pruned checkpoint written without loading
the model that equals ``save_pretrained`` of the in-memory result tensor
for tensor (and so gives the same logits). An interrupted run leaves
neither temporary files nor a partial output folder."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from tests._helpers import replaceme_models as R  # noqa: E402
from toast.methods.replaceme import NotFoldableError, replaceme  # noqa: E402
from toast.methods.replaceme.from_disk import replaceme_from_disk  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


def _gemma3() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        hidden_size=R.HIDDEN,
        num_hidden_layers=R.LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=R.VOCAB,
        intermediate_size=R.FFN,
        sliding_window=4,  # shorter than the sequences: the sliding layers see less
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.Gemma3ForCausalLM(config).eval()


MODELS = {
    "llama": lambda: R.decoder("llama"),
    "qwen2": lambda: R.decoder("qwen2"),
    "gpt2": lambda: R.decoder("gpt2"),
}


def _tensors(folder) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _assert_same_tensors(written, saved) -> None:
    a, b = _tensors(written), _tensors(saved)
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key


def _run_both(model, data, tmp_path, shard: str | None = None, **params):
    source = tmp_path / "source"
    model.save_pretrained(source, **({"max_shard_size": shard} if shard else {}))
    written = tmp_path / "written"
    # the in-memory path's predicted-error candidates are not made from disk
    params.setdefault("predicted_candidates", 0)
    # every batch fits: in memory no block placement is measured against the fold
    params.setdefault("check_fraction", 0.0)
    report = replaceme_from_disk(source, data, written, progress=False, **params)
    pruned, expected = replaceme(model, data, progress=False, **params)
    saved = tmp_path / "saved"
    pruned.save_pretrained(saved)
    return report, expected, pruned, written, saved


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_checkpoint_written_from_disk_equals_save_pretrained_of_in_memory_result(name, tmp_path):
    data = R.text_loader()
    report, expected, pruned, written, saved = _run_both(
        MODELS[name](), data, tmp_path, num_blocks=2
    )
    assert report.spans == expected.spans
    assert _rel(report.transforms[0], expected.transforms[0]) <= 1e-6
    _assert_same_tensors(written, saved)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(written).eval()
    assert reloaded.config.num_hidden_layers == R.LAYERS - 2
    assert getattr(reloaded.config, "layer_types", None) == getattr(
        pruned.config, "layer_types", None
    )
    assert torch.equal(R.outputs(reloaded, data[0]), R.outputs(pruned, data[0]))


def test_gemma3_sliding_window_layers_from_disk_give_the_in_memory_cut_and_transform(tmp_path):
    # Gemma 3 normalises the MLP output (post-feedforward norm): a full T cannot
    # be folded, so it is estimated on the residual stream (placement="block")
    model, data = _gemma3(), R.text_loader()
    source = tmp_path / "source"
    model.save_pretrained(source)
    report = replaceme_from_disk(source, data, num_blocks=2, placement="block", progress=False)
    _, expected = replaceme(model, data, num_blocks=2, placement="block", progress=False)
    assert report.spans == expected.spans
    assert _rel(report.transforms[0], expected.transforms[0]) <= 1e-6


def test_unfoldable_block_is_refused_from_disk_as_in_memory(tmp_path):
    # asked for explicitly: the default (placement="auto") folds a diagonal T
    _gemma3().save_pretrained(tmp_path / "source")
    with pytest.raises(NotFoldableError, match="structure=.diagonal."):
        replaceme_from_disk(
            tmp_path / "source",
            R.text_loader(),
            tmp_path / "out",
            num_blocks=2,
            placement="fold",
            structure="full",
            progress=False,
        )
    assert not (tmp_path / "out").exists()


def test_sharded_checkpoint_with_two_cuts_is_written_with_a_new_index(tmp_path):
    data = R.text_loader()
    report, expected, _, written, saved = _run_both(
        R.decoder("llama"),
        data,
        tmp_path,
        shard="20KB",
        num_blocks=2,
        num_cuts=2,
        adjacent="forbid",
    )
    assert len(report.spans) == 2 and report.spans == expected.spans
    assert len(list(written.glob("*.safetensors"))) > 1
    assert (written / "model.safetensors.index.json").is_file()
    for got, want in zip(report.transforms, expected.transforms, strict=True):
        assert _rel(got, want) <= 1e-6
    _assert_same_tensors(written, saved)


def test_cosine_objective_from_disk_equals_in_memory(tmp_path):
    data = R.text_loader()
    report, expected, _, _, _ = _run_both(
        R.decoder("llama"), data, tmp_path, num_blocks=2, objective="cosine", epochs=2
    )
    assert report.spans == expected.spans
    assert _rel(report.transforms[0], expected.transforms[0]) <= 1e-6


@pytest.mark.parametrize("structure", ["rotated_diagonal", "patch_ridge"])
def test_linearpatch_form_from_disk_equals_in_memory(structure, tmp_path):
    data = R.text_loader()
    report, expected, _, written, saved = _run_both(
        R.decoder("llama"), data, tmp_path, num_blocks=2, structure=structure
    )
    assert report.spans == expected.spans
    assert _rel(report.transforms[0], expected.transforms[0]) <= 1e-6
    _assert_same_tensors(written, saved)


def test_prenorm_encoder_from_disk_gives_the_in_memory_cut_and_transform(tmp_path):
    model, data = R.encoder("vit"), R.image_loader()
    report, expected, pruned, written, saved = _run_both(model, data, tmp_path, num_blocks=2)
    assert report.spans == expected.spans
    assert _rel(report.transforms[0], expected.transforms[0]) <= 1e-6
    _assert_same_tensors(written, saved)
    reloaded = transformers.ViTModel.from_pretrained(written, add_pooling_layer=False).eval()
    assert reloaded.config.num_hidden_layers == R.LAYERS - 2
    assert torch.equal(R.outputs(reloaded, data[0]), R.outputs(pruned, data[0]))


def test_tokenizer_and_generation_files_are_copied(tmp_path):
    model = R.decoder("llama")
    source = tmp_path / "source"
    model.save_pretrained(source)
    (source / "tokenizer.json").write_text("{}")
    (source / "chat_template.jinja").write_text("{{ messages }}")
    written = tmp_path / "written"
    replaceme_from_disk(source, R.text_loader(), written, num_blocks=2, progress=False)
    assert (written / "tokenizer.json").read_text() == "{}"
    assert (written / "chat_template.jinja").is_file()
    assert (written / "generation_config.json").is_file()


def test_interrupted_calibration_leaves_no_temporary_files_and_no_output(tmp_path):
    model = R.decoder("llama")
    source = tmp_path / "source"
    model.save_pretrained(source)
    buffers = tmp_path / "buffers"
    buffers.mkdir()
    handle = R.interrupt_after(20)  # 6 batches a block: inside block 3
    try:
        with pytest.raises(KeyboardInterrupt):
            replaceme_from_disk(
                source,
                R.text_loader(),
                tmp_path / "out",
                num_blocks=2,
                progress=False,
                buffer_dir=buffers,
            )
    finally:
        handle.remove()
    assert list(buffers.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["buffers", "source"]


def test_interrupted_write_leaves_no_partial_output_folder(tmp_path, monkeypatch):
    import toast.io.pruned as pruned

    model = R.decoder("llama")
    source = tmp_path / "source"
    model.save_pretrained(source, max_shard_size="20KB")
    calls = []
    copy = pruned._copy_range

    def copy_then_interrupt(*args):
        calls.append(args)
        if len(calls) == 5:
            raise KeyboardInterrupt
        copy(*args)

    monkeypatch.setattr(pruned, "_copy_range", copy_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        replaceme_from_disk(source, R.text_loader(), tmp_path / "out", num_blocks=2, progress=False)
    assert len(calls) == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]


def test_existing_output_folder_is_refused_before_any_pass(tmp_path):
    model = R.decoder("llama")
    model.save_pretrained(tmp_path / "source")
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError, match="exists"):
        replaceme_from_disk(
            tmp_path / "source", R.text_loader(), tmp_path / "out", num_blocks=2, progress=False
        )


def test_placement_other_than_fold_cannot_be_written(tmp_path):
    R.decoder("llama").save_pretrained(tmp_path / "source")
    with pytest.raises(ValueError, match="placement='fold'"):
        replaceme_from_disk(
            tmp_path / "source", R.text_loader(), tmp_path / "out", num_blocks=2, placement="mlp"
        )


def test_bf16_checkpoint_calibrated_in_float32_is_written_in_bf16_as_the_float32_model_prunes(
    tmp_path,
):
    # Computed in float32, a 16-bit checkpoint is widened block by block:
    # the cut and transform are those of the model loaded in float32, and
    # the pruned checkpoint keeps the weights' dtype.
    data = R.text_loader()
    source = tmp_path / "source"
    R.decoder("llama").to(torch.bfloat16).save_pretrained(source)
    widened = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    options = {"num_blocks": 2, "check_fraction": 0.0, "progress": False}
    _, expected = replaceme(widened.eval(), data, predicted_candidates=0, **options)
    report = replaceme_from_disk(
        source, data, tmp_path / "written", compute_dtype="float32", **options
    )
    assert report.spans == expected.spans
    assert _rel(report.transforms[0], expected.transforms[0]) <= 1e-6
    written = _tensors(tmp_path / "written")
    assert {t.dtype for t in written.values()} == {torch.bfloat16}
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "written")
    assert reloaded.config.num_hidden_layers == R.LAYERS - 2
