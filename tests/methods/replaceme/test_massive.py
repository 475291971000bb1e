"""A planted massive activation: block 2 of a tiny Llama adds a vector 100
times the typical hidden-state norm to the first token of every sequence
(an attention sink's jump). Removing blocks[2:4] asks the fit to create it
from block 1's MLP output, which varies with the token: the paper's least
squares follows those few rows and every other token pays, so it ends
further from the original model than plain removal; toast's default fit
(those rows left as plain removal leaves them) does not."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests._helpers import replaceme_models as R  # noqa: E402
from toast.hf.evaluate.quality import skipped_blocks  # noqa: E402
from toast.hf.model.blocks import find_blocks  # noqa: E402
from toast.methods.replaceme import replaceme  # noqa: E402
from toast.spans import Span  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

SPAN = (2, 4)


def test_paper_least_squares_loses_to_plain_removal_and_the_default_fit_does_not():
    original, calib, heldout = R.with_sink(), R.text_loader(96), R.text_loader(48, seed=1)
    plain = copy.deepcopy(original)
    with skipped_blocks(find_blocks(plain), [Span(*SPAN, 0.0)]):
        plain_distance = R.logit_distance(plain, original, heldout)
    paper, _ = replaceme(
        copy.deepcopy(original), calib, spans=[SPAN], massive_rows="fit", check_fraction=0.0
    )
    default, report = replaceme(copy.deepcopy(original), calib, spans=[SPAN])
    assert R.logit_distance(paper, original, heldout) > 1.5 * plain_distance
    assert R.logit_distance(default, original, heldout) < plain_distance
    assert report.checks[0] is not None  # 12 batches: one held out and checked
