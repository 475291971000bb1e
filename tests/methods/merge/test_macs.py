"""The analytic MACs of a merged model against counting: hooks on every
``nn.Linear`` of a forward for the linear part, the attention products
from the token counts the blocks observed, and ToaSt's own MAC counter for
the unmerged model."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests._helpers import hf_models as H  # noqa: E402
from toast.hf.model.blocks import find_blocks  # noqa: E402
from toast.linear_macs import linear_counts  # noqa: E402
from toast.methods.heads.macs import toast_macs  # noqa: E402
from toast.methods.heads.scwp import prune_heads  # noqa: E402
from toast.methods.merge import enable_merging, merge_schedule  # noqa: E402
from toast.methods.merge.macs import SCHEDULES, merged_macs, tokens_per_block  # noqa: E402
from toast.methods.merge.sites import find_sites  # noqa: E402
from toast.methods.merge.widths import merge_widths  # noqa: E402

from . import models as M  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


def _widths(model):
    return merge_widths(model, find_sites(model), find_blocks(model), H.images(1))


@pytest.mark.parametrize("family", M.FAMILIES)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_linear_macs_equal_the_hooks_count_of_a_merged_forward(family, schedule):
    model = M.build(family)
    widths = _widths(model)
    rs = merge_schedule(3, widths.num_blocks, schedule)
    expected = merged_macs(widths, rs)
    handle = enable_merging(model, 3, schedule=schedule)
    counts = linear_counts(model, H.images(1), find_blocks(model))
    assert counts.per_block == expected.linear_blocks
    assert counts.total == expected.linear
    assert tuple(handle.tokens) == expected.tokens


@pytest.mark.parametrize("family", M.FAMILIES)
def test_attention_products_follow_the_observed_token_counts(family):
    model = M.build(family)
    widths = _widths(model)
    expected = merged_macs(widths, merge_schedule(4, widths.num_blocks))
    handle = enable_merging(model, 4)
    M.run(model, H.images(1))
    observed = [2 * n * n * b.width for (n, _), b in zip(handle.tokens, widths.blocks, strict=True)]
    assert tuple(observed) == expected.products


def test_pruned_heads_are_counted_at_their_width():
    model = M.build("vit")
    prune_heads(model, 0.5)
    widths = _widths(model)
    expected = merged_macs(widths, merge_schedule(2, widths.num_blocks))
    enable_merging(model, 2)
    assert linear_counts(model, H.images(1), find_blocks(model)).total == expected.linear


@pytest.mark.parametrize("family", ["vit", "deit", "dinov2"])
def test_without_merging_the_total_equals_toasts_mac_count(family):
    model = M.build(family)
    widths = _widths(model)
    total = merged_macs(widths, (0,) * widths.num_blocks).total
    assert total == toast_macs(model.config, num_classes=0).macs


def test_tokens_per_block_stop_merging_when_the_sets_run_out():
    assert tokens_per_block(17, (8, 8, 8), 1) == ((17, 9), (9, 5), (5, 3))
    assert tokens_per_block(17, (0, 2), 1) == ((17, 17), (17, 15))


def test_a_schedule_of_the_wrong_length_is_refused():
    widths = _widths(M.build("vit"))
    with pytest.raises(ValueError, match="one merge count per block"):
        merged_macs(widths, (1,))


def test_the_named_schedules_spread_r_as_documented():
    # ToMe's two, written out from its parse_r: constant, and 2r down to 0
    assert merge_schedule(4, 5, "constant") == (4, 4, 4, 4, 4)
    assert merge_schedule(4, 5, "decreasing") == (8, 6, 4, 2, 0)
    # toast's: nothing in the first block; 2r in the first sixth (at least one block)
    assert merge_schedule(4, 5, "delayed") == (0, 4, 4, 4, 4)
    assert merge_schedule(4, 12, "front") == (8, 8) + (4,) * 10
    assert merge_schedule(4, 5, "front") == (8, 4, 4, 4, 4)
    assert merge_schedule(3, 4, "delayed-decreasing") == (0, 6, 3, 0)
    for schedule in SCHEDULES:  # one block: the schedules stay defined
        assert len(merge_schedule(3, 1, schedule)) == 1


def test_an_unknown_schedule_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="delayed-decreasing"):
        merge_schedule(3, 4, "increasing")
