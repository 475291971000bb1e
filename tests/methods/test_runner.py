"""Measured quality in every method's report (toast.methods.runner): each of
the three figures equals the same measurement made independently on a model
built the plain way (an untouched copy, plain removal by surgery, the
returned model)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import toast  # noqa: E402
from tests._helpers.replaceme_models import decoder, encoder, image_loader, text_loader  # noqa: E402
from toast.hf.quality import Evaluator  # noqa: E402
from toast.hf.surgery import replace_spans  # noqa: E402
from toast.methods.replaceme import replaceme  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


def _measure(model, heldout) -> float:
    evaluator = Evaluator(heldout, progress=False)
    return evaluator.measure(model)


def test_replaceme_reports_perplexity_of_original_plain_removal_and_pruned():
    model = decoder("llama")
    original = copy.deepcopy(model)
    calibration, heldout = text_loader(n=32, seed=0), text_loader(n=16, seed=1)
    pruned, report = replaceme(
        model, calibration, num_blocks=2, heldout=heldout, progress=False
    )
    spans = [(s.start, s.stop) for s in report.spans]
    dropped = copy.deepcopy(original)
    replace_spans(dropped, spans, [torch.nn.Identity()] * len(spans))
    quality = report.quality
    assert quality is not None and quality.metric == "perplexity"
    assert quality.original == pytest.approx(_measure(original, heldout), rel=1e-6)
    assert quality.plain_removal == pytest.approx(_measure(dropped, heldout), rel=1e-6)
    assert quality.compressed == pytest.approx(_measure(pruned, heldout), rel=1e-6)
    assert "plain removal of the same blocks" in report.to_markdown()


def test_toast_reports_the_cosine_of_outputs_for_an_encoder():
    model = encoder("vit")
    original = copy.deepcopy(model)
    calibration, heldout = image_loader(n=24, seed=0), image_loader(n=16, seed=1)
    compressed, report = toast.compress(
        model, calibration, budget=2, heldout=heldout, progress=False
    )
    spans = [(s.start, s.stop) for s in report.spans]
    dropped = copy.deepcopy(original)
    replace_spans(dropped, spans, [torch.nn.Identity()] * len(spans))
    reference = Evaluator(heldout, progress=False)
    reference.measure(original)
    quality = report.quality
    assert quality is not None and quality.metric == "cosine"
    assert quality.original == pytest.approx(1.0, abs=1e-6)
    assert quality.plain_removal == pytest.approx(reference.measure(dropped), rel=1e-6)
    assert quality.compressed == pytest.approx(reference.measure(compressed), rel=1e-6)


def test_a_method_that_removes_no_block_reports_no_plain_removal():
    model = encoder("vit")
    _, report = toast.compress(
        model, method="toast-vit", head_sparsity=0.5, heldout=image_loader(n=8), progress=False
    )
    assert report.quality is not None and report.quality.plain_removal is None
    assert "Measured on held-out data" in report.to_markdown()


def test_without_held_out_data_the_report_measures_nothing():
    _, report = replaceme(decoder("llama"), text_loader(n=16), num_blocks=1, progress=False)
    assert report.quality is None and "Measured" not in report.to_markdown()


def test_a_held_out_fraction_needs_raw_text():
    with pytest.raises(ValueError, match="fraction of raw text"):
        replaceme(decoder("llama"), text_loader(n=16), num_blocks=1, heldout=0.25)
