"""A planted massive activation (block 2 of a tiny Llama adds a vector 100
times the typical norm to the first token of every sequence): an affine
translator of blocks[2:4] fitted on every row, as the papers fit it, ends
further from the original model than plain removal; toast's default, which
leaves those rows as plain removal leaves them, ends closer."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import toast  # noqa: E402
from tests._helpers import replaceme_models as R  # noqa: E402
from toast.hf.evaluate.quality import skipped_blocks  # noqa: E402
from toast.hf.model.blocks import find_blocks  # noqa: E402
from toast.spans import Span  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

SPAN = (2, 4)


@pytest.mark.parametrize("translator", ["affine", "linear"])
def test_papers_translator_loses_to_plain_removal_and_the_default_does_not(translator):
    original, calib, heldout = R.with_sink(), R.text_loader(96), R.text_loader(48, seed=1)
    plain = copy.deepcopy(original)
    with skipped_blocks(find_blocks(plain), [Span(*SPAN, 0.0)]):
        plain_distance = R.logit_distance(plain, original, heldout)
    options = {"method": "toast", "spans": [SPAN], "check_fraction": 0.0, "progress": False}
    options["translator"] = translator
    papers, _ = toast.compress(copy.deepcopy(original), calib, massive_rows="fit", **options)
    default, report = toast.compress(copy.deepcopy(original), calib, **options)
    assert R.logit_distance(papers, original, heldout) > 1.5 * plain_distance
    assert R.logit_distance(default, original, heldout) < plain_distance
    assert report.analysis.massive is not None and report.analysis.massive.created(*SPAN).any()


def test_without_a_sink_the_default_translator_is_the_papers():
    model, calib = R.decoder("llama"), R.text_loader(48)
    options = {"method": "toast", "spans": [SPAN], "check_fraction": 0.0, "progress": False}
    papers, _ = toast.compress(copy.deepcopy(model), calib, massive_rows="fit", **options)
    default, report = toast.compress(copy.deepcopy(model), calib, **options)
    assert report.analysis.massive is not None
    assert not report.analysis.massive.created(*SPAN).any()
    for batch in calib[:2]:
        assert torch.equal(R.outputs(default, batch), R.outputs(papers, batch))
