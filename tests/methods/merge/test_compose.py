"""Token merging composed with the other ViT methods: ToaSt's head pruning
(the projections rebuilt narrower), Token Channel Selection (the MLP
swapped, its CLS attention row carried to the merged tokens) and a removed
span of blocks; each still equals the NumPy reference where one exists."""

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

from . import models as M  # noqa: E402
from .reference import block_weights, merge_forward  # noqa: E402

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
