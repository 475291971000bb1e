"""Every method × family (tiny configs) × save route × load route: the
reloaded model's outputs equal the compressed model's, bit for bit.

Save routes: ``toast.save_pretrained``, the compressed model's own
``model.save_pretrained``, and ``toast compress --out`` (TOAST on the image
families: the tiny text configs have no tokenizer to read a text file with;
the MiniLM CLI test in tests/cli covers text). Load routes, in this process
(toast imported): ``toast.load_pretrained``, the ``transformers`` Auto class
alone, and the Auto class with ``trust_remote_code=True`` (the folder's own
``toast_modeling.py``). Loads in a process where toast is not importable are
tested in test_fresh_process.py. The matrix is printed after the run
(tests/io/conftest.py).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

import toast  # noqa: E402
import toast.io.save  # noqa: E402
from tests._helpers import hf_models as H  # noqa: E402
from tests._helpers import replaceme_models as R  # noqa: E402
from tests._helpers.kinds import translator_of  # noqa: E402
from toast.cli import main  # noqa: E402
from toast.core.kinds import KINDS  # noqa: E402

pytestmark = [
    pytest.mark.hf,
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore::toast.core.IllConditionedWarning"),
]

_FAMILIES = {f.name: f for f in H.FAMILIES}
_TCS = {"fc1": [0.0, 0.25, 0.25, 0.25], "fc2": [0.0, 0.5, 0.5, 0.5]}


def _mae():
    cfg = transformers.ViTMAEConfig(
        image_size=H.IMAGE, patch_size=4, hidden_size=H.HIDDEN, num_hidden_layers=H.LAYERS,
        num_attention_heads=4, intermediate_size=64, mask_ratio=0.0,
    )  # fmt: skip
    return transformers.ViTMAEModel(cfg)


def _swin():
    cfg = transformers.SwinConfig(
        image_size=H.IMAGE, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
        window_size=4, mlp_ratio=2.0,
    )  # fmt: skip
    return transformers.SwinModel(cfg)


def _vision(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name in _FAMILIES:
        return H.build(_FAMILIES[name])
    return {"vit_mae": _mae, "swin": _swin}[name]().eval()


def _inputs(model: torch.nn.Module):
    """One deterministic batch the model eats."""
    config = model.config
    if getattr(config, "vocab_size", None) is not None and not hasattr(config, "image_size"):
        return R.text_loader(n=4, batch_size=4)[0]
    x = H.images(2)
    if config.model_type == "vit_mae":  # the identity order: no random shuffle
        n = (H.IMAGE // 4) ** 2
        return {"pixel_values": x, "noise": torch.arange(n, dtype=torch.float32).expand(2, n)}
    return {"pixel_values": x}


def _outputs(model: torch.nn.Module, batch) -> torch.Tensor:
    with torch.no_grad():
        out = model(**batch, **({"use_cache": False} if "input_ids" in batch else {}))
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _toast(name: str) -> torch.nn.Module:
    family = _FAMILIES[name]
    model = H.build(family)
    data = H.loader(family, 32, 8)
    return toast.compress(model, data, budget=1, progress=False)[0]


def _tiny(name: str) -> tuple[torch.nn.Module, list]:
    """The tiny encoder or decoder ``name`` and data it eats."""
    if name in R.ENCODERS:
        return R.encoder(name), R.image_loader()
    return R.decoder(name), R.text_loader()


def _replaceme(name: str) -> torch.nn.Module:
    model, data = _tiny(name)
    return toast.compress(model, data, method="replaceme", num_blocks=2, progress=False)[0]


def _toast_vit(name: str) -> torch.nn.Module:
    model = _vision(name)
    schedule = dict(_TCS, sample_ratio=0.5)
    return toast.compress(
        model, method="toast-vit", head_sparsity=0.5, schedule=schedule, progress=False
    )[0]


def _toast_vit_heads(name: str) -> torch.nn.Module:
    """Head pruning alone: no TCS, so transformers rebuilds it without toast."""
    return toast.compress(_vision(name), method="toast-vit", head_sparsity=0.5, progress=False)[0]


def _linearpatch(name: str) -> torch.nn.Module:
    model, data = _tiny(name)
    return toast.compress(model, data, method="linearpatch", num_blocks=2, progress=False)[0]


def _toast_patch(name: str) -> torch.nn.Module:
    """TOAST with the Hadamard-basis fit (stored as its own translator kind)."""
    model, data = _tiny(name)
    return toast.compress(model, data, budget=2, translator="patch_ridge", progress=False)[0]


def _sublayer(name: str) -> torch.nn.Module:
    model, data = _tiny(name)
    return toast.compress(model, data, method="sublayer", num_sublayers=2, progress=False)[0]


def _kind(kind: str, name: str) -> torch.nn.Module:
    """Two spans of the tiny model replaced by translators of ``kind`` (random
    weights): every kind of the table saved and reloaded, not only those a
    method happens to fit."""
    model, _ = _tiny(name)
    dim = model.config.hidden_size
    translators = [translator_of(kind, dim, seed) for seed in (0, 1)]
    toast.io.replace_spans(model, [(0, 1), (2, 4)], translators)
    return model.eval()


_METHODS = {
    "toast": _toast,
    "linearpatch": _linearpatch,
    "toast (patch_ridge)": _toast_patch,
    "sublayer": _sublayer,
    "replaceme": _replaceme,
    "toast-vit": _toast_vit,
    "toast-vit (heads)": _toast_vit_heads,
    **{f"kind {kind}": functools.partial(_kind, kind) for kind in KINDS},
}


@functools.cache
def _compressed(method: str, name: str) -> torch.nn.Module:
    return _METHODS[method](name)


def _auto(model: torch.nn.Module):
    if model.can_generate():  # GPT2LMHeadModel, LlamaForCausalLM, ...
        return transformers.AutoModelForCausalLM
    return transformers.AutoModel


def _write_images(folder, n: int = 24) -> None:
    x = (H.images(n) * 40 + 128).clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    folder.mkdir()
    for k in range(n):
        Image.fromarray(np.ascontiguousarray(x[k]), mode="RGB").save(folder / f"{k}.png")


def _cli_save(name: str, out, tmp_path, monkeypatch) -> torch.nn.Module:
    """``toast compress`` on the family's tiny model; returns the model the
    command compressed (caught where it is saved)."""
    source, images = tmp_path / "source", tmp_path / "images"
    _vision(name).save_pretrained(source)
    _write_images(images)
    caught = {}
    real = toast.io.save.save_pretrained

    def spy(model, path, **kwargs):
        caught["model"] = model
        return real(model, path, **kwargs)

    monkeypatch.setattr(toast.io.save, "save_pretrained", spy)
    argv = ["compress", str(source), "--data", str(images), "--budget", "1", "--out", str(out)]
    assert main([*argv, "--no-progress"]) == 0
    return caught["model"]


CASES = (
    [("toast", f.name) for f in H.FAMILIES]
    + [("replaceme", n) for n in ("llama", "qwen2", "gpt2", "opt", "vit", "clip_vision")]
    + [("toast-vit", n) for n in ("vit", "deit", "dinov2", "vit_mae", "swin")]
    + [("toast-vit (heads)", n) for n in ("deit", "swin")]
    + [("linearpatch", n) for n in ("llama", "gpt2")]
    + [("toast (patch_ridge)", "llama")]
    + [("sublayer", n) for n in ("llama", "gpt2", "vit")]
    + [(f"kind {kind}", "llama") for kind in KINDS]
)
SAVES = ("toast.save_pretrained", "model.save_pretrained", "toast compress --out")
_CLI_FAMILIES = ("vit", "deit", "dinov2", "clip_vision")


def _routes():
    for method, name in CASES:
        for save in SAVES:
            if save != "toast compress --out" or (method == "toast" and name in _CLI_FAMILIES):
                tag = method.replace(" (heads)", "-heads").replace(" (patch_ridge)", "-patch")
                tag = tag.replace(" ", "-")
                yield pytest.param(method, name, save, id=f"{tag}-{name}-{save.split()[0]}")


def _loads(folder, model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    auto = _auto(model)
    return {
        "toast load": toast.load_pretrained(folder),
        "transformers": auto.from_pretrained(folder),
        "trust_remote_code": auto.from_pretrained(folder, trust_remote_code=True),
    }


@pytest.mark.parametrize("method,name,save", list(_routes()))
def test_every_load_of_every_save_gives_identical_outputs(
    method, name, save, tmp_path, monkeypatch, roundtrip_record
):
    out = tmp_path / "saved"
    if save == "toast compress --out":
        model = _cli_save(name, out, tmp_path, monkeypatch)
    else:
        model = _compressed(method, name)
        if save == "toast.save_pretrained":
            toast.save_pretrained(model, out)
        else:
            model.save_pretrained(out)
    batch = _inputs(model)
    expected = _outputs(model, batch)
    results = {}
    for load, loaded in _loads(out, model).items():
        same = type(loaded) is type(model) and torch.equal(_outputs(loaded, batch), expected)
        results[load] = "identical" if same else "DIFFERENT"
        roundtrip_record(method, name, save, load, results[load])
    assert results == dict.fromkeys(results, "identical")


def test_the_saved_loader_knows_every_kind_of_the_table_as_its_module():
    # toast_modeling.py runs without toast, so it keeps the one copy of the table
    from toast.io import hub_model

    assert hub_model.TRANSLATOR_MODULES == {name: e.module for name, e in KINDS.items()}
