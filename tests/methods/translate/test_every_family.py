"""``toast.compress(model, data, budget=n)`` (TOAST, every default) runs on a
tiny model of every supported decoder family, norms after the MLP included,
and is never worse than plain removal of its spans on the held-out batches
its check measured (the check's fallback guarantees it; measured here)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import toast  # noqa: E402
from tests._helpers import replaceme_models as R  # noqa: E402
from toast.hf.evaluate.check import CheckSplit  # noqa: E402
from toast.hf.model.surgery import remove_blocks  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

FAMILIES = sorted(R.DECODERS) + sorted(R.POST_NORM_DECODERS)


@pytest.mark.parametrize("name", FAMILIES)
def test_default_compress_runs_and_is_never_worse_than_plain_removal_held_out(name):
    model, data = R.decoder(name), R.text_loader(80)  # 10 batches: the last one held out
    original = copy.deepcopy(model)
    pruned, report = toast.compress(model, data, budget=2, progress=False)
    assert report.blocks_removed >= 1 and all(c is not None for c in report.checks)
    plain = remove_blocks(copy.deepcopy(original), [(s.start, s.stop) for s in report.spans])
    held = list(CheckSplit(data, 0.1).check)
    assert R.next_token_loss(pruned, held) <= R.next_token_loss(plain, held) + 1e-9
