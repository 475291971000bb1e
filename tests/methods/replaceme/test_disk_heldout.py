"""ReplaceMe from a checkpoint on disk measures what ReplaceMe in memory
measures: held-out quality (original, plain removal, pruned model), the
held-out check of each fit against plain removal, and the candidate cuts
the check chooses from, all block by block."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests._helpers import replaceme_models as R  # noqa: E402
from toast.methods.replaceme import replaceme  # noqa: E402
from toast.methods.replaceme.from_disk import replaceme_from_disk  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

REL = 1e-5


def _both(model, data, tmp_path, **params):
    model.save_pretrained(tmp_path / "source")
    on_disk = replaceme_from_disk(tmp_path / "source", data, progress=False, **params)
    _, in_memory = replaceme(copy.deepcopy(model), data, progress=False, **params)
    return on_disk, in_memory


def _same_quality(a, b) -> None:
    assert (a.metric, a.samples, a.count) == (b.metric, b.samples, b.count)
    assert a.original == pytest.approx(b.original, rel=REL)
    assert a.plain_removal == pytest.approx(b.plain_removal, rel=REL)
    assert a.compressed == pytest.approx(b.compressed, rel=REL)


@pytest.mark.parametrize("placement", ["fold", "block"])
def test_heldout_quality_from_disk_equals_in_memory(placement, tmp_path):
    heldout = R.text_loader(16, seed=1)
    on_disk, in_memory = _both(
        R.decoder("llama"),
        R.text_loader(),
        tmp_path,
        spans=[(2, 4)],
        placement=placement,
        heldout=heldout,
    )
    _same_quality(on_disk.quality, in_memory.quality)


def test_heldout_quality_of_an_encoder_from_disk_equals_in_memory(tmp_path):
    model = R.encoder("vit")
    data, heldout = R.image_loader(), R.image_loader(16, seed=1)
    # from disk the fold only: in memory too
    on_disk, in_memory = _both(
        model, data, tmp_path, num_blocks=1, heldout=heldout, placement="fold"
    )
    assert on_disk.quality.metric == "cosine"
    _same_quality(on_disk.quality, in_memory.quality)


@pytest.mark.parametrize("fallback", [False, True])
def test_heldout_check_from_disk_keeps_what_the_in_memory_check_keeps(fallback, tmp_path):
    on_disk, in_memory = _both(
        R.decoder("llama"),
        R.text_loader(),  # 6 batches: the 4th is held out
        tmp_path,
        spans=[(2, 4)],
        check_fraction=0.25,
        fallback=fallback,
    )
    (a,), (b,) = on_disk.checks, in_memory.checks
    assert (a.span, a.used, a.count) == (b.span, b.used, b.count)
    assert a.fitted == pytest.approx(b.fitted, rel=REL)
    assert a.plain == pytest.approx(b.plain, rel=REL)
    assert on_disk.check_note == in_memory.check_note
    if b.used == "fitted":  # refitted on every batch
        np.testing.assert_allclose(on_disk.transforms[0], in_memory.transforms[0], atol=1e-6)
    else:
        assert on_disk.transforms == in_memory.transforms == [None]
    assert on_disk.rows == in_memory.rows


def test_candidate_cuts_from_disk_choose_the_in_memory_cut(tmp_path):
    # from disk the candidates are the distance's only (no moments pass for predicted ones)
    on_disk, in_memory = _both(
        R.decoder("llama"),
        R.text_loader(96),
        tmp_path,
        num_blocks=2,
        candidates=3,
        predicted_candidates=0,
        placement="fold",  # from disk the fold only: in memory too
    )
    assert len(in_memory.candidates) == 3  # the check chose among several windows
    assert on_disk.spans == in_memory.spans
    assert [c.span for c in on_disk.candidates] == [c.span for c in in_memory.candidates]
    for a, b in zip(on_disk.candidates, in_memory.candidates, strict=True):
        assert a.result == pytest.approx(b.result, rel=REL)
    assert on_disk.to_markdown() == in_memory.to_markdown()  # the same notes, to 4 digits
