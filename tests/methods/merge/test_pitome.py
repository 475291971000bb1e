"""PiToMe against a NumPy reference written from its spec
(``reference_pitome.py``): merged tokens, sizes, source maps and outputs on
every supported layout; the protected prefix is never reduced; r = 0 is the
identity; the lowest-energy tokens are never merged; the margin schedule;
the saved state."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests._helpers import hf_models as H  # noqa: E402
from toast.methods.merge import disable_merging, merge_schedule  # noqa: E402
from toast.methods.merge.install import enable_reduction  # noqa: E402
from toast.methods.merge.matching import effective_r  # noqa: E402
from toast.methods.merge.pitome import PitomeReducer, pitome_margins  # noqa: E402
from toast.methods.merge.reducers import TokenView, reducer_from_state  # noqa: E402

from . import models as M  # noqa: E402
from .reference import block_weights  # noqa: E402
from .reference_pitome import energies, pitome_forward  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


def _reducer(model, r, schedule="constant", start=0.9, alpha=1.0):
    blocks = len(M.blocks(model))
    return PitomeReducer(merge_schedule(r, blocks, schedule), pitome_margins(blocks, start), alpha)


def _reference(model, images, reducer, prefix):
    """The reference's final tokens, sizes and token map, per image."""
    disable_merging(model)
    x, _ = M.block_io(model, images)
    weights = [block_weights(b) for b in M.blocks(model)]
    return [
        pitome_forward(
            weights, xi.double().numpy(), reducer.r, reducer.margins, reducer.alpha, prefix
        )
        for xi in x
    ]


def _check_against_reference(family, reducer_of, seed):
    model = M.build(family).double()
    images = H.images(3, seed=seed).double()
    reducer = reducer_of(model)
    expected = _reference(model, images, reducer, M.PREFIX[family])
    handle = enable_reduction(model, reducer, unmerge_output=False)
    _, out = M.block_io(model, images)
    for i, (tokens, sizes, where) in enumerate(expected):
        np.testing.assert_allclose(out[i].numpy(), tokens, rtol=0, atol=1e-6)
        np.testing.assert_allclose(handle.sizes[i, :, 0].numpy(), sizes, rtol=0, atol=1e-9)
        np.testing.assert_array_equal(handle.source[i].numpy(), where)
    return handle


@pytest.mark.parametrize("family", M.FAMILIES)
def test_merged_tokens_sizes_and_sources_equal_the_reference(family):
    handle = _check_against_reference(family, lambda m: _reducer(m, 3), seed=1)
    assert handle.tokens[-1][1] < handle.tokens[0][0]


@pytest.mark.parametrize("family", ["deit", "dinov2_registers", "timm"])
def test_a_low_margin_and_another_alpha_equal_the_reference(family):
    # margins from 0.2 down: many cosines above them, so both ELU branches count
    _check_against_reference(family, lambda m: _reducer(m, 2, start=0.2, alpha=0.5), seed=6)


@pytest.mark.parametrize("family", M.FAMILIES)
def test_unmerged_output_gives_every_token_its_merged_tokens_state(family):
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
    reducer = _reducer(model, 100)  # capped: as much merging as the tokens allow
    expected = _reference(model, images, reducer, prefix)
    handle = enable_reduction(model, reducer, unmerge_output=False)
    _, out = M.block_io(model, images)
    sizes, source = handle.sizes[..., 0], handle.source
    assert torch.equal(source[:, :prefix], torch.arange(prefix).expand(2, prefix))
    assert torch.equal(sizes[:, :prefix], torch.ones(2, prefix, dtype=sizes.dtype))
    # no other token ends in a protected one, and the patches did merge
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


def test_r_zero_reduces_nothing():
    view = TokenView(*(2 * (torch.rand(2, 9, 4),)), None, None, 1)
    assert PitomeReducer((0,), (0.5,)).reduce(0, view) is None
    one_free = TokenView(*(2 * (torch.rand(2, 3, 4),)), None, None, 2)
    assert PitomeReducer((5,), (0.5,)).reduce(0, one_free) is None


@pytest.mark.parametrize("family", M.FAMILIES)
@pytest.mark.parametrize("r", [3, 100])
def test_tokens_are_what_a_forward_sees(family, r):
    model = M.build(family)
    reducer = _reducer(model, r)
    handle = enable_reduction(model, reducer)
    M.run(model, H.images(2, seed=5))
    n = handle.tokens[0][0]
    assert reducer.tokens(n, M.PREFIX[family]) == tuple(handle.tokens)


class _Recording:
    """A PiToMe reducer that records every block's view and matching."""

    name = "pitome"
    needs_attention = False

    def __init__(self, inner: PitomeReducer) -> None:
        self.inner, self.seen = inner, []

    @property
    def num_blocks(self):
        return self.inner.num_blocks

    def reduce(self, position, view):
        matching = self.inner.reduce(position, view)
        self.seen.append((view, matching))
        return matching

    def state(self):
        return self.inner.state()

    def tokens(self, tokens, prefix):
        return self.inner.tokens(tokens, prefix)


@pytest.mark.parametrize(("family", "r", "start"), [("vit", 3, 0.9), ("dinov2_registers", 2, 0.3)])
def test_the_lowest_energy_tokens_are_never_merged(family, r, start):
    model = M.build(family).double()
    prefix = M.PREFIX[family]
    recording = _Recording(_reducer(model, r, start=start))
    enable_reduction(model, recording)
    M.run(model, H.images(3, seed=7).double())
    for position, (view, matching) in enumerate(recording.seen):
        n = view.metric.shape[1]
        k = effective_r(r, n, prefix)
        assert matching is not None and matching.r == k
        margin = recording.inner.margins[position]
        for b in range(3):
            energy, _ = energies(view.metric[b].numpy(), margin, 1.0, prefix)
            ranked = sorted(energy, key=lambda i: -energy[i])
            protected = ranked[2 * k :]
            target = matching.target[b].tolist()
            sources = {i for i in range(n) if target[i] != i}
            merging = sources | {target[i] for i in sources}
            assert len(protected) == n - prefix - 2 * k > 0
            for i in protected:
                # kept as it is: not a source, and nothing merges into it
                assert target[i] == i
                assert target.count(i) == 1
            assert merging.isdisjoint(protected)
            # the sources are the even energy ranks of the candidates
            assert sources == set(ranked[0 : 2 * k : 2])
            assert {target[i] for i in sources} <= set(ranked[1 : 2 * k : 2])


def test_r_is_capped_so_2r_candidates_exist_and_never_above_tomes_cap():
    generator = torch.Generator().manual_seed(0)
    for n, prefix in [(17, 1), (18, 2), (21, 5), (6, 5), (7, 5)]:
        metric = torch.rand(2, n, 8, generator=generator, dtype=torch.float64)
        view = TokenView(metric, metric, None, None, prefix)
        matching = PitomeReducer((100,), (0.5,)).reduce(0, view)
        expected = min((n - prefix) // 2, effective_r(100, n, prefix))
        assert (0 if matching is None else matching.r) == expected
        if matching is not None:
            assert bool((matching.target[:, :prefix] == torch.arange(prefix)).all())
            assert bool((matching.target[:, prefix:] >= prefix).all())


def test_the_margin_schedule_falls_linearly_from_start():
    assert pitome_margins(4) == pytest.approx((0.9, 0.675, 0.45, 0.225))
    assert pitome_margins(3, 0.75) == pytest.approx((0.75, 0.5, 0.25))
    assert pitome_margins(1, 0.5) == (0.5,)
    with pytest.raises(ValueError, match="num_blocks"):
        pitome_margins(0)
    with pytest.raises(ValueError, match="start"):
        pitome_margins(4, 1.5)


def test_the_state_round_trips():
    reducer = PitomeReducer((4, 4, 3, 0), pitome_margins(4, 0.75), 0.5)
    assert reducer_from_state({"reducer": "pitome", **reducer.state()}) == reducer
    assert reducer.state() == {
        "r": [4, 4, 3, 0],
        "margins": [0.75, 0.5625, 0.375, 0.1875],
        "alpha": 0.5,
    }
    assert PitomeReducer([1, 2], [0.9, 0]).r == (1, 2)  # lists are kept as tuples
    assert PitomeReducer([1, 2], [0.9, 0]).margins == (0.9, 0.0)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"r": [1, -1]}, "'r'"),
        ({"r": "12"}, "'r'"),
        ({"r": [1, True]}, "'r'"),
        ({"margins": [0.5, 0.2]}, "'margins'"),
        ({"margins": [0.5, 0.2, 1.5]}, "'margins'"),
        ({"margins": "0.5"}, "'margins'"),
        ({"margins": [0.5, float("nan"), 0.1]}, "'margins'"),
        ({"alpha": 0}, "'alpha'"),
        ({"alpha": "1"}, "'alpha'"),
    ],
)
def test_a_malformed_state_is_refused(change, field):
    state = {"reducer": "pitome", "r": [2, 2, 2], "margins": [0.6, 0.4, 0.2], "alpha": 1.0}
    with pytest.raises(ValueError, match=field):
        reducer_from_state({**state, **change})


def test_a_state_missing_a_setting_is_refused():
    with pytest.raises(ValueError, match="alpha"):
        reducer_from_state({"reducer": "pitome", "r": [2], "margins": [0.9]})


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"r": (1, -2), "margins": (0.9, 0.4)}, "r must"),
        ({"r": 3, "margins": (0.9,)}, "r must"),
        ({"r": (1, 2), "margins": (0.9,)}, "one margin per block"),
        ({"r": (1, 2), "margins": (0.9, -1.5)}, "margins must"),
        ({"r": (1, 2), "margins": 0.9}, "margins must"),
        ({"r": (1, 2), "margins": (0.9, 0.4), "alpha": -1.0}, "alpha"),
    ],
)
def test_bad_settings_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PitomeReducer(**kwargs)
