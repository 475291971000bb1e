"""Token merging against a NumPy reference written from the paper's
equations (``reference.py``): merged tokens, sizes and outputs, on every
supported layout; the protected prefix is never merged; r = 0 is the
identity."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests._helpers import hf_models as H  # noqa: E402
from toast.methods.merge import disable_merging, enable_merging, merge_schedule  # noqa: E402
from toast.methods.merge.matching import (  # noqa: E402
    effective_r,
    matching_from_pairs,
    merge_tokens,
)

from . import models as M  # noqa: E402
from .reference import block_weights, merge_forward  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


def _reference(model, images, rs, prefix, norm="average"):
    """The reference's final tokens, sizes and token map, per image."""
    disable_merging(model)
    x, _ = M.block_io(model, images)
    weights = [block_weights(b) for b in M.blocks(model)]
    return [merge_forward(weights, xi.double().numpy(), rs, prefix, norm) for xi in x]


@pytest.mark.parametrize("family", M.FAMILIES)
def test_merged_tokens_sizes_and_sources_equal_the_reference(family):
    model = M.build(family).double()
    images = H.images(3, seed=1).double()
    rs = merge_schedule(3, len(M.blocks(model)))
    expected = _reference(model, images, rs, M.PREFIX[family])
    handle = enable_merging(model, 3, unmerge_output=False)
    _, out = M.block_io(model, images)
    for i, (tokens, sizes, where) in enumerate(expected):
        np.testing.assert_allclose(out[i].numpy(), tokens, rtol=0, atol=1e-6)
        np.testing.assert_allclose(handle.sizes[i, :, 0].numpy(), sizes, rtol=0, atol=1e-9)
        np.testing.assert_array_equal(handle.source[i].numpy(), where)


@pytest.mark.parametrize("family", M.FAMILIES)
@pytest.mark.parametrize("norm", ["max", "mean"])
def test_merged_norms_equal_the_reference(family, norm):
    model = M.build(family).double()
    images = H.images(3, seed=4).double()
    rs = merge_schedule(3, len(M.blocks(model)))
    expected = _reference(model, images, rs, M.PREFIX[family], norm)
    enable_merging(model, 3, unmerge_output=False, merge_norm=norm)
    _, out = M.block_io(model, images)
    for i, (tokens, _, _) in enumerate(expected):
        np.testing.assert_allclose(out[i].numpy(), tokens, rtol=0, atol=1e-6)


def test_a_merged_tokens_norm_is_the_largest_or_the_mean_of_its_group():
    x = torch.tensor([[[3.0, 0.0], [0.0, 1.0], [1.0, 1.0]]], dtype=torch.float64)
    sizes = torch.tensor([[[1.0], [3.0], [1.0]]], dtype=torch.float64)
    # token 0 merges into token 1; token 2 is kept alone
    matching = matching_from_pairs(torch.tensor([[0]]), torch.tensor([[1]]), 3)
    average, _ = merge_tokens(x, sizes, matching)
    np.testing.assert_allclose(average[0, 0].numpy(), [0.75, 0.75])
    largest, _ = merge_tokens(x, sizes, matching, "max")
    mean, new_sizes = merge_tokens(x, sizes, matching, "mean")
    direction = np.array([1.0, 1.0]) / np.sqrt(2.0)
    np.testing.assert_allclose(largest[0, 0].numpy(), 3.0 * direction)
    np.testing.assert_allclose(mean[0, 0].numpy(), (3.0 + 3 * 1.0) / 4 * direction)
    np.testing.assert_array_equal(new_sizes[0, :, 0].numpy(), [4.0, 1.0])
    for out in (largest, mean):  # a token that received nothing is left as it was
        np.testing.assert_array_equal(out[0, 1].numpy(), x[0, 2].numpy())


def test_an_unknown_merge_norm_is_refused():
    model = M.build("vit")
    with pytest.raises(ValueError, match="merge_norm must be one of"):
        enable_merging(model, 2, merge_norm="median")


@pytest.mark.parametrize("family", M.FAMILIES)
def test_unmerged_output_gives_every_token_its_merged_tokens_state(family):
    model = M.build(family).double()
    images = H.images(3, seed=2).double()
    rs = merge_schedule(2, len(M.blocks(model)), "decreasing")
    expected = _reference(model, images, rs, M.PREFIX[family])
    enable_merging(model, 2, schedule="decreasing")
    _, out = M.block_io(model, images)
    for i, (tokens, _, where) in enumerate(expected):
        assert out[i].shape[0] == len(where)
        np.testing.assert_allclose(out[i].numpy(), tokens[where], rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", M.FAMILIES)
def test_the_protected_prefix_is_never_merged(family):
    model = M.build(family)
    prefix = M.PREFIX[family]
    handle = enable_merging(model, 100)  # capped: as much merging as the tokens allow
    M.run(model, H.images(4, seed=3))
    sizes, source = handle.sizes[..., 0], handle.source
    assert torch.equal(source[:, :prefix], torch.arange(prefix).expand(4, prefix))
    assert torch.equal(sizes[:, :prefix], torch.ones(4, prefix))
    # no other token ends in a protected one, and the patches did merge
    assert bool((source[:, prefix:] >= prefix).all())
    assert handle.tokens[-1][1] < handle.tokens[0][0]


@pytest.mark.parametrize("family", M.FAMILIES)
def test_r_zero_is_the_identity(family):
    model = M.build(family)
    images = H.images(3, seed=4)
    before = M.run(model, images)
    enable_merging(model, 0)
    after = M.run(model, images)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-6)


def test_disable_restores_the_models_own_forward():
    model = M.build("vit")
    images = H.images(2, seed=5)
    before = M.run(model, images)
    enable_merging(model, 4)
    assert disable_merging(model)
    assert torch.equal(M.run(model, images), before)
    assert not disable_merging(model)


@pytest.mark.parametrize(
    ("r", "tokens", "prefix", "expected"),
    [
        (3, 17, 1, 3),
        (100, 17, 1, 8),
        (100, 18, 2, 8),
        (100, 2, 1, 0),
        (100, 21, 5, 8),
        (0, 17, 1, 0),
    ],
)
def test_r_is_capped_so_the_prefix_and_one_token_of_each_set_remain(r, tokens, prefix, expected):
    assert effective_r(r, tokens, prefix) == expected


def test_the_decreasing_schedule_runs_from_2r_to_zero():
    assert merge_schedule(4, 5, "decreasing") == (8, 6, 4, 2, 0)
    assert merge_schedule(4, 5) == (4,) * 5
    assert merge_schedule([1, 2, 3], 3) == (1, 2, 3)


def test_a_schedule_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="one merge count per block"):
        merge_schedule([1, 2], 3)


def test_training_mode_is_refused():
    model = M.build("vit")
    enable_merging(model, 2)
    model.train()
    with pytest.raises(RuntimeError, match="inference-only"):
        M.run(model, H.images(1))


def test_a_deep_copy_merges_with_its_own_blocks_and_handle():
    import copy

    model = M.build("vit")
    images = H.images(2, seed=14)
    handle = enable_merging(model, 3)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # the copy must not read the original's weights
    expected = M.build("vit")
    enable_merging(expected, 3)
    assert torch.equal(M.run(twin, images), M.run(expected, images))
    assert disable_merging(twin) and handle.sites.sites[0].block.forward.handle is handle
