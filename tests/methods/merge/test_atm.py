"""ATM (threshold merging with size-distinctive matching) against a NumPy
reference written from the spec (``reference_atm.py``): per image at batch
size 1, and the batch rule (every image merges the batch's smallest count)
on a batch of three; the protected prefix is never merged; thresholds above
1 are the identity; size-distinctive blocks only merge the smaller half
into the larger one; the threshold schedule; the saved state."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests._helpers import hf_models as H  # noqa: E402
from toast.methods.merge import disable_merging  # noqa: E402
from toast.methods.merge.atm import AtmReducer, atm_thresholds  # noqa: E402
from toast.methods.merge.install import enable_reduction  # noqa: E402
from toast.methods.merge.matching import bipartite_soft_matching, effective_r  # noqa: E402
from toast.methods.merge.reducers import TokenView, reducer_from_state  # noqa: E402

from . import models as M  # noqa: E402
from .reference import block_weights  # noqa: E402
from .reference_atm import atm_block, atm_forward  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


def _settings(model):
    """Thresholds falling from 0.6 to 0 over the blocks (on these tiny random
    models every block merges some but not all of its sources, by counts
    that differ between blocks and images) and size-distinctive matching in
    the second half."""
    depth = len(M.blocks(model))
    return tuple(float(t) for t in np.linspace(0.6, 0.0, depth)), depth // 2


def _merged_counts(handle):
    return [entering - after for entering, after in handle.tokens]


@pytest.mark.parametrize("family", M.FAMILIES)
def test_one_image_at_a_time_equals_the_per_image_reference(family):
    model = M.build(family).double()
    prefix = M.PREFIX[family]
    images = H.images(3, seed=1).double()
    thresholds, split_from = _settings(model)
    x, _ = M.block_io(model, images)
    weights = [block_weights(b) for b in M.blocks(model)]
    expected = [atm_forward(weights, xi.numpy(), thresholds, split_from, prefix) for xi in x]
    reducer = AtmReducer(thresholds, split_from)
    handle = enable_reduction(model, reducer, unmerge_output=False)
    outputs = []
    for i, (tokens, sizes, where, counts) in enumerate(expected):
        _, out = M.block_io(model, images[i : i + 1])
        np.testing.assert_allclose(out[0].numpy(), tokens, rtol=0, atol=1e-6)
        np.testing.assert_allclose(handle.sizes[0, :, 0].numpy(), sizes, rtol=0, atol=1e-9)
        np.testing.assert_array_equal(handle.source[0].numpy(), where)
        assert _merged_counts(handle) == counts
        # the thresholds matter: some but not all sources of block 0 merge,
        # and the counts change from block to block
        n = x.shape[1]
        assert 0 < counts[0] < effective_r(n, n, prefix)
        assert len(set(counts)) > 1
        outputs.append(out[0])
    disable_merging(model)
    enable_reduction(model, reducer)  # unmerged output: every token its merged token's state
    for i, (tokens, _, where, _) in enumerate(expected):
        _, out = M.block_io(model, images[i : i + 1])
        assert out.shape[1] == len(where)
        np.testing.assert_allclose(out[0].numpy(), tokens[where], rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", M.FAMILIES)
def test_a_batch_merges_its_smallest_count_in_every_image(family):
    model = M.build(family).double()
    prefix = M.PREFIX[family]
    images = H.images(3, seed=2).double()
    thresholds, split_from = _settings(model)
    x, _ = M.block_io(model, images)
    weights = [block_weights(b) for b in M.blocks(model)]
    states = [(xi.numpy(), np.ones(len(xi)), np.arange(len(xi))) for xi in x]
    batch_counts, spread = [], False
    for block, (p, threshold) in enumerate(zip(weights, thresholds, strict=True)):
        distinctive = block >= split_from
        own = [atm_block(p, *state, threshold, prefix, distinctive)[3] for state in states]
        spread = spread or len(set(own)) > 1
        batch_counts.append(min(own))
        states = [
            atm_block(p, *state, threshold, prefix, distinctive, count=min(own))[:3]
            for state in states
        ]
    assert spread  # the images' own counts differ somewhere, so the rule matters
    handle = enable_reduction(model, AtmReducer(thresholds, split_from), unmerge_output=False)
    _, out = M.block_io(model, images)
    assert _merged_counts(handle) == batch_counts
    for i, (tokens, sizes, where) in enumerate(states):
        np.testing.assert_allclose(out[i].numpy(), tokens, rtol=0, atol=1e-6)
        np.testing.assert_allclose(handle.sizes[i, :, 0].numpy(), sizes, rtol=0, atol=1e-9)
        np.testing.assert_array_equal(handle.source[i].numpy(), where)


@pytest.mark.parametrize("family", M.FAMILIES)
def test_the_protected_prefix_is_never_merged(family):
    model = M.build(family)
    prefix = M.PREFIX[family]
    depth = len(M.blocks(model))
    # thresholds below -1: every block merges as much as the tokens allow
    handle = enable_reduction(model, AtmReducer((-2.0,) * depth, split_from=1))
    M.run(model, H.images(4, seed=3))
    sizes, source = handle.sizes[..., 0], handle.source
    assert torch.equal(source[:, :prefix], torch.arange(prefix).expand(4, prefix))
    assert torch.equal(sizes[:, :prefix], torch.ones(4, prefix))
    assert bool((source[:, prefix:] >= prefix).all())
    assert handle.tokens[-1][1] < handle.tokens[0][0]


@pytest.mark.parametrize("family", M.FAMILIES)
def test_thresholds_above_one_are_the_identity(family):
    model = M.build(family)
    images = H.images(3, seed=4)
    before = M.run(model, images)
    depth = len(M.blocks(model))
    reducer = AtmReducer((1.5,) * depth, split_from=0)
    assert reducer.tokens(17, 1) is None  # the counts depend on the images
    handle = enable_reduction(model, reducer)
    after = M.run(model, images)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-6)
    assert all(entering == left for entering, left in handle.tokens)
    assert handle.source is None


def _view(batch=4, n=21, prefix=1, seed=6):
    gen = torch.Generator().manual_seed(seed)
    metric = torch.randn(batch, n, 8, generator=gen, dtype=torch.float64)
    sizes = torch.randint(1, 5, (batch, n, 1), generator=gen).double()
    sizes[:, :prefix] = 1
    x = torch.randn(batch, n, 4, generator=gen, dtype=torch.float64)
    return TokenView(metric, x, sizes, None, prefix)


@pytest.mark.parametrize("threshold", [-2.0, 0.3])
def test_size_distinctive_blocks_merge_only_the_smaller_half_into_the_larger(threshold):
    view = _view()
    matching = AtmReducer((threshold,), split_from=0).reduce(0, view)
    assert matching is not None
    sizes, prefix = view.size_column(), view.prefix
    unit = view.metric / view.metric.norm(dim=-1, keepdim=True)
    n = sizes.shape[1]
    for b in range(len(sizes)):
        ranked = sorted(range(prefix, n), key=lambda i: (float(sizes[b, i]), i))
        small, large = set(ranked[: len(ranked) // 2]), set(ranked[len(ranked) // 2 :])
        target = matching.target[b].tolist()
        sources = [i for i in range(n) if target[i] != i]
        assert sources and set(sources) <= small
        assert {target[i] for i in sources} <= large  # never large + large
        assert all(float(unit[b, i] @ unit[b, target[i]]) > threshold for i in sources)
        assert target[:prefix] == list(range(prefix))
        assert matching.kept[b].tolist() == [i for i in range(n) if target[i] == i]
    if threshold < -1:
        assert matching.r == (n - prefix) // 2  # the whole smaller half


def test_standard_blocks_below_every_score_are_tomes_matching_at_its_cap():
    view = _view(prefix=2)
    n = view.metric.shape[1]
    ours = AtmReducer((-2.0,)).reduce(0, view)
    tome = bipartite_soft_matching(view.metric, n, view.prefix)
    assert ours is not None and tome is not None
    for field in ("target", "kept", "new_index"):
        assert torch.equal(getattr(ours, field), getattr(tome, field))


def test_the_threshold_schedule_falls_exponentially_to_its_floor():
    got = atm_thresholds(6, 0.9, 0.2, 0.3)
    want = [max(0.9 - (math.exp(0.2 * (layer - 1)) - 1), 0.3) for layer in range(1, 7)]
    assert got == pytest.approx(want, abs=1e-15)
    assert got[0] == 0.9 and got[-1] == 0.3 and list(got) == sorted(got, reverse=True)
    assert atm_thresholds(3, 0.8, 0.0, 0.1) == (0.8, 0.8, 0.8)
    with pytest.raises(ValueError, match="beta"):
        atm_thresholds(3, 0.8, -0.1, 0.1)
    with pytest.raises(ValueError, match="num_blocks"):
        atm_thresholds(0, 0.8, 0.1, 0.1)


def test_the_state_round_trips_and_malformed_ones_are_refused():
    reducer = AtmReducer(atm_thresholds(4, 0.9, 0.1, 0.4), split_from=2)
    assert reducer_from_state({"reducer": "atm", **reducer.state()}) == reducer
    never = AtmReducer((0.5, 0.2))
    assert reducer_from_state({"reducer": "atm", **never.state()}) == never
    assert AtmReducer([1, 0.5]).thresholds == (1.0, 0.5)  # type: ignore[arg-type]
    for bad in (
        {"split_from": None},
        {"thresholds": [], "split_from": None},
        {"thresholds": "0.5", "split_from": None},
        {"thresholds": [0.5, True], "split_from": None},
        {"thresholds": [0.5, float("nan")], "split_from": None},
        {"thresholds": [0.5]},
        {"thresholds": [0.5, 0.4], "split_from": "1"},
        {"thresholds": [0.5, 0.4], "split_from": 2},
        {"thresholds": [0.5, 0.4], "split_from": -1},
    ):
        with pytest.raises(ValueError):
            reducer_from_state({"reducer": "atm", **bad})
    with pytest.raises(ValueError, match="split_from"):
        AtmReducer((0.5,), split_from=1)
    with pytest.raises(ValueError, match="thresholds"):
        AtmReducer(())
