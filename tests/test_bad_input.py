"""What users will do wrong, end to end: each mistake gets a clear exception.

One table row per mistake: the call, the exception type, and a fragment of
the message that names the problem. Save/load mistakes live in
``test_save_load.py``; the core's own argument checks in
``test_binding_robustness.py``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
hf_models = pytest.importorskip("tests._helpers.hf_models")

import toast  # noqa: E402
from toast.hf.capture.states import ForwardError  # noqa: E402
from toast.hf.data.calibration import CalibrationSizeWarning  # noqa: E402
from toast.methods.replaceme import profile_distances, replaceme  # noqa: E402
from toast.methods.translate import FewRowsWarning  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

VIT = hf_models.FAMILIES[0]
BERT = next(f for f in hf_models.FAMILIES if f.name == "bert")


def vit():
    return hf_models.build(VIT)


def images(n=8, batch=4):
    return hf_models.loader(VIT, n, batch_size=batch)


def analyze(model, loader, **kw):
    return toast.analyze(model, loader, progress=False, **kw)


def compress(model, loader, **kw):
    return toast.compress(model, loader, progress=False, **kw)


def _masked_out_text():
    batch = hf_models.pad(hf_models.sentences(2))
    batch["attention_mask"].zero_()
    return [batch]


def _wrong_mask_shape():
    batch = hf_models.pad(hf_models.sentences(2))
    batch["attention_mask"] = batch["attention_mask"][:, :-1]
    return [batch]


class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())

    def forward(self, x):
        return self.body(x)


def _nan_in_block_2():
    model = vit()
    with torch.no_grad():
        model.layers[2].mlp.fc2.bias.fill_(float("nan"))
    return model


def _half_overflow():
    # float16 overflows to Inf in block 1: finite weights, but its MLP output
    # sums 64 products of ~6e4 each, past float16's largest value (65504)
    model = vit().half()
    with torch.no_grad():
        model.layers[1].mlp.fc2.weight.fill_(6e4)
    return model


def _stacked_per_sample_tensors():
    # tok(text, return_tensors="pt") per sample, stacked by a DataLoader: (batch, 1, tokens)
    batch = hf_models.pad(hf_models.sentences(4), length=9)
    return [{k: v[:, None, :] for k, v in batch.items()}]


def _transposed_lists():
    # tok(text) per sample (lists of ids) through the DataLoader's default collate
    samples = [{"input_ids": s[:4]} for s in hf_models.sentences(4, min_len=4)]
    return torch.utils.data.DataLoader(samples, batch_size=4)


def _meta_vit():
    with torch.device("meta"):
        return vit()


CASES = {
    # -- loaders ----------------------------------------------------------
    "batch of the wrong type": (
        lambda: analyze(vit(), [3.5]),
        TypeError,
        "each batch must be a tensor, a dict",
    ),
    "images with the wrong number of channels": (
        lambda: analyze(vit(), [torch.zeros(2, 1, 16, 16)]),
        ForwardError,
        r"failed on batch 0 of the loader \(float32\[2, 1, 16, 16\]\)",
    ),
    "images of the wrong size": (
        lambda: analyze(vit(), [torch.zeros(2, 3, 20, 20)]),
        ForwardError,
        r"float32\[2, 3, 20, 20\]\): ValueError: Input image size",
    ),
    "token ids where images are expected": (
        lambda: analyze(vit(), [{"input_ids": torch.ones(2, 5, dtype=torch.long)}]),
        ForwardError,
        "failed on batch 0",
    ),
    "empty loader": (lambda: analyze(vit(), []), ValueError, "yielded no rows"),
    "every token masked out": (
        lambda: analyze(hf_models.build(BERT), _masked_out_text()),
        ValueError,
        "every token masked out",
    ),
    "attention mask of the wrong shape": (
        lambda: analyze(hf_models.build(BERT), _wrong_mask_shape()),
        ValueError,
        r"attention_mask has shape \(2, \d+\) but the hidden states have",
    ),
    "a batch with no tensor": (
        lambda: analyze(vit(), [{"pixel_values": [1, 2, 3]}]),
        ValueError,
        "batch holds no tensor",
    ),
    "max_samples of zero": (
        lambda: analyze(vit(), images(), max_samples=0),
        ValueError,
        "max_samples must be an int in \\[1, inf\\) or None; got 0",
    ),
    "random subset of a plain list": (
        lambda: analyze(vit(), images(), max_samples=4, sample="random"),
        ValueError,
        "needs a torch DataLoader",
    ),
    "unknown token choice": (
        lambda: analyze(vit(), images(), tokens="first"),
        ValueError,
        "tokens must be one of",
    ),
    "per-sample return_tensors='pt' stacked by a DataLoader": (
        lambda: analyze(hf_models.build(BERT), _stacked_per_sample_tensors()),
        ValueError,
        r"input_ids has shape \(4, 1, 9\): each sample was tokenized with return_tensors='pt'",
    ),
    "per-sample token lists transposed by the default collate": (
        lambda: analyze(hf_models.build(BERT), _transposed_lists()),
        ValueError,
        "input_ids is a list of 4 tensors.*DataCollatorWithPadding",
    ),
    "a list of per-sample dicts": (
        lambda: analyze(hf_models.build(BERT), [[{"input_ids": torch.ones(5).long()}] * 3]),
        ValueError,
        "a batch is a list of 3 dicts, one per sample",
    ),
    # -- models ---------------------------------------------------------------
    "a model on the meta device": (
        lambda: analyze(_meta_vit(), images()),
        ValueError,
        "on the meta device: they hold no data",
    ),
    "not a module": (lambda: analyze("vit-base", images()), TypeError, "torch.nn.Module"),
    "no recognisable blocks": (
        lambda: analyze(_Mlp(), [torch.zeros(2, 4)]),
        ValueError,
        "pass blocks='...'",
    ),
    "blocks path that does not exist": (
        lambda: analyze(vit(), images(), blocks="encoder.layer"),
        ValueError,
        "has no attribute path 'encoder.layer'",
    ),
    "blocks path that is not a list": (
        lambda: analyze(vit(), images(), blocks="embeddings"),
        ValueError,
        "not a non-empty nn.ModuleList",
    ),
    "NaN weights": (
        lambda: analyze(_nan_in_block_2(), images()),
        toast.core.NonFiniteError,
        r"output of block 2 \(state 3\) contains NaN or Inf",
    ),
    "float16 overflow": (
        lambda: analyze(_half_overflow(), images()),
        toast.core.NonFiniteError,
        r"block 1 \(state 2\) contains NaN or Inf; in float16",
    ),
    # -- analysis and spans ---------------------------------------------------
    "unknown metric": (
        lambda: analyze(vit(), images(), metric="l1"),
        ValueError,
        "metric must be one of",
    ),
    "overlapping spans": (
        lambda: toast.io.replace_spans(vit(), [(1, 3), (2, 4)], [torch.nn.Identity()] * 2),
        ValueError,
        "overlap",
    ),
    "span beyond the depth": (
        lambda: toast.io.replace_spans(vit(), [(2, 6)], [torch.nn.Identity()]),
        ValueError,
        "0 <= start < stop <= 4",
    ),
    "empty span": (
        lambda: toast.io.replace_spans(vit(), [(2, 2)], [torch.nn.Identity()]),
        ValueError,
        "start < stop",
    ),
    "fewer translators than spans": (
        lambda: toast.io.replace_spans(vit(), [(1, 2), (3, 4)], [torch.nn.Identity()]),
        ValueError,
        "got 2 spans but 1 translators",
    ),
    "budget as large as the depth": (
        lambda: compress(vit(), images(), budget=4),
        ValueError,
        "num_blocks=4 must be between 1 and 3",
    ),
    "no budget, bound or spans": (
        lambda: compress(vit(), images()),
        ValueError,
        "give num_blocks=",
    ),
    "an error bound nothing meets": (
        lambda: compress(vit(), images(16), max_error=1e-300, estimator="gcv"),
        ValueError,
        "no span satisfies",
    ),
    "unknown translator": (
        lambda: compress(vit(), images(), budget=1, translator="conv"),
        ValueError,
        "translator must be one of",
    ),
    "plan on a similarity metric": (
        lambda: analyze(vit(), images(), metric="cka").plan(max_blocks=1),
        ValueError,
        "lower means redundant",
    ),
    "a trained translator with no steps": (
        lambda: compress(vit(), images(), spans=[(1, 2)], translator="mlp", train_steps=0),
        ValueError,
        "train_steps must be an int in \\[1, inf\\); got 0",
    ),
    "a row sample of no rows": (
        lambda: compress(vit(), images(), spans=[(1, 2)], translator="mlp", max_rows=0),
        ValueError,
        "max_rows must be an int in \\[1, inf\\); got 0",
    ),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bad_input_gets_a_clear_exception(case):
    call, error, fragment = CASES[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(error, match=fragment):
            call()


def test_the_table_is_large_enough():
    assert len(CASES) >= 25


def test_a_failed_forward_keeps_the_original_exception():
    with pytest.raises(ForwardError) as info:
        analyze(vit(), [torch.zeros(2, 1, 16, 16)])
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.filterwarnings("ignore::toast.core.IllConditionedWarning")  # the analysis itself
def test_a_translator_from_fewer_rows_than_features_warns_and_uses_ridge():
    # 8 CLS rows of width 32: plain least squares would interpolate them.
    model = vit()
    with pytest.warns(FewRowsWarning, match="8 rows of width 32"):
        # every image fits (none held out for the check): the warning counts them all
        model, report = compress(
            model, images(8), spans=[(1, 3)], tokens="cls", folds=2, check_fraction=0
        )
    assert report.conditions[0] < 1e6  # the ridge keeps the system well posed


def test_a_non_finite_state_is_named_by_its_index_in_the_model():
    with pytest.raises(toast.core.NonFiniteError) as info:
        analyze(_nan_in_block_2(), images())
    assert info.value.state == 3  # the output of block 2


def test_a_post_ln_model_explains_its_rank_loss_once():
    # BERT ends each block with a LayerNorm: every state lacks one direction.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, report = compress(hf_models.build(BERT), hf_models.loader(BERT, 64, 16), budget=2)
    ill = [str(w.message) for w in caught if w.category is toast.core.IllConditionedWarning]
    assert len(ill) == 1 and "post-LN" in ill[0] and "no ridge is needed" in ill[0]
    assert "singular, rank 31 of 32" in report.to_markdown()


def test_an_ill_conditioned_fit_that_is_not_structural_suggests_a_ridge_value():
    from toast.core.errors import explain_rank_deficiency

    text = explain_rank_deficiency(rank=20, dim=32, rows=16, ridge_hint=0.0123)
    assert "fewer rows (16) than the width (32)" in text and "--ridge 0.0123" in text


def test_too_little_calibration_data_says_how_many_samples_would_suffice():
    # 8 images of 17 tokens: 136 rows, 27 per fold of 5, below the width 32
    with pytest.warns(CalibrationSizeWarning, match=r"About 10 samples \(165 rows"):
        analyze(vit(), images(8))


def test_enough_calibration_data_gives_no_size_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", CalibrationSizeWarning)
        analyze(vit(), images(16))  # 272 rows: 54 per fold


@pytest.mark.parametrize("backend", ["c", "torch"])
@pytest.mark.parametrize("tokens", ["last", "cls", "mean"])
def test_an_all_padding_sample_adds_no_row(tokens, backend):
    batch = hf_models.pad(hf_models.sentences(4))
    padded = {k: torch.cat([v, torch.zeros_like(v[:1])]) for k, v in batch.items()}
    model = hf_models.build(BERT)
    options = {"tokens": tokens, "estimator": "gcv", "backend": backend}
    plain = analyze(model, [batch], **options)
    extra = analyze(model, [padded], **options)
    assert extra.rows == plain.rows == 4
    np.testing.assert_allclose(extra.moments.cross(1, 1), plain.moments.cross(1, 1), rtol=1e-12)


def test_an_all_padding_sample_leaves_replacemes_profile_unchanged():
    llama = next(f for f in hf_models.FAMILIES if f.name == "llama")
    model = hf_models.build(llama)
    batch = hf_models.pad(hf_models.sentences(4))
    padded = {k: torch.cat([v, torch.zeros_like(v[:1])]) for k, v in batch.items()}
    plain = profile_distances(model, [batch], progress=False)
    extra = profile_distances(model, [padded], progress=False)
    assert extra.rows == plain.rows == 4
    np.testing.assert_allclose(extra.matrix(), plain.matrix(), rtol=1e-12)


def test_replaceme_from_fewer_rows_than_the_width_says_how_many_samples_would_suffice():
    llama = next(f for f in hf_models.FAMILIES if f.name == "llama")
    data = [hf_models.pad(hf_models.sentences(2, min_len=3, max_len=3))]  # 6 rows, width 32
    with pytest.warns(CalibrationSizeWarning, match=r"6 rows from 2 samples.*About 11"):
        replaceme(hf_models.build(llama), data, num_blocks=1, check_fraction=0, progress=False)


def test_an_ill_conditioned_fit_names_its_cause_and_a_ridge_value():
    moments = toast.Moments(num_states=2, dim=8)
    x = np.random.default_rng(0).standard_normal((4, 8))  # 4 rows, width 8
    moments.update([x, x])
    fewer = r"fewer rows \(4\) than the width \(8\)"
    with pytest.warns(toast.core.IllConditionedWarning, match=fewer):
        toast.fit_translator(moments, 0, 1, kind="linear")
