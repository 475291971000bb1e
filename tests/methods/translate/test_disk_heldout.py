"""TOAST from a checkpoint on disk measures what TOAST in memory measures:
held-out quality (original, plain removal, patched model) and the held-out
check of each translator against plain removal, block by block."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import toast  # noqa: E402
from tests._helpers import replaceme_models as R  # noqa: E402
from toast.core.chunked import ChunkedMoments, PairMoments, pair_nbytes  # noqa: E402
from toast.methods.translate.from_disk import compress_from_disk  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

REL = 1e-5
# candidates=1: the cases below are about the check of the best predicted
# spans, whichever a measured choice would keep (test_measured_choice.py)
OPTIONS = {
    "budget": 2, "translator": "affine", "estimator": "gcv", "progress": False, "candidates": 1,
}  # fmt: skip


def _both(model, data, tmp_path, heldout=None, **params):
    model.save_pretrained(tmp_path / "source")
    options = {**OPTIONS, **params}
    on_disk = compress_from_disk(
        tmp_path / "source", data, tmp_path / "disk", heldout=heldout, **options
    )
    _, in_memory = toast.compress(
        copy.deepcopy(model), data, method="toast", heldout=heldout, **options
    )
    return on_disk, in_memory


def test_heldout_quality_from_disk_equals_in_memory(tmp_path):
    heldout = R.text_loader(16, seed=1)
    on_disk, in_memory = _both(R.decoder("llama"), R.text_loader(), tmp_path, heldout=heldout)
    a, b = on_disk.quality, in_memory.quality
    assert on_disk.spans == in_memory.spans
    assert (a.metric, a.samples, a.count) == (b.metric, b.samples, b.count)
    assert a.original == pytest.approx(b.original, rel=REL)
    assert a.plain_removal == pytest.approx(b.plain_removal, rel=REL)
    assert a.compressed == pytest.approx(b.compressed, rel=REL)


# on this model and data the affine translator of blocks[4:6] beats plain
# removal and the linear one of blocks[3:6] loses to it
CHECKED = {
    "fit_wins": {"budget": 2, "translator": "affine"},
    "plain_wins": {"budget": 3, "translator": "linear"},
    "plain_wins_no_fallback": {"budget": 3, "translator": "linear", "fallback": False},
}


@pytest.mark.parametrize("case", sorted(CHECKED))
def test_heldout_check_from_disk_keeps_what_the_in_memory_check_keeps(case, tmp_path):
    params = CHECKED[case]
    on_disk, in_memory = _both(
        R.decoder("llama"), R.text_loader(), tmp_path, check_fraction=0.25, **params
    )
    assert on_disk.spans == in_memory.spans
    assert len(in_memory.checks) == len(on_disk.checks) > 0
    for a, b in zip(on_disk.checks, in_memory.checks, strict=True):
        assert (a.span, a.used, a.count) == (b.span, b.used, b.count)
        assert a.fitted == pytest.approx(b.fitted, rel=REL)
        assert a.plain == pytest.approx(b.plain, rel=REL)
    assert on_disk.check_note == in_memory.check_note
    assert on_disk.params_after == in_memory.params_after


def test_a_translator_that_lost_the_check_is_written_as_plain_removal_as_in_memory(tmp_path):
    model, data = R.decoder("llama"), R.text_loader()
    params = {**OPTIONS, **CHECKED["plain_wins"], "check_fraction": 0.25}
    on_disk, _ = _both(model, data, tmp_path, **params)
    assert [c.used for c in on_disk.checks] == ["plain removal"]
    patched, _ = toast.compress(copy.deepcopy(model), data, method="toast", **params)
    loaded = toast.load_pretrained(tmp_path / "disk").eval()
    torch.testing.assert_close(R.outputs(loaded, data[0]), R.outputs(patched, data[0]))


@pytest.mark.parametrize("bound", [None, pair_nbytes(32, 0)])  # whole moments; rows on disk
def test_a_fit_the_check_kept_is_refitted_from_disk_as_in_memory(bound, tmp_path):
    model, data = R.decoder("llama"), R.text_loader()
    params = {**OPTIONS, **CHECKED["fit_wins"], "check_fraction": 0.25}
    if bound is not None:
        params["statistics_bytes"] = bound
    on_disk, in_memory = _both(model, data, tmp_path, **params)
    assert on_disk.refitted and in_memory.refitted
    chunked = isinstance(on_disk.analysis.moments, (ChunkedMoments, PairMoments))
    assert chunked == (bound is not None)
    patched, _ = toast.compress(copy.deepcopy(model), data, method="toast", **params)
    loaded = toast.load_pretrained(tmp_path / "disk").eval()
    torch.testing.assert_close(R.outputs(loaded, data[0]), R.outputs(patched, data[0]))
