"""Token Transforming against a NumPy reference written from the spec
(``reference_transforming.py``): final tokens, sizes, source maps and
unmerged outputs on every supported layout; the protected prefix is never
touched; r = 0 is the identity; mass is conserved; a tiny temperature is a
hard nearest-anchor merge; the state round-trips."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests._helpers import hf_models as H  # noqa: E402
from toast.methods.merge import disable_merging  # noqa: E402
from toast.methods.merge.install import enable_reduction  # noqa: E402
from toast.methods.merge.matching import Matching  # noqa: E402
from toast.methods.merge.reducers import TokenView, reducer_from_state  # noqa: E402
from toast.methods.merge.transforming import TransformingReducer  # noqa: E402

from . import models as M  # noqa: E402
from .reference import block_weights  # noqa: E402
from .reference_transforming import transform_forward  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


class _Recording:
    """A reducer that asks ``inner`` and keeps every block's sizes and matching."""

    name: ClassVar[str] = "token-transforming"
    needs_attention: ClassVar[bool] = True

    def __init__(self, inner: TransformingReducer) -> None:
        self.inner = inner
        self.seen: list[tuple[torch.Tensor, Matching | None]] = []

    @property
    def num_blocks(self) -> int:
        return self.inner.num_blocks

    def reduce(self, position: int, view: TokenView) -> Matching | None:
        matching = self.inner.reduce(position, view)
        self.seen.append((view.size_column(), matching))
        return matching

    def state(self) -> dict[str, Any]:
        return self.inner.state()

    def tokens(self, tokens: int, prefix: int) -> tuple[tuple[int, int], ...]:
        return self.inner.tokens(tokens, prefix)


def _reducer(model, r, temperature=0.1):
    return TransformingReducer((r,) * len(M.blocks(model)), temperature)


def _reference(model, images, reducer, prefix, hard=False, mean_norm=False):
    """The reference's final tokens, sizes, source map and size history, per image."""
    disable_merging(model)
    x, _ = M.block_io(model, images)
    weights = [block_weights(b) for b in M.blocks(model)]
    t = reducer.temperature
    return [
        transform_forward(weights, xi.double().numpy(), reducer.r, prefix, t, hard, mean_norm)
        for xi in x
    ]


@pytest.mark.parametrize("family", M.FAMILIES)
def test_tokens_sizes_and_sources_equal_the_reference(family):
    model = M.build(family).double()
    images = H.images(2, seed=1).double()
    reducer = _reducer(model, 3)
    expected = _reference(model, images, reducer, M.PREFIX[family])
    handle = enable_reduction(model, reducer, unmerge_output=False)
    _, out = M.block_io(model, images)
    for i, (tokens, sizes, source, _) in enumerate(expected):
        np.testing.assert_allclose(out[i].numpy(), tokens, rtol=0, atol=1e-6)
        np.testing.assert_allclose(handle.sizes[i, :, 0].numpy(), sizes, rtol=0, atol=1e-9)
        np.testing.assert_allclose(handle.source[i].numpy(), source, rtol=0, atol=1e-9)


@pytest.mark.parametrize("family", M.FAMILIES)
def test_the_mean_merge_norm_equals_the_reference(family):
    model = M.build(family).double()
    images = H.images(2, seed=8).double()
    reducer = _reducer(model, 3)
    expected = _reference(model, images, reducer, M.PREFIX[family], mean_norm=True)
    enable_reduction(model, reducer, unmerge_output=False, merge_norm="mean")
    _, out = M.block_io(model, images)
    for i, (tokens, _, _, _) in enumerate(expected):
        np.testing.assert_allclose(out[i].numpy(), tokens, rtol=0, atol=1e-6)


def test_the_max_merge_norm_is_refused_for_shared_tokens():
    model = M.build("vit")
    enable_reduction(model, _reducer(model, 3), merge_norm="max")
    with pytest.raises(ValueError, match="norm='max' needs each token to go into one output"):
        M.run(model, H.images(1, seed=0))


@pytest.mark.parametrize("family", M.FAMILIES)
def test_the_unmerged_output_is_the_source_mix_of_the_reference(family):
    model = M.build(family).double()
    images = H.images(2, seed=2).double()
    reducer = _reducer(model, 2, temperature=0.5)
    expected = _reference(model, images, reducer, M.PREFIX[family])
    enable_reduction(model, reducer)
    _, out = M.block_io(model, images)
    for i, (tokens, _, source, _) in enumerate(expected):
        assert out[i].shape[0] == source.shape[0]
        np.testing.assert_allclose(out[i].numpy(), source @ tokens, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", M.FAMILIES)
def test_the_protected_prefix_is_never_reduced(family):
    model = M.build(family).double()
    images = H.images(2, seed=3).double()
    prefix = M.PREFIX[family]
    reducer = _reducer(model, 100)  # capped: as much reduction as the tokens allow
    expected = _reference(model, images, reducer, prefix)
    handle = enable_reduction(model, reducer, unmerge_output=False)
    _, out = M.block_io(model, images)
    source, sizes = handle.source, handle.sizes[..., 0]
    eye = torch.eye(prefix, dtype=source.dtype).expand(2, prefix, prefix)
    assert torch.equal(source[:, :prefix, :prefix], eye)
    assert bool((source[:, :prefix, prefix:] == 0).all())  # a prefix token goes nowhere else
    assert bool((source[:, prefix:, :prefix] == 0).all())  # nothing else goes into it
    assert torch.equal(sizes[:, :prefix], torch.ones(2, prefix, dtype=sizes.dtype))
    for i, (tokens, *_) in enumerate(expected):
        np.testing.assert_allclose(out[i, :prefix].numpy(), tokens[:prefix], rtol=0, atol=1e-6)
    assert handle.tokens[-1][1] < handle.tokens[0][0]


@pytest.mark.parametrize("family", M.FAMILIES)
def test_r_zero_is_the_identity(family):
    model = M.build(family).double()
    images = H.images(2, seed=4).double()
    before = M.run(model, images)
    handle = enable_reduction(model, _reducer(model, 0))
    after = M.run(model, images)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-6)
    assert handle.source is None and handle.sizes is None


@pytest.mark.parametrize("family", M.FAMILIES)
@pytest.mark.parametrize("r", [1, 3, 100])
def test_tokens_match_the_forward(family, r):
    model = M.build(family)
    reducer = _reducer(model, r)
    handle = enable_reduction(model, reducer)
    M.run(model, H.images(1, seed=5))
    n = handle.tokens[0][0]
    assert reducer.tokens(n, M.PREFIX[family]) == tuple(handle.tokens)


def test_tokens_keep_at_least_half_of_the_free_tokens():
    reducer = TransformingReducer((100, 100, 100, 100, 0))
    assert reducer.tokens(17, 1) == ((17, 9), (9, 5), (5, 3), (3, 2), (2, 2))
    assert TransformingReducer((3, 3)).tokens(21, 5) == ((21, 18), (18, 15))


@pytest.mark.parametrize("family", ["vit", "dinov2_registers", "timm"])
def test_mass_is_conserved_at_every_block(family):
    model = M.build(family).double()
    recorder = _Recording(_reducer(model, 3))
    handle = enable_reduction(model, recorder, unmerge_output=False)
    M.run(model, H.images(2, seed=6).double())
    n0 = handle.tokens[0][0]
    for sizes, matching in recorder.seen:
        torch.testing.assert_close(sizes.sum(-1), torch.full((2,), float(n0), dtype=sizes.dtype))
        assert matching is not None and matching.spread is not None
        columns = matching.spread.sum(dim=1)
        torch.testing.assert_close(columns, torch.ones_like(columns), rtol=0, atol=1e-12)
    torch.testing.assert_close(handle.sizes.sum(dim=(1, 2)), torch.full((2,), float(n0)).double())


@pytest.mark.parametrize("family", M.FAMILIES)
def test_a_tiny_temperature_is_a_hard_nearest_anchor_merge(family):
    model = M.build(family).double()
    images = H.images(2, seed=7).double()
    # 1e-6, not 1e-4: in these tiny random models a few tokens have two anchors within
    # 1e-3 in cosine, where exp(-gap / 1e-4) is not yet below the test tolerance
    inner = _reducer(model, 3, temperature=1e-6)
    expected = _reference(model, images, inner, M.PREFIX[family], hard=True)
    recorder = _Recording(inner)
    handle = enable_reduction(model, recorder, unmerge_output=False)
    _, out = M.block_io(model, images)
    for _, matching in recorder.seen:
        assert matching is not None and matching.spread is not None
        one_hot = torch.zeros_like(matching.spread).scatter_(1, matching.new_index[:, None], 1.0)
        torch.testing.assert_close(matching.spread, one_hot, rtol=0, atol=1e-9)
    for i, (tokens, sizes, source, _) in enumerate(expected):
        np.testing.assert_allclose(out[i].numpy(), tokens, rtol=0, atol=1e-6)
        np.testing.assert_allclose(handle.sizes[i, :, 0].numpy(), sizes, rtol=0, atol=1e-9)
        np.testing.assert_allclose(handle.source[i].numpy(), source, rtol=0, atol=1e-9)


def _view(scores, metric, prefix):
    b, n = scores.shape
    x = torch.zeros(b, n, 3, dtype=torch.float64)
    return TokenView(metric, x, None, scores, prefix)


def test_anchors_are_the_most_attended_free_tokens_in_positional_order():
    # prefix 1; free scores: 0.5 (pos 1), 0.9 (2), 0.5 (3), 0.1 (4), 0.5 (5), 0.2 (6)
    scores = torch.tensor([[9.0, 0.5, 0.9, 0.5, 0.1, 0.5, 0.2]], dtype=torch.float64)
    metric = torch.randn(1, 7, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    matching = TransformingReducer((3,)).reduce(0, _view(scores, metric, 1))
    assert matching is not None and matching.spread is not None
    # 3 anchors: 0.9 at 2, then of the ties at 0.5 the first two (1 and 3; 5 loses)
    assert matching.kept.tolist() == [[0, 1, 2, 3]]
    spread = matching.spread[0]
    for out, pos in enumerate(matching.kept[0].tolist()):
        assert spread[:, pos].tolist() == [float(out == o) for o in range(4)]
    for pos in (4, 5, 6):  # shared among the anchors only, never the prefix
        assert spread[0, pos] == 0 and bool((spread[1:, pos] > 0).all())
        assert matching.target[0, pos] == matching.kept[0, matching.new_index[0, pos]]


def test_the_shares_are_a_softmax_of_the_cosine_over_the_temperature():
    scores = torch.tensor([[1.0, 0.9, 0.8, 0.1]], dtype=torch.float64)
    metric = torch.tensor([[[1.0, 0.0], [2.0, 0.0], [0.0, 3.0], [1.0, 1.0]]], dtype=torch.float64)
    matching = TransformingReducer((1,), temperature=0.5).reduce(0, _view(scores, metric, 1))
    assert matching is not None and matching.spread is not None
    cos = torch.tensor([1.0, 1.0], dtype=torch.float64) / 2**0.5  # token 3 vs anchors 1 and 2
    torch.testing.assert_close(matching.spread[0, 1:, 3], (cos / 0.5).softmax(0))
    assert matching.spread[0, 0, 3] == 0


def test_the_state_round_trips():
    reducer = TransformingReducer((3, 0, 2), temperature=0.25)
    state = reducer.state()
    assert state == {"r": [3, 0, 2], "temperature": 0.25}
    assert reducer_from_state({"reducer": reducer.name, **state}) == reducer
    assert reducer_from_state({"reducer": reducer.name, "r": [1], "temperature": 1}) == (
        TransformingReducer((1,), 1.0)
    )


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"temperature": 0.1}, "'r'"),
        ({"r": [1, -1], "temperature": 0.1}, "'r'"),
        ({"r": [1, True], "temperature": 0.1}, "'r'"),
        ({"r": (1, 2), "temperature": 0.1}, "'r'"),
        ({"r": [1]}, "'temperature'"),
        ({"r": [1], "temperature": 0}, "'temperature'"),
        ({"r": [1], "temperature": "0.1"}, "'temperature'"),
        ({"r": [1], "temperature": float("inf")}, "'temperature'"),
    ],
)
def test_a_malformed_state_is_refused(state, message):
    with pytest.raises(ValueError, match=message):
        reducer_from_state({"reducer": "token-transforming", **state})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"r": (1, -2)}, "r must be"),
        ({"r": 3}, "r must be"),
        ({"r": (1.5,)}, "r must be"),
        ({"r": (1,), "temperature": -0.1}, "temperature must be"),
        ({"r": (1,), "temperature": float("nan")}, "temperature must be"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TransformingReducer(**kwargs)


def test_a_list_of_counts_is_stored_as_a_tuple():
    assert TransformingReducer([1, 2]).r == (1, 2)  # type: ignore[arg-type]
    assert TransformingReducer((1,), 1).temperature == 1.0
