"""The model's structure is found once per public call: ``toast.search``
and ``toast.analyze`` each discover the block list once (and a ViT's
blocks once), then pass what they found down."""

from __future__ import annotations

import sys

import pytest

import toast
from toast.hf.model import blocks as hf_blocks
from toast.hf.model import vit as vit_module

from .conftest import CALIBRATION_LENGTH, image_batches, tiny_llama, tiny_vit, token_batches

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.hf


@pytest.fixture
def discoveries(monkeypatch):
    """Counts, by function, every discovery of a model's structure: calls
    of ``find_blocks`` that search the model or look up a path (not those
    handed a stack found before, which look its path up again after
    surgery) and calls of ``vit_blocks``, wherever a module imported them."""
    counts = {"find_blocks": 0, "vit_blocks": 0}
    find_blocks, vit_blocks = hf_blocks.find_blocks, vit_module.vit_blocks

    def counted_find(model, blocks=None):
        if not isinstance(blocks, hf_blocks.BlockStack):
            counts["find_blocks"] += 1
        return find_blocks(model, blocks)

    def counted_vit(model):
        counts["vit_blocks"] += 1
        return vit_blocks(model)

    import toast.methods

    for name in toast.methods.available_methods():
        toast.methods.get_method(name)  # every module that could discover is loaded
    replacements = {id(find_blocks): counted_find, id(vit_blocks): counted_vit}
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith("toast"):
            continue
        for name, value in list(vars(module).items()):
            if id(value) in replacements:
                monkeypatch.setattr(module, name, replacements[id(value)])
    return counts


def test_search_finds_a_language_models_blocks_once(discoveries, tmp_path):
    data, heldout = token_batches(2, CALIBRATION_LENGTH, 1), token_batches(1, 12, 2)
    toast.search(tiny_llama(), data, heldout, cache=tmp_path, latency=False, progress=False)
    assert discoveries == {"find_blocks": 1, "vit_blocks": 0}


def test_search_finds_a_vits_blocks_once(discoveries, tmp_path):
    data, heldout = image_batches(2, 1), image_batches(1, 2)
    toast.search(
        tiny_vit(),
        data,
        heldout,
        target="macs=20%",
        cache=tmp_path,
        latency=False,
        progress=False,
    )
    assert discoveries == {"find_blocks": 1, "vit_blocks": 1}


def test_analyze_finds_the_blocks_once(discoveries):
    toast.analyze(tiny_llama(), token_batches(2, CALIBRATION_LENGTH, 1), progress=False)
    assert discoveries == {"find_blocks": 1, "vit_blocks": 0}


def test_search_of_a_checkpoint_from_disk_finds_the_blocks_once(discoveries, tmp_path):
    tiny_llama().save_pretrained(tmp_path / "model", max_shard_size="20KB")
    data, heldout = token_batches(2, CALIBRATION_LENGTH, 1), token_batches(1, 12, 2)
    toast.search(
        tmp_path / "model",
        data,
        heldout,
        cache=tmp_path / "cache",
        latency=False,
        progress=False,
        sequential=True,
    )
    assert discoveries == {"find_blocks": 1, "vit_blocks": 0}
