"""RAPID against a NumPy reference written from its spec
(``reference_rapid.py``): reduced tokens, sizes, source maps and outputs on
every supported layout; the protected prefix is never reduced; r = 0 is the
identity; pruning drops mass; the most attended token survives merging."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests._helpers import hf_models as H  # noqa: E402
from toast.methods.merge import disable_merging, merge_schedule  # noqa: E402
from toast.methods.merge.install import enable_reduction  # noqa: E402
from toast.methods.merge.matching import effective_r  # noqa: E402
from toast.methods.merge.rapid import RapidReducer  # noqa: E402
from toast.methods.merge.reducers import TokenView, reducer_from_state  # noqa: E402

from . import models as M  # noqa: E402
from .reference import block_weights  # noqa: E402
from .reference_rapid import rapid_forward  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

#: A threshold in the middle of the tiny models' key cosines, so Num varies.
TAU = 0.3


def _reducer(model, r, schedule="constant", prune_until=None, tau=TAU):
    blocks = len(M.blocks(model))
    until = blocks // 2 if prune_until is None else prune_until
    return RapidReducer(merge_schedule(r, blocks, schedule), until, tau)


def _reference(model, images, reducer, prefix, norm="average"):
    """The reference's final tokens, sizes and token map, per image."""
    disable_merging(model)
    x, _ = M.block_io(model, images)
    weights = [block_weights(b) for b in M.blocks(model)]
    return [
        rapid_forward(
            weights, xi.double().numpy(), reducer.r, reducer.prune_until, reducer.tau, prefix, norm
        )
        for xi in x
    ]


def _check_against_reference(family, reducer_of, seed, norm="average"):
    model = M.build(family).double()
    images = H.images(3, seed=seed).double()
    reducer = reducer_of(model)
    expected = _reference(model, images, reducer, M.PREFIX[family], norm)
    handle = enable_reduction(model, reducer, unmerge_output=False, merge_norm=norm)
    _, out = M.block_io(model, images)
    for i, (tokens, sizes, where) in enumerate(expected):
        np.testing.assert_allclose(out[i].numpy(), tokens, rtol=0, atol=1e-6)
        np.testing.assert_allclose(handle.sizes[i, :, 0].numpy(), sizes, rtol=0, atol=1e-9)
        np.testing.assert_array_equal(handle.source[i].numpy(), where)
    return handle


@pytest.mark.parametrize("family", M.FAMILIES)
def test_reduced_tokens_sizes_and_sources_equal_the_reference(family):
    _check_against_reference(family, lambda m: _reducer(m, 3), seed=1)


@pytest.mark.parametrize("family", M.FAMILIES)
def test_merged_norms_leave_the_pruned_tokens_out_as_the_reference(family):
    _check_against_reference(family, lambda m: _reducer(m, 3), seed=7, norm="max")


@pytest.mark.parametrize(("family", "mode"), [("deit", "prune"), ("dinov2_registers", "merge")])
def test_all_pruning_or_all_merging_equals_the_reference(family, mode):
    def reducer_of(model):
        until = len(M.blocks(model)) if mode == "prune" else 0
        return _reducer(model, 2, prune_until=until, tau=0.8)  # Num is mostly 0: ties by s

    _check_against_reference(family, reducer_of, seed=6)


@pytest.mark.parametrize("family", M.FAMILIES)
def test_unmerged_output_gives_every_token_its_reduced_tokens_state(family):
    model = M.build(family).double()
    images = H.images(3, seed=2).double()
    reducer = _reducer(model, 2, "decreasing")
    expected = _reference(model, images, reducer, M.PREFIX[family])
    enable_reduction(model, reducer)
    _, out = M.block_io(model, images)
    for i, (tokens, _, where) in enumerate(expected):
        assert out[i].shape[0] == len(where)
        np.testing.assert_allclose(out[i].numpy(), tokens[where], rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", M.FAMILIES)
def test_the_protected_prefix_is_never_reduced(family):
    model = M.build(family).double()
    prefix = M.PREFIX[family]
    images = H.images(2, seed=3).double()
    reducer = _reducer(model, 100)  # capped: as much reduction as the tokens allow
    expected = _reference(model, images, reducer, prefix)
    handle = enable_reduction(model, reducer, unmerge_output=False)
    _, out = M.block_io(model, images)
    sizes, source = handle.sizes[..., 0], handle.source
    assert torch.equal(source[:, :prefix], torch.arange(prefix).expand(2, prefix))
    assert torch.equal(sizes[:, :prefix], torch.ones(2, prefix, dtype=sizes.dtype))
    # no other token ends in a protected one, and the patches were reduced
    assert bool((source[:, prefix:] >= prefix).all())
    assert handle.tokens[-1][1] < handle.tokens[0][0]
    for i, (tokens, _, _) in enumerate(expected):
        np.testing.assert_allclose(out[i, :prefix].numpy(), tokens[:prefix], rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", M.FAMILIES)
def test_r_zero_is_the_identity(family):
    model = M.build(family)
    images = H.images(3, seed=4)
    before = M.run(model, images)
    enable_reduction(model, _reducer(model, 0))
    after = M.run(model, images)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", M.FAMILIES)
@pytest.mark.parametrize("r", [3, 100])
def test_tokens_are_what_a_forward_sees(family, r):
    model = M.build(family)
    reducer = _reducer(model, r)
    handle = enable_reduction(model, reducer)
    images = H.images(2, seed=5)
    M.run(model, images)
    n = handle.tokens[0][0]
    assert reducer.tokens(n, M.PREFIX[family]) == tuple(handle.tokens)


class _Recording:
    """A RAPID reducer that records the sizes every block sees."""

    name = "rapid"
    needs_attention = True

    def __init__(self, inner: RapidReducer) -> None:
        self.inner, self.sizes = inner, []

    @property
    def num_blocks(self):
        return self.inner.num_blocks

    def reduce(self, position, view):
        self.sizes.append(view.size_column().clone())
        return self.inner.reduce(position, view)

    def state(self):
        return self.inner.state()

    def tokens(self, tokens, prefix):
        return self.inner.tokens(tokens, prefix)


@pytest.mark.parametrize("family", ["vit", "timm"])
def test_pruning_drops_mass_and_merging_keeps_it(family):
    model = M.build(family)
    blocks = len(M.blocks(model))
    until = blocks // 2
    recording = _Recording(RapidReducer((2,) * blocks, until, TAU))
    handle = enable_reduction(model, recording)
    M.run(model, H.images(3, seed=7))
    after = [kept for _, kept in handle.tokens]
    # every size stays 1 until the first merge: the pruned tokens' mass is gone
    for position in range(until + 1):
        sizes = recording.sizes[position]
        assert torch.equal(sizes, torch.ones_like(sizes))
        assert sizes.shape[1] == handle.tokens[position][0]
    # merging keeps the mass the pruning blocks left
    for sizes in recording.sizes[until + 1 :]:
        torch.testing.assert_close(sizes.sum(-1), torch.full((3,), float(after[until - 1])))
    torch.testing.assert_close(handle.sizes.sum((1, 2)), torch.full((3,), float(after[until - 1])))


def test_only_pruning_leaves_every_size_one():
    model = M.build("deit")
    blocks = len(M.blocks(model))
    handle = enable_reduction(model, RapidReducer((3,) * blocks, blocks))
    M.run(model, H.images(2, seed=8))
    assert torch.equal(handle.sizes, torch.ones_like(handle.sizes))
    assert handle.sizes.shape[1] == handle.tokens[-1][1] < handle.tokens[0][0]


@pytest.mark.parametrize("prefix", [1, 2, 5])
def test_the_most_attended_source_survives_merging_unless_every_source_goes(prefix):
    n, batch = 21, 4
    generator = torch.Generator().manual_seed(prefix)
    # positive features: every similarity is positive, so s·(1 − Î) > 0 but for the top
    metric = torch.rand(batch, n, 8, generator=generator, dtype=torch.float64)
    attention = torch.rand(batch, n, generator=generator, dtype=torch.float64)
    first_a = prefix + prefix % 2  # the first free even position
    top = first_a + 2 * torch.randint(0, (n - first_a + 1) // 2, (batch,), generator=generator)
    attention[torch.arange(batch), top] = 2.0  # the largest over every free token
    attention = attention / attention.sum(-1, keepdim=True)
    view = TokenView(metric, metric, None, attention, prefix)
    free_a = len(range(first_a, n, 2))
    for r in range(1, free_a):
        matching = RapidReducer((r,), 0).reduce(0, view)
        assert matching is not None and matching.r == r
        assert torch.equal(matching.target[torch.arange(batch), top], top)
    if effective_r(free_a, n, prefix) == free_a:
        matching = RapidReducer((free_a,), 0).reduce(0, view)
        assert matching is not None
        assert bool((matching.target[torch.arange(batch), top] != top).all())


def test_the_state_round_trips():
    reducer = RapidReducer((4, 4, 3, 0), 2, 0.75)
    assert reducer_from_state({"reducer": "rapid", **reducer.state()}) == reducer
    assert reducer.state() == {"r": [4, 4, 3, 0], "prune_until": 2, "tau": 0.75}
    assert RapidReducer([1, 2], 1).r == (1, 2)  # a list is kept as a tuple


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"r": [1, -1]}, "'r'"),
        ({"r": "12"}, "'r'"),
        ({"r": [1, True]}, "'r'"),
        ({"prune_until": 5}, "'prune_until'"),
        ({"prune_until": 1.0}, "'prune_until'"),
        ({"tau": 1.5}, "'tau'"),
        ({"tau": "0.8"}, "'tau'"),
        ({"tau": float("nan")}, "'tau'"),
    ],
)
def test_a_malformed_state_is_refused(change, field):
    state = {"reducer": "rapid", "r": [2, 2, 2], "prune_until": 1, "tau": 0.8, **change}
    with pytest.raises(ValueError, match=field):
        reducer_from_state(state)


def test_a_state_missing_a_setting_is_refused():
    with pytest.raises(ValueError, match="tau"):
        reducer_from_state({"reducer": "rapid", "r": [2], "prune_until": 0})


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"r": (1, -2), "prune_until": 0}, "r must"),
        ({"r": 3, "prune_until": 0}, "r must"),
        ({"r": (1, 2), "prune_until": 3}, "prune_until"),
        ({"r": (1, 2), "prune_until": -1}, "prune_until"),
        ({"r": (1, 2), "prune_until": 1, "tau": -1.1}, "tau"),
    ],
)
def test_bad_settings_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RapidReducer(**kwargs)


def test_a_merging_block_without_the_class_attention_is_refused():
    metric = torch.rand(1, 9, 4, dtype=torch.float64)
    view = TokenView(metric, metric, None, None, 1)
    assert RapidReducer((2,), 1).reduce(0, view) is not None  # pruning reads no attention
    with pytest.raises(ValueError, match="class token's attention"):
        RapidReducer((2,), 0).reduce(0, view)
