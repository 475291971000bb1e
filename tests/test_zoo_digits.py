"""The zoo's digits ViT: shipped in the package, so that its defaults never train.

Training is chaotic across CPUs, so ``digits_vit()`` loads the safetensors
file ``scripts/train_digits_vit.py`` chose and wrote; other seeds, other
epochs and ``retrain=True`` still train and cache.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("sklearn")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from toast import zoo  # noqa: E402
from toast.data import digits  # noqa: E402

pytestmark = pytest.mark.hf

ROOT = Path(__file__).resolve().parents[1]


def _metadata() -> dict[str, str]:
    with safe_open(str(zoo.digits_vit_weights()), "pt") as file:
        return file.metadata()


def _documented_accuracy() -> str:
    found = re.search(r"test\s+accuracy\s+is\s+(0\.\d{3})", zoo.digits_vit.__doc__)
    assert found, "digits_vit's docstring no longer states the shipped model's test accuracy"
    return found[1]


@pytest.fixture
def no_training(monkeypatch):
    def train(*args, **kwargs):
        raise AssertionError("digits_vit trained")

    monkeypatch.setattr(zoo, "_train_digits_vit", train)


@pytest.fixture
def training(monkeypatch):
    """Records every training; trains nothing (a freshly built model)."""
    calls = []

    def train(seed, epochs, progress, train=None):
        calls.append((seed, epochs, train))
        with torch.random.fork_rng(devices=[]):
            return transformers.ViTForImageClassification(
                transformers.ViTConfig(**zoo.DIGITS_VIT)
            ).eval()

    monkeypatch.setattr(zoo, "_train_digits_vit", train)
    return calls


def test_the_defaults_load_the_shipped_file_and_train_nothing(no_training, tmp_path):
    model = zoo.digits_vit(cache=tmp_path, progress=False)
    assert isinstance(model, transformers.ViTForImageClassification) and not model.training
    with torch.random.fork_rng(devices=[]):
        reference = transformers.ViTForImageClassification(transformers.ViTConfig(**zoo.DIGITS_VIT))
    reference.load_state_dict(load_file(str(zoo.digits_vit_weights())), strict=True)
    got, want = model.state_dict(), reference.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not list(tmp_path.iterdir())  # nothing trained, nothing cached


def test_the_shipped_file_is_the_recipe_it_says_in_float32():
    meta = _metadata()
    assert json.loads(meta["config"]) == zoo.DIGITS_VIT
    assert meta["recipe"] == zoo._RECIPE
    assert int(meta["seed"]) == zoo._SHIPPED_SEED
    assert int(meta["split_seed"]) == zoo._SHIPPED_SPLIT_SEED
    assert int(meta["epochs"]) == zoo._SHIPPED_EPOCHS
    tensors = load_file(str(zoo.digits_vit_weights()))
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    assert sum(t.numel() for t in tensors.values()) == 270_026  # the README's parameter count


def test_the_shipped_seed_is_the_validation_choice():
    # the rule of scripts/train_digits_vit.py: seeds 0-4 on 90% of the training
    # split, highest accuracy on the last 10%, ties to the lower loss
    rows = json.loads(_metadata()["choice"])
    assert [r["seed"] for r in rows] == [0, 1, 2, 3, 4]
    assert {(r["fit_images"], r["validation_images"]) for r in rows} == {(1167, 130)}
    best = min(rows, key=lambda r: (-r["validation_accuracy"], r["validation_loss"]))
    assert best["seed"] == zoo._SHIPPED_SEED
    # the docstring quotes the choice
    for r in rows:
        assert f"{r['validation_accuracy']:.3f}" in " ".join(zoo.digits_vit.__doc__.split())


def test_the_shipped_model_scores_the_documented_test_accuracy(no_training):
    test = digits("test")
    measured = zoo.accuracy(zoo.digits_vit(progress=False), test.images, test.labels)
    assert f"{measured:.3f}" == _documented_accuracy()
    development = " ".join((ROOT / "docs" / "development.md").read_text().split())
    assert f"test accuracy {_documented_accuracy()}" in development


def test_loading_leaves_torchs_global_generator_alone(no_training):
    torch.manual_seed(0)
    zoo.digits_vit(progress=False)
    after = torch.rand(4)
    torch.manual_seed(0)
    assert torch.equal(torch.rand(4), after)


def test_retrain_trains_the_shipped_recipe_and_caches_it(training, tmp_path):
    model = zoo.digits_vit(cache=tmp_path, retrain=True, progress=False)
    [(seed, epochs, train)] = training
    assert (seed, epochs) == (zoo._SHIPPED_SEED, zoo._SHIPPED_EPOCHS)
    split = digits("train", seed=zoo._SHIPPED_SPLIT_SEED)
    assert (train.images == split.images).all() and (train.labels == split.labels).all()
    [cached] = tmp_path.iterdir()
    again = transformers.ViTForImageClassification.from_pretrained(cached)
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True)
    )
    zoo.digits_vit(cache=tmp_path, progress=False)  # the defaults: the shipped file
    assert len(training) == 1


def test_other_seeds_and_epochs_train_once_then_load_the_cache(training, tmp_path):
    zoo.digits_vit(seed=1, cache=tmp_path, progress=False)
    zoo.digits_vit(epochs=3, cache=tmp_path, progress=False)
    assert [(seed, epochs) for seed, epochs, _ in training] == [(1, 40), (0, 3)]
    # seed draws the split too, as before the weights shipped
    assert (training[0][2].labels == digits("train", seed=1).labels).all()
    zoo.digits_vit(seed=1, cache=tmp_path, progress=False)
    zoo.digits_vit(epochs=3, cache=tmp_path, progress=False)
    assert len(training) == 2


@pytest.mark.slow
def test_retrain_really_trains(tmp_path):
    # about half a minute: the recipe itself, on this machine (not compared
    # with the shipped tensors: training differs across CPUs)
    model = zoo.digits_vit(cache=tmp_path, retrain=True, progress=False)
    test = digits("test")
    assert zoo.accuracy(model, test.images, test.labels) > 0.9
    assert [p.name for p in tmp_path.iterdir()] == [
        f"digits-vit-{zoo._RECIPE}-e40-s0-init{zoo._SHIPPED_SEED}"
    ]
