"""Token merging (and RAPID, Token Transforming, ATM) composed with the
other ViT methods: ToaSt's head pruning (the projections rebuilt narrower),
Token Channel Selection (the MLP swapped, its CLS attention row carried to
the merged, pruned or mixed tokens) and a removed span of blocks; each
still equals the NumPy reference where one exists."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests._helpers import hf_models as H  # noqa: E402
from toast.hf.model.surgery import remove_blocks  # noqa: E402
from toast.hf.model.vit import TOKEN_MAP_ATTR, merged_row  # noqa: E402
from toast.methods.heads.scwp import prune_heads  # noqa: E402
from toast.methods.heads.tcs import enable_tcs  # noqa: E402
from toast.methods.merge import enable_merging, merge_schedule  # noqa: E402
from toast.methods.merge.atm import AtmReducer  # noqa: E402
from toast.methods.merge.install import enable_reduction  # noqa: E402
from toast.methods.merge.matching import Matching  # noqa: E402
from toast.methods.merge.rapid import RapidReducer  # noqa: E402
from toast.methods.merge.transforming import TransformingReducer  # noqa: E402

from . import models as M  # noqa: E402
from .reference import block_weights, merge_forward  # noqa: E402
from .reference_atm import atm_forward  # noqa: E402
from .reference_rapid import rapid_forward  # noqa: E402
from .reference_transforming import transform_forward  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


def _assert_equals_reference(model, images, r, prefix):
    x, _ = M.block_io(model, images)
    weights = [block_weights(b) for b in M.blocks(model)]
    rs = merge_schedule(r, len(weights))
    enable_merging(model, r, unmerge_output=False)
    _, out = M.block_io(model, images)
    for i, xi in enumerate(x):
        tokens, _, _ = merge_forward(weights, xi.double().numpy(), rs, prefix)
        np.testing.assert_allclose(out[i].numpy(), tokens, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["vit", "dinov2"])
def test_merging_on_pruned_heads_equals_the_reference(family):
    model = M.build(family).double()
    prune_heads(model, 0.5)
    _assert_equals_reference(model, H.images(2, seed=6).double(), 3, M.PREFIX[family])


def test_pruning_heads_after_merging_is_read_at_call_time():
    model, twin = M.build("vit"), M.build("vit")
    images = H.images(2, seed=7)
    enable_merging(model, 3)
    prune_heads(model, 0.5)
    prune_heads(twin, 0.5)
    enable_merging(twin, 3)
    torch.testing.assert_close(M.run(model, images), M.run(twin, images), rtol=0, atol=0)


def test_merging_after_a_removed_span_equals_the_reference():
    model = M.build("vit").double()
    remove_blocks(model, [(1, 3)])
    _assert_equals_reference(model, H.images(2, seed=8).double(), 4, 1)


def test_tcs_with_merging_of_nothing_equals_tcs_alone():
    model, twin = M.build("vit"), M.build("vit")
    schedule = {"fc1": {2: 0.25}, "fc2": {1: 0.5, 3: 0.5}}
    images = H.images(3, seed=9)
    enable_tcs(model, schedule)
    enable_tcs(twin, schedule)
    enable_merging(model, 0)
    torch.testing.assert_close(M.run(model, images), M.run(twin, images), rtol=0, atol=1e-6)


def test_tcs_scores_the_merged_tokens_alike_in_c_and_torch():
    schedule = {"fc1": {2: 0.25}, "fc2": {1: 0.5, 3: 0.5}}
    images = H.images(3, seed=10)
    outputs = []
    for backend in ("c", "torch"):
        model = M.build("vit")
        handle = enable_tcs(model, schedule, backend=backend)
        handle.record = True
        enable_merging(model, 3)
        outputs.append(M.run(model, images))
        assert handle.selections  # TCS selected channels in the merged blocks
    assert outputs[0].shape == (3, 17, H.HIDDEN)
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)


def test_merged_row_sums_the_attention_of_each_merged_token():
    attention = torch.nn.Module()
    row = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]])
    setattr(attention, TOKEN_MAP_ATTR, torch.tensor([[0, 1, 1, 2], [0, 0, 1, 1]]))
    expected = torch.tensor([[0.1, 0.5, 0.4], [0.7, 0.3, 0.0]])
    torch.testing.assert_close(merged_row(attention, row), expected)
    setattr(attention, TOKEN_MAP_ATTR, None)
    assert merged_row(attention, row) is row


def _other_reducer_forward(name, weights, x, prefix):
    """The NumPy reference of RAPID, Token Transforming or ATM on one image
    (their settings as :func:`_other_reducer` installs them)."""
    n = len(weights)
    if name == "rapid":
        return rapid_forward(weights, x, (3,) * n, n // 2, 0.3, prefix)[0]
    if name == "token-transforming":
        return transform_forward(weights, x, (3,) * n, prefix, 0.2)[0]
    return atm_forward(weights, x, (0.3,) * n, n - 1, prefix)[0]


def _other_reducer(name, n):
    if name == "rapid":
        return RapidReducer((3,) * n, n // 2, 0.3)
    if name == "token-transforming":
        return TransformingReducer((3,) * n, 0.2)
    return AtmReducer((0.3,) * n, n - 1)


@pytest.mark.parametrize("name", ["rapid", "token-transforming", "atm"])
def test_other_reducers_on_pruned_heads_and_a_removed_span_equal_their_references(name):
    model = M.build("dinov2").double()
    remove_blocks(model, [(1, 2)])
    prune_heads(model, 0.5)
    images = H.images(1, seed=14).double()  # one image: ATM's count is the image's own
    x, _ = M.block_io(model, images)
    weights = [block_weights(b) for b in M.blocks(model)]
    enable_reduction(model, _other_reducer(name, len(weights)), unmerge_output=False)
    _, out = M.block_io(model, images)
    expected = _other_reducer_forward(name, weights, x[0].double().numpy(), M.PREFIX["dinov2"])
    assert out.shape[1] < x.shape[1]  # something was reduced
    np.testing.assert_allclose(out[0].numpy(), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["rapid", "token-transforming"])
def test_tcs_reads_the_class_attention_of_pruned_and_mixed_tokens_alike_in_c_and_torch(name):
    schedule = {"fc1": {2: 0.25}, "fc2": {1: 0.5, 3: 0.5}}
    images = H.images(3, seed=15)
    outputs = []
    for backend in ("c", "torch"):
        model = M.build("vit")
        handle = enable_tcs(model, schedule, backend=backend)
        handle.record = True
        enable_reduction(model, _other_reducer(name, 4))
        outputs.append(M.run(model, images))
        assert handle.selections
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)


def test_merged_row_carries_a_row_by_shares_and_drops_a_pruned_token():
    attention = torch.nn.Module()
    row = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    # token 1 pruned into token 0's slot (weight 0), token 3 split 1/4 : 3/4
    shares = torch.tensor([[[1.0, 0.0, 0.0, 0.25], [0.0, 0.0, 1.0, 0.75]]])
    setattr(attention, TOKEN_MAP_ATTR, shares)
    torch.testing.assert_close(merged_row(attention, row), torch.tensor([[0.2, 0.6]]))


def test_a_pruning_matching_maps_the_attention_as_shares_of_weight():
    target = torch.tensor([[0, 2, 2, 3]])
    kept, new_index = torch.tensor([[0, 2, 3]]), torch.tensor([[0, 1, 1, 2]])
    merge = Matching(target, kept, new_index)
    prune = Matching(target, kept, new_index, weight=torch.tensor([[1.0, 0.0, 1.0, 1.0]]))
    assert merge.token_map() is new_index
    expected = torch.tensor([[[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]]])
    torch.testing.assert_close(prune.token_map(), expected)
