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
from toast.hf.evaluate.quality import Evaluator  # noqa: E402
from toast.hf.model.surgery import replace_spans  # noqa: E402
from toast.methods.replaceme import replaceme  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


def _measure(model, heldout) -> float:
    evaluator = Evaluator(heldout, progress=False)
    return evaluator.measure(model)


def test_replaceme_reports_perplexity_of_original_plain_removal_and_pruned():
    model = decoder("llama")
    original = copy.deepcopy(model)
    calibration, heldout = text_loader(n=32, seed=0), text_loader(n=16, seed=1)
    pruned, report = replaceme(model, calibration, num_blocks=2, heldout=heldout, progress=False)
    spans = [(s.start, s.stop) for s in report.spans]
    dropped = copy.deepcopy(original)
    replace_spans(dropped, spans, [torch.nn.Identity()] * len(spans))
    quality = report.quality
    assert quality is not None and quality.metric == "perplexity"
    assert quality.original == pytest.approx(_measure(original, heldout), rel=1e-6)
    assert quality.plain_removal == pytest.approx(_measure(dropped, heldout), rel=1e-6)
    assert quality.compressed == pytest.approx(_measure(pruned, heldout), rel=1e-6)
    assert "plain removal of the same blocks" in report.to_markdown()


def test_the_report_carries_each_models_fidelity_to_the_original():
    model = decoder("llama")
    original = copy.deepcopy(model)
    calibration, heldout = text_loader(n=32, seed=0), text_loader(n=16, seed=1)
    pruned, report = replaceme(model, calibration, num_blocks=2, heldout=heldout, progress=False)
    spans = [(s.start, s.stop) for s in report.spans]
    dropped = copy.deepcopy(original)
    replace_spans(dropped, spans, [torch.nn.Identity()] * len(spans))
    evaluator = Evaluator(heldout, progress=False)
    quality = report.quality
    assert quality is not None
    for key, built in (("original", original), ("plain_removal", dropped), ("compressed", pruned)):
        evaluator.measure(built)
        assert quality.metrics[key] == pytest.approx(evaluator.last, rel=1e-6, abs=1e-9), key
    assert quality.metrics["compressed"]["kl"] > 0 and "| top-1 agreement |" in report.to_markdown()


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


# Block discovery: one search for the model's structure per toast.compress
# call, passed down from there; later lookups go by the stack found or its path.


@pytest.fixture
def discoveries(monkeypatch):
    """Counts the searches for a model's blocks: ``find_blocks`` given
    neither a stack found before nor its path, and ``vit_blocks``, wherever a
    module imported them."""
    import importlib
    import sys

    from toast.hf.model import blocks as hf_blocks
    from toast.hf.model import vit

    for name in toast.methods.available_methods():  # every module a run may import
        toast.methods.get_method(name)
    for module in (
        "toast.methods.translate.from_disk",
        "toast.hf.capture.sequential",
        "toast.io.save",
    ):
        importlib.import_module(module)
    counts = {"find_blocks": 0, "vit_blocks": 0}

    def counting(name, original):
        def wrapper(model, *args, **kwargs):
            found = (args[0] if args else kwargs.get("blocks")) if name == "find_blocks" else None
            if found is None:
                counts[name] += 1
            return original(model, *args, **kwargs)

        return wrapper

    for name, original in (("find_blocks", hf_blocks.find_blocks), ("vit_blocks", vit.vit_blocks)):
        wrapper = counting(name, original)
        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith(("toast", "tests")):
                if getattr(module, name, None) is original:
                    monkeypatch.setattr(module, name, wrapper)
    return counts


@pytest.mark.parametrize(
    ("method", "options"),
    [("toast", {"budget": 2}), ("replaceme", {"num_blocks": 2})],
)
def test_compress_finds_the_blocks_once_with_heldout_quality(method, options, discoveries):
    model = decoder("llama")
    calibration, heldout = text_loader(n=16, seed=0), text_loader(n=8, seed=1)
    toast.compress(model, calibration, method=method, heldout=heldout, progress=False, **options)
    assert discoveries == {"find_blocks": 1, "vit_blocks": 0}


def test_toast_vit_finds_the_blocks_once(discoveries):
    toast.compress(encoder("vit"), method="toast-vit", head_sparsity=0.5, progress=False)
    assert discoveries == {"find_blocks": 0, "vit_blocks": 1}


@pytest.mark.parametrize("sequential", [True, False], ids=["from disk", "in memory"])
@pytest.mark.parametrize(
    ("method", "options"),
    [("toast", {"budget": 2, "estimator": "gcv"}), ("replaceme", {"num_blocks": 2})],
)
def test_compress_on_a_folder_finds_the_blocks_once_on_either_path(
    method, options, sequential, discoveries, tmp_path
):
    decoder("llama").save_pretrained(tmp_path / "source")
    toast.compress(
        tmp_path / "source", text_loader(n=16), method=method, output=tmp_path / "out",
        sequential=sequential, progress=False, **options,
    )  # fmt: skip
    assert discoveries == {"find_blocks": 1, "vit_blocks": 0}
