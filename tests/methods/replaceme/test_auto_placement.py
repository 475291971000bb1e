"""``placement="auto"`` (the default): ReplaceMe never refuses a supported
family. Where the full T folds (no norm after the MLP) the fold and the
block placement are fitted; where a norm follows the MLP (Gemma 2/3,
OLMo-2) the exact placements are; the one measuring best on the held-out
batches is kept, and the model is never worse there than plain removal of
the same cut."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import toast  # noqa: E402
from tests._helpers import replaceme_models as R  # noqa: E402
from toast.hf.evaluate.check import CheckSplit  # noqa: E402
from toast.hf.model.surgery import remove_blocks  # noqa: E402
from toast.methods.replaceme import replaceme  # noqa: E402
from toast.methods.replaceme.from_disk import replaceme_from_disk  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

FAMILIES = sorted(R.DECODERS) + sorted(R.POST_NORM_DECODERS)
#: 10 batches: the default check_fraction=0.1 holds the last one out
HELD_DATA = 80


@pytest.mark.parametrize("name", FAMILIES)
def test_the_default_never_refuses_and_is_never_worse_than_plain_removal_held_out(name):
    model, data = R.decoder(name), R.text_loader(HELD_DATA)
    original = copy.deepcopy(model)
    pruned, report = replaceme(model, data, num_blocks=1, progress=False)
    plain = remove_blocks(copy.deepcopy(original), [(s.start, s.stop) for s in report.spans])
    held = list(CheckSplit(data, 0.1).check)
    assert len(held) == 1
    assert R.next_token_loss(pruned, held) <= R.next_token_loss(plain, held) + 1e-9
    if name in R.POST_NORM_DECODERS:
        assert "post_feedforward_layernorm" in report.placement_note
        assert [(t.placement, t.structure) for t in report.placements] == [
            ("fold", "diagonal"),
            ("mlp", "full"),
            ("block", "full"),
        ]
        chosen = (report.placement, report.structure)
        assert chosen in [(t.placement, t.structure) for t in report.placements]
        assert "Placement (auto)" in report.to_markdown()
    else:
        assert [(t.placement, t.structure) for t in report.placements] == [
            ("fold", "full"),
            ("block", "full"),
        ]
        assert (report.placement, report.structure) in [("fold", "full"), ("block", "full")]
        assert "block placement" in report.placement_note


@pytest.mark.parametrize("name", FAMILIES)
def test_compress_with_only_num_blocks_runs_on_every_family(name):
    model, report = toast.compress(
        R.decoder(name), R.text_loader(), method="replaceme", num_blocks=1, progress=False
    )
    assert report.blocks_after == R.LAYERS - 1 + R.translator_blocks(report)
    # 6 batches, fewer than a group of 10: the last one held out, the placements measured
    assert report.check_note == "" and len(report.checks) == 1
    assert "measured on held-out batches" in report.placement_note


def test_auto_equals_fold_where_the_full_transform_folds_and_nothing_is_measured():
    data = R.text_loader(HELD_DATA)
    options = {"num_blocks": 1, "check_fraction": 0.0, "progress": False}
    _, auto = replaceme(R.decoder("llama"), data, **options)
    _, fold = replaceme(R.decoder("llama"), data, placement="fold", **options)
    assert auto.spans == fold.spans and auto.placement == "fold"
    assert auto.placement_note == "" and auto.placements == []
    np.testing.assert_array_equal(auto.transforms[0], fold.transforms[0])


def test_auto_measures_nothing_without_held_out_batches_and_folds_a_diagonal_t():
    _, report = replaceme(
        R.decoder("olmo2"), R.text_loader(HELD_DATA), num_blocks=1, check_fraction=0.0
    )
    assert (report.placement, report.structure) == ("fold", "diagonal")
    assert report.placements == []
    assert "check_fraction=0" in report.placement_note


def test_from_disk_auto_folds_a_diagonal_t_into_the_norm_and_says_so(tmp_path):
    R.decoder("gemma3").save_pretrained(tmp_path / "source")
    report = toast.compress(
        tmp_path / "source",
        R.text_loader(HELD_DATA),
        method="replaceme",
        num_blocks=1,
        output=tmp_path / "out",
        sequential=True,
        progress=False,
    )
    assert (report.placement, report.structure) == ("fold", "diagonal")
    assert "from disk" in report.placement_note
    assert (tmp_path / "out" / "model.safetensors").exists()
    direct = replaceme_from_disk(
        tmp_path / "source", R.text_loader(HELD_DATA), num_blocks=1, progress=False
    )
    assert direct.spans == report.spans


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_the_placements_auto_tries_are_fitted_in_one_pass_as_in_a_pass_each(name):
    from toast.hf.data.calibration import Calibration
    from toast.hf.model.blocks import find_blocks
    from toast.methods.replaceme.auto import placement_options, resolved
    from toast.methods.replaceme.config import ReplaceMeConfig
    from toast.methods.replaceme.estimate import Estimation
    from toast.spans import Span

    model, data = R.decoder(name), R.text_loader(48)
    stack = find_blocks(model)
    config = ReplaceMeConfig(num_blocks=2, calibration=Calibration(progress=False))
    cuts = [Span(2, 4, 0.0), Span(3, 5, 0.0)]
    options, _ = placement_options(stack.blocks, cuts, config)
    assert len(options) >= 2  # fold and block; gemma2's post-MLP norm: three exact ones
    configs = [resolved(config, o) for o in options]
    estimation = Estimation(model, data, config, stack)
    calls = []
    handle = model.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        together = estimation.fit_each(configs, cuts)
    finally:
        handle.remove()
    assert len(calls) == len(data)  # one forward a batch for every option
    for c, (fits, rows) in zip(configs, together, strict=True):
        alone, alone_rows = estimation.configured(c).fit(cuts)
        assert rows == alone_rows
        for a, b in zip(fits, alone, strict=True):
            np.testing.assert_array_equal(a.transform, b.transform)
