"""Families that normalise the MLP output before the residual add (Gemma 2,
Gemma 3, OLMo-2): a full T is refused up front, naming what can be exact; a
diagonal T folds into that norm's weight exactly, in memory and from disk."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from tests._helpers import assert_rel  # noqa: E402
from tests._helpers import replaceme_models as R  # noqa: E402
from toast.hf.model.blocks import find_blocks  # noqa: E402
from toast.methods.replaceme import NotFoldableError, replaceme  # noqa: E402
from toast.methods.replaceme.fold import norm_offset, residual_writer  # noqa: E402
from toast.methods.replaceme.from_disk import replaceme_from_disk  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

SPAN = (2, 4)
FAMILIES = sorted(R.POST_NORM_DECODERS)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_full_transform_is_refused_before_the_estimation_naming_what_is_exact(name):
    # asked for explicitly: the default (placement="auto") chooses an exact one
    model = R.decoder(name)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(NotFoldableError, match="structure='diagonal'.*placement='mlp'"):
        replaceme(
            model, R.text_loader(), spans=[SPAN], placement="fold", structure="full", progress=False
        )
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_diagonal_transform_folded_into_the_norm_equals_it_kept_as_a_module(name):
    data = R.text_loader()
    # every batch fits: no held-out check to replace a fit by plain removal
    options = {"spans": [SPAN], "structure": "diagonal", "check_fraction": 0.0, "progress": False}
    folded, report = replaceme(R.decoder(name), data, placement="fold", **options)
    kept, same = replaceme(R.decoder(name), data, placement="mlp", **options)
    t = report.transforms[0]
    np.testing.assert_array_equal(t, same.transforms[0])
    assert np.abs(np.diagonal(t) - 1).max() > 0.01  # a real transform, not ~identity
    assert np.count_nonzero(t - np.diag(np.diagonal(t))) == 0
    for batch in data[:2]:
        assert_rel(R.outputs(folded, batch), R.outputs(kept, batch), 1e-5, name)


@pytest.mark.parametrize(("name", "offset"), [("gemma2", 1.0), ("gemma3", 1.0), ("olmo2", 0.0)])
def test_the_norm_after_the_mlp_is_found_with_how_it_applies_its_weight(name, offset):
    writer = residual_writer(R.decoder(name).model.layers[1])
    assert writer.norm_path == "post_feedforward_layernorm"
    assert norm_offset(writer.norm, R.HIDDEN) == offset


@pytest.mark.parametrize("name", sorted(R.DECODERS))
def test_families_without_a_norm_after_the_mlp_write_through_the_down_projection(name):
    writer = residual_writer(find_blocks(R.decoder(name)).blocks[1])
    assert writer.norm is None and writer.module is writer.down.module


def test_diagonal_fold_from_disk_equals_the_in_memory_checkpoint(tmp_path):
    model, data = R.decoder("gemma3"), R.text_loader()
    model.save_pretrained(tmp_path / "source")
    # every batch fits: in memory no block placement is measured against the fold
    options = {"spans": [SPAN], "structure": "diagonal", "check_fraction": 0.0, "progress": False}
    replaceme_from_disk(tmp_path / "source", data, tmp_path / "disk", **options)
    pruned, _ = replaceme(model, data, **options)
    pruned.save_pretrained(tmp_path / "memory")
    a = load_file(tmp_path / "disk" / "model.safetensors")
    b = load_file(tmp_path / "memory" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
