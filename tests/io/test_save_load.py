"""Saving patched models (safetensors + JSON plan) and loading them back."""

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
hf_models = pytest.importorskip("tests._helpers.hf_models")
safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

import toast  # noqa: E402
from tests._helpers.kinds import translator_of  # noqa: E402
from toast import io as tio  # noqa: E402
from toast.core import kinds as table  # noqa: E402
from toast.io import CorruptedSaveError, load_pretrained, save_pretrained  # noqa: E402
from toast.io import save as tio_save  # noqa: E402
from toast.translators import DiagonalMap, MLPTranslator, ResMLPTranslator  # noqa: E402

transformers = hf_models.transformers
FAMILIES = hf_models.FAMILIES
IDS = [f.name for f in FAMILIES]
D = hf_models.HIDDEN
REPO = Path(__file__).resolve().parents[2]
KINDS = ["linear", "identity", "diagonal", "mlp", "resmlp", "linear_nobias"]


def _translator(kind: str, seed: int) -> torch.nn.Module:
    """A translator module of ``kind`` with random (seeded) parameters."""
    module = {
        "linear": lambda: torch.nn.Linear(D, D),
        "linear_nobias": lambda: torch.nn.Linear(D, D, bias=False),
        "identity": torch.nn.Identity,
        "diagonal": lambda: DiagonalMap(torch.ones(D), torch.zeros(D)),
        "mlp": lambda: MLPTranslator(D),
        "resmlp": lambda: ResMLPTranslator(D),
    }[kind]()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return module


def _patched(family, index: int = 0) -> torch.nn.Module:
    """A tiny model of ``family`` with two spans replaced by translators of
    two kinds (rotating over KINDS with ``index``), in eval mode."""
    model = hf_models.build(family)
    # [T, T, block 3] or [block 0, T, T]: kept blocks renumbered or not
    spans = [(0, 1), (1, 3)] if index % 2 == 0 else [(1, 3), (3, 4)]
    kinds = [KINDS[(2 * index) % len(KINDS)], KINDS[(2 * index + 1) % len(KINDS)]]
    modules = [_translator(kind, seed=10 * index + k) for k, kind in enumerate(kinds)]
    toast.io.replace_spans(model, spans, modules)
    return model.eval()  # new translator modules start in training mode (dropout)


def _inputs(family) -> dict:
    batch = hf_models.loader(family, 4, batch_size=4)[0]
    return batch if isinstance(batch, dict) else {"pixel_values": batch}


def _forward(model, inputs) -> torch.Tensor:
    with torch.inference_mode():
        return model(**inputs).last_hidden_state


def _vit_save(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    model = _patched(FAMILIES[0])
    path = save_pretrained(model, tmp_path / "vit")
    return path, model


def _edit_plan(path: Path, edit) -> None:
    file = path / tio.PLAN_NAME
    plan = json.loads(file.read_text())
    edit(plan)
    file.write_text(json.dumps(plan))


def _rewrite_weights(path: Path, edit) -> None:
    """Rewrites model.safetensors through ``edit(tensors)`` and records the
    new size in the plan, so that only the tensors are inconsistent."""
    file = path / tio.WEIGHTS_NAME
    tensors = safetensors_torch.load_file(str(file))
    edit(tensors)
    safetensors_torch.save_file(tensors, str(file))
    _edit_plan(path, lambda plan: plan["weights"].update(bytes=file.stat().st_size))


def _buffer_dtypes(model) -> dict:
    return {name: b.dtype for name, b in model.named_buffers()}


def _hidden_entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("index,family", list(enumerate(FAMILIES)), ids=IDS)
def test_reloaded_patched_model_gives_identical_outputs(tmp_path, index, family):
    model = _patched(family, index)
    inputs = _inputs(family)
    save_pretrained(model, tmp_path / "saved")
    loaded = load_pretrained(tmp_path / "saved")
    assert torch.equal(_forward(loaded, inputs), _forward(model, inputs))
    assert type(loaded) is type(model)
    assert len(toast.hf.find_blocks(loaded).blocks) == len(toast.hf.find_blocks(model).blocks)


def test_reload_in_a_fresh_process_gives_identical_outputs(tmp_path):
    inputs, expected = {}, {}
    for index, family in enumerate(FAMILIES):
        model = _patched(family, index)
        batch = _inputs(family)
        save_pretrained(model, tmp_path / family.name)
        inputs.update({f"{family.name}.{k}": v for k, v in batch.items()})
        expected[family.name] = _forward(model, batch)
    safetensors_torch.save_file(inputs, str(tmp_path / "inputs.safetensors"))
    script = (
        "import sys, torch\n"
        "from safetensors.torch import load_file, save_file\n"
        "import toast.io\n"
        "torch.set_num_threads(1)\n"
        "root, names = sys.argv[1], sys.argv[2:]\n"
        "inputs = load_file(f'{root}/inputs.safetensors')\n"
        "out = {}\n"
        "for name in names:\n"
        "    model = toast.io.load_pretrained(f'{root}/{name}')\n"
        "    kw = {k.split('.', 1)[1]: v for k, v in inputs.items() if k.startswith(name + '.')}\n"
        "    with torch.inference_mode():\n"
        "        out[name] = model(**kw).last_hidden_state.contiguous()\n"
        "save_file(out, f'{root}/outputs.safetensors')\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path), *IDS],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    outputs = safetensors_torch.load_file(str(tmp_path / "outputs.safetensors"))
    differ = [name for name in IDS if not torch.equal(outputs[name], expected[name])]
    assert differ == []


@pytest.mark.parametrize("head", ["gpt2", "llama"])
def test_tied_embeddings_are_stored_once_and_stay_tied(tmp_path, head):
    torch.manual_seed(0)
    if head == "gpt2":
        config = transformers.GPT2Config(vocab_size=97, n_embd=D, n_layer=4, n_head=4)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            vocab_size=97,
            hidden_size=D,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            tie_word_embeddings=True,
        )
        model = transformers.LlamaForCausalLM(config)
    toast.io.replace_spans(model, [(1, 3)], [_translator("linear", 0)])
    model.eval()
    ids = hf_models.pad(hf_models.sentences(3))
    save_pretrained(model, tmp_path / "lm")
    loaded = load_pretrained(tmp_path / "lm")
    with torch.inference_mode():
        assert torch.equal(loaded(**ids).logits, model(**ids).logits)
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    stored = safetensors_torch.load_file(str(tmp_path / "lm" / tio.WEIGHTS_NAME))
    assert len(stored) == len(model.state_dict()) - 1


def test_unpatched_model_round_trips_with_a_plan_of_blocks_only(tmp_path):
    family = next(f for f in FAMILIES if f.name == "bert")
    model = hf_models.build(family)
    inputs = _inputs(family)
    save_pretrained(model, tmp_path / "bert")
    plan = json.loads((tmp_path / "bert" / tio.PLAN_NAME).read_text())
    assert plan["layout"] == [{"type": "block"}] * hf_models.LAYERS
    assert torch.equal(
        _forward(load_pretrained(tmp_path / "bert"), inputs), _forward(model, inputs)
    )


def test_saved_dtype_is_restored(tmp_path):
    family = next(f for f in FAMILIES if f.name == "llama")
    model = _patched(family, 3).to(torch.bfloat16)
    inputs = _inputs(family)
    save_pretrained(model, tmp_path / "bf16")
    loaded = load_pretrained(tmp_path / "bf16")
    assert loaded.dtype == torch.bfloat16
    assert _buffer_dtypes(loaded) == _buffer_dtypes(model)  # rotary inv_freq included
    assert torch.equal(_forward(loaded, inputs), _forward(model, inputs))


def test_float32_rotary_buffers_of_a_bfloat16_model_are_restored(tmp_path):
    family = next(f for f in FAMILIES if f.name == "llama")
    model = _patched(family, 3)
    rotary = {name: b.clone() for name, b in model.named_buffers() if "inv_freq" in name}
    model.to(torch.bfloat16)
    for name, value in rotary.items():  # kept in float32, as mixed-precision setups do
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._buffers[attr] = value
    inputs = _inputs(family)
    save_pretrained(model, tmp_path / "mixed")
    loaded = load_pretrained(tmp_path / "mixed")
    assert _buffer_dtypes(loaded) == _buffer_dtypes(model)
    assert torch.equal(_forward(loaded, inputs), _forward(model, inputs))


def test_dtype_and_device_options_cast_and_move_the_loaded_model(tmp_path):
    path, model = _vit_save(tmp_path)
    loaded = load_pretrained(path, device="cpu", dtype="float64")
    assert {p.dtype for p in loaded.parameters()} == {torch.float64}
    assert {p.device.type for p in loaded.parameters()} == {"cpu"}
    inputs = _inputs(FAMILIES[0])
    out = _forward(loaded, {"pixel_values": inputs["pixel_values"].double()})
    assert torch.allclose(out.float(), _forward(model, inputs), atol=1e-4)


def test_loaded_model_is_in_eval_mode(tmp_path):
    model = _patched(FAMILIES[0])
    model.train()
    save_pretrained(model, tmp_path / "m")
    assert not any(m.training for m in load_pretrained(tmp_path / "m").modules())


def test_plan_records_format_version_and_a_summary(tmp_path):
    path, model = _vit_save(tmp_path)
    plan = json.loads((path / tio.PLAN_NAME).read_text())
    assert plan["format"] == tio.FORMAT and plan["format_version"] == tio.FORMAT_VERSION
    summary = plan["summary"]
    assert summary["toast_version"] == toast.__version__
    assert summary["spans"] == [[0, 1], [1, 3]]
    assert summary["translator_kinds"] == {"linear": 1, "identity": 1}
    assert summary["parameters"] == sum(p.numel() for p in model.parameters())
    assert (summary["blocks"], summary["original_blocks"]) == (3, 4)
    assert plan["model_class"] == {
        "module": "transformers.models.vit.modeling_vit",
        "name": "ViTModel",
    }
    assert plan["config"]["num_hidden_layers"] == 3
    assert [e["type"] for e in plan["layout"]] == ["translator", "translator", "block"]


def _save_kind(kind: str, path: Path) -> tuple[torch.nn.Module, dict]:
    """A tiny ViT with one span replaced by a translator of ``kind``, saved
    at ``path``; the model and the plan written."""
    model = hf_models.build(FAMILIES[0])
    toast.io.replace_spans(model, [(1, 3)], [translator_of(kind, D)])
    save_pretrained(model.eval(), path)
    return model, json.loads((path / tio.PLAN_NAME).read_text())


def _translator_kinds(plan: dict) -> list[str]:
    return [e["translator"]["kind"] for e in plan["layout"] if e["type"] == "translator"]


@pytest.mark.parametrize("kind", list(table.KINDS))
def test_every_kind_is_saved_and_reloaded_under_its_own_name(tmp_path, kind):
    _, plan = _save_kind(kind, tmp_path / "m")
    assert _translator_kinds(plan) == [kind]
    loaded = load_pretrained(tmp_path / "m")
    save_pretrained(loaded, tmp_path / "again")
    assert _translator_kinds(json.loads((tmp_path / "again" / tio.PLAN_NAME).read_text())) == [kind]


def test_a_kind_added_to_the_table_saves_and_reloads_with_identical_outputs(tmp_path, monkeypatch):
    monkeypatch.setitem(table.KINDS, "made_up", table.Kind("made_up", "linear", bias=True))
    model, plan = _save_kind("made_up", tmp_path / "m")
    assert _translator_kinds(plan) == ["made_up"]
    inputs = _inputs(FAMILIES[0])
    assert torch.equal(_forward(load_pretrained(tmp_path / "m"), inputs), _forward(model, inputs))


def test_saving_to_an_existing_path_raises_file_exists_error(tmp_path):
    path, model = _vit_save(tmp_path)
    with pytest.raises(FileExistsError, match="overwrite=True") as info:
        save_pretrained(model, path)
    assert info.value.filename == str(path)


def test_overwrite_replaces_an_existing_save(tmp_path):
    path, _ = _vit_save(tmp_path)
    other = _patched(FAMILIES[0], index=1)
    save_pretrained(other, path, overwrite=True)
    inputs = _inputs(FAMILIES[0])
    assert torch.equal(_forward(load_pretrained(path), inputs), _forward(other, inputs))
    assert _hidden_entries(tmp_path) == []


def test_overwrite_without_atomic_exchange_replaces_an_existing_save(tmp_path, monkeypatch):
    monkeypatch.setattr(tio_save, "_exchange", lambda a, b: False)
    path, _ = _vit_save(tmp_path)
    other = _patched(FAMILIES[0], index=1)
    save_pretrained(other, path, overwrite=True)
    inputs = _inputs(FAMILIES[0])
    assert torch.equal(_forward(load_pretrained(path), inputs), _forward(other, inputs))
    assert _hidden_entries(tmp_path) == []


def test_overwrite_refuses_a_directory_that_is_not_a_save(tmp_path):
    precious = tmp_path / "notes"
    precious.mkdir()
    (precious / "todo.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a toast save"):
        save_pretrained(_patched(FAMILIES[0]), precious, overwrite=True)
    assert (precious / "todo.txt").read_text() == "keep me"


def _fail_weights(tensors, file):
    file.write_bytes(b"partial")
    raise KeyboardInterrupt


def _fail_plan(plan, file):
    file.write_text(json.dumps(plan)[:50])
    raise OSError("disk full")


def _interrupt_plan(plan, file):
    raise KeyboardInterrupt


@pytest.mark.parametrize(
    "hook,fake",
    [
        ("_write_weights", _fail_weights),
        ("_write_plan", _fail_plan),
        ("_write_plan", _interrupt_plan),
    ],
    ids=["weights-interrupted", "plan-oserror", "plan-interrupted"],
)
def test_interrupted_save_leaves_nothing_at_path(tmp_path, monkeypatch, hook, fake):
    monkeypatch.setattr(tio_save, hook, fake)
    with pytest.raises((KeyboardInterrupt, OSError)):
        save_pretrained(_patched(FAMILIES[0]), tmp_path / "m")
    assert not (tmp_path / "m").exists()
    assert _hidden_entries(tmp_path) == []
    with pytest.raises(FileNotFoundError):
        load_pretrained(tmp_path / "m")


def test_interrupted_overwrite_keeps_the_old_save_loadable(tmp_path, monkeypatch):
    path, model = _vit_save(tmp_path)
    monkeypatch.setattr(tio_save, "_write_plan", _interrupt_plan)
    with pytest.raises(KeyboardInterrupt):
        save_pretrained(_patched(FAMILIES[0], index=1), path, overwrite=True)
    inputs = _inputs(FAMILIES[0])
    assert torch.equal(_forward(load_pretrained(path), inputs), _forward(model, inputs))
    assert _hidden_entries(tmp_path) == []


def test_interrupted_fallback_swap_puts_the_old_save_back(tmp_path, monkeypatch):
    path, model = _vit_save(tmp_path)
    monkeypatch.setattr(tio_save, "_exchange", lambda a, b: False)
    real_rename, calls = os.rename, []

    def rename(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # old save moved aside; moving the new one in fails
            raise KeyboardInterrupt
        real_rename(src, dst)

    monkeypatch.setattr(tio_save.os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        save_pretrained(_patched(FAMILIES[0], index=1), path, overwrite=True)
    monkeypatch.setattr(tio_save.os, "rename", real_rename)
    inputs = _inputs(FAMILIES[0])
    assert torch.equal(_forward(load_pretrained(path), inputs), _forward(model, inputs))
    assert _hidden_entries(tmp_path) == []


def test_leftover_temp_directory_of_a_killed_save_is_not_a_model(tmp_path):
    path, model = _vit_save(tmp_path)
    leftover = tmp_path / ".m.tmp-deadbeef"  # a save killed before its plan was written
    leftover.mkdir()
    (leftover / tio.WEIGHTS_NAME).write_bytes((path / tio.WEIGHTS_NAME).read_bytes())
    with pytest.raises(CorruptedSaveError, match=f"{tio.PLAN_NAME} is missing"):
        load_pretrained(leftover)
    save_pretrained(model, tmp_path / "m")
    assert load_pretrained(tmp_path / "m") is not None
    assert (leftover / tio.WEIGHTS_NAME).exists()  # a save never touches others' temp dirs


def _truncate(path):
    file = path / tio.WEIGHTS_NAME
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _garbage_weights(path):
    file = path / tio.WEIGHTS_NAME
    file.write_bytes(b"\xff" * file.stat().st_size)  # right size, no valid header


def _drop_tensor(path):
    _rewrite_weights(path, lambda t: t.pop("layers.2.mlp.fc2.weight"))


def _extra_tensor(path):
    _rewrite_weights(path, lambda t: t.update(stray=torch.zeros(2)))


def _wrong_shape(path):
    _rewrite_weights(path, lambda t: t.update({"layernorm.weight": torch.zeros(D + 1)}))


def _set_layout_kind(plan):
    plan["layout"][0]["translator"]["kind"] = "conv"


CORRUPTIONS = {
    "truncated-weights": (_truncate, tio.WEIGHTS_NAME, "bytes but the plan records"),
    "garbage-weights": (_garbage_weights, tio.WEIGHTS_NAME, "not a readable safetensors file"),
    "missing-weights": (lambda p: (p / tio.WEIGHTS_NAME).unlink(), tio.WEIGHTS_NAME, "missing"),
    "missing-tensor": (_drop_tensor, tio.WEIGHTS_NAME, "lacks the tensors"),
    "extra-tensor": (_extra_tensor, tio.WEIGHTS_NAME, "does not have: 'stray'"),
    "shape-mismatch": (_wrong_shape, tio.WEIGHTS_NAME, r"shape \[33\], the model expects \[32\]"),
    "no-plan": (lambda p: (p / tio.PLAN_NAME).unlink(), tio.PLAN_NAME, "is missing"),
    "garbage-json": (
        lambda p: (p / tio.PLAN_NAME).write_text('{"format": '),
        tio.PLAN_NAME,
        "not valid JSON",
    ),
    "plan-not-an-object": (
        lambda p: (p / tio.PLAN_NAME).write_text("[1, 2]"),
        tio.PLAN_NAME,
        "not a JSON object",
    ),
    "plan-missing-keys": (
        lambda p: _edit_plan(p, lambda plan: plan.pop("layout")),
        tio.PLAN_NAME,
        r"lacks the keys \['layout'\]",
    ),
    "no-format-version": (
        lambda p: _edit_plan(p, lambda plan: plan.pop("format_version")),
        tio.PLAN_NAME,
        "format version None",
    ),
    "unknown-format-version": (
        lambda p: _edit_plan(p, lambda plan: plan.update(format_version=99)),
        tio.PLAN_NAME,
        "format version 99",
    ),
    "unknown-translator-kind": (
        lambda p: _edit_plan(p, _set_layout_kind),
        tio.PLAN_NAME,
        "unknown translator kind 'conv'",
    ),
    "layout-length-mismatch": (
        lambda p: _edit_plan(p, lambda plan: plan["layout"].append({"type": "block"})),
        tio.PLAN_NAME,
        "lists 4",
    ),
}


@pytest.mark.parametrize("damage,file,match", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_damaged_save_raises_an_error_naming_the_file(tmp_path, damage, file, match):
    path, _ = _vit_save(tmp_path)
    damage(path)
    with pytest.raises(CorruptedSaveError, match=match) as info:
        load_pretrained(path)
    assert str(path / file) in str(info.value)


def test_model_class_outside_transformers_is_refused_without_importing_it(tmp_path, monkeypatch):
    path, _ = _vit_save(tmp_path)
    (tmp_path / "evil.py").write_text("open(__file__ + '.imported', 'w').close()\nclass M: ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _edit_plan(path, lambda plan: plan.update(model_class={"module": "evil", "name": "M"}))
    with pytest.raises(ValueError, match="refusing to load model class evil.M"):
        load_pretrained(path)
    assert not (tmp_path / "evil.py.imported").exists()


def test_transformers_name_that_is_not_a_model_class_is_refused(tmp_path):
    path, _ = _vit_save(tmp_path)
    _edit_plan(
        path, lambda plan: plan.update(model_class={"module": "transformers", "name": "pipeline"})
    )
    with pytest.raises(ValueError, match="not a transformers model class"):
        load_pretrained(path)


def test_loading_never_unpickles(tmp_path, monkeypatch):
    path, model = _vit_save(tmp_path)

    def forbidden(*args, **kwargs):
        raise AssertionError("unpickling on the load path")

    for module, name in [
        (pickle, "load"),
        (pickle, "loads"),
        (pickle, "Unpickler"),
        (torch, "load"),
    ]:
        monkeypatch.setattr(module, name, forbidden)
    inputs = _inputs(FAMILIES[0])
    assert torch.equal(_forward(load_pretrained(path), inputs), _forward(model, inputs))


def test_saving_a_model_outside_transformers_raises_type_error(tmp_path):
    with pytest.raises(TypeError, match="Hugging Face transformers models"):
        save_pretrained(torch.nn.Sequential(torch.nn.Linear(2, 2)), tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


def test_unsupported_translator_module_is_refused_before_anything_is_written(tmp_path):
    model = hf_models.build(FAMILIES[0])
    toast.io.replace_spans(model, [(1, 3)], [torch.nn.Tanh()])
    with pytest.raises(TypeError, match="cannot describe a translator of type Tanh"):
        save_pretrained(model, tmp_path / "m")
    assert list(tmp_path.iterdir()) == []
