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
from toast.hf.blocks import find_blocks  # noqa: E402
from toast.hf.quality import skipped_blocks  # noqa: E402
from toast.methods.replaceme import replaceme  # noqa: E402
from toast.spans import Span  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

SPAN = (2, 4)


def _with_sink(scale: float = 100.0) -> torch.nn.Module:
    model = R.decoder("llama")
    sink = torch.zeros(R.HIDDEN)
    sink[3] = scale

    def add_sink(module, args, output):
        hidden = (output[0] if isinstance(output, tuple) else output).clone()
        hidden[:, 0] += sink  # the first token of every sequence
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    find_blocks(model).blocks[2].register_forward_hook(add_sink)
    return model


def _distance(model, original, batches) -> float:
    """Relative L2 distance of the logits to the original's, on real tokens."""
    num = den = 0.0
    for batch in batches:
        got, want = R.outputs(model, batch), R.outputs(original, batch)
        real = batch["attention_mask"].bool()
        num += float((got - want)[real].pow(2).sum())
        den += float(want[real].pow(2).sum())
    return (num / den) ** 0.5


def test_paper_least_squares_loses_to_plain_removal_and_the_default_fit_does_not():
    original, calib, heldout = _with_sink(), R.text_loader(96), R.text_loader(48, seed=1)
    plain = copy.deepcopy(original)
    with skipped_blocks(find_blocks(plain), [Span(*SPAN, 0.0)]):
        plain_distance = _distance(plain, original, heldout)
    paper, _ = replaceme(
        copy.deepcopy(original), calib, spans=[SPAN], massive_rows="fit", holdout=0.0
    )
    default, report = replaceme(copy.deepcopy(original), calib, spans=[SPAN])
    assert _distance(paper, original, heldout) > 1.5 * plain_distance
    assert _distance(default, original, heldout) < plain_distance
    assert report.checks[0] is not None  # 12 batches: one held out and checked
