"""TOAST's massive-row correction from a checkpoint on disk: the rows
massive in some state are recorded as in memory, and the corrected
translators equal the in-memory ones."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import toast  # noqa: E402
from tests._helpers import replaceme_models as R  # noqa: E402
from toast.methods.translate import analyze, analyze_from_disk  # noqa: E402
from toast.methods.translate.from_disk import compress_from_disk  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

TOKEN, FEATURE, OUT = 43, 5, 7


def _massive_at_block_2() -> torch.nn.Module:
    """A tiny Llama whose block 2 makes the rows of one token massive: the
    token's embedding is one feature, which block 2's MLP squares into
    another (a sink saved in the weights, unlike a hook)."""
    model = R.decoder("llama")
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        typical = embed.norm(dim=1).median()
        embed[TOKEN] = 0
        embed[TOKEN, FEATURE] = 5 * typical
        mlp = model.model.layers[2].mlp
        for proj in (mlp.gate_proj, mlp.up_proj):
            proj.weight[0] = 0
            proj.weight[0, FEATURE] = 3.0
        mlp.down_proj.weight[:, 0] = 0
        mlp.down_proj.weight[OUT, 0] = 1.0
    return model


def test_massive_rows_recorded_from_disk_equal_those_recorded_in_memory(tmp_path):
    model, data = _massive_at_block_2(), R.text_loader()
    model.save_pretrained(tmp_path)
    a = analyze_from_disk(tmp_path, data, estimator="gcv", massive_rows=True, progress=False)
    b = analyze(model, data, estimator="gcv", massive_rows=True, progress=False)
    assert a.massive.created(1, 4).any()  # the model has rows to correct
    np.testing.assert_array_equal(a.massive.flags, b.massive.flags)
    np.testing.assert_array_equal(a.massive.states, b.massive.states)


def test_corrected_translator_from_disk_equals_in_memory(tmp_path):
    model, data = _massive_at_block_2(), R.text_loader()
    model.save_pretrained(tmp_path / "source")
    options = {"spans": [(1, 4)], "translator": "affine", "check_fraction": 0.0, "progress": False}
    out = {}
    for rows in ("plain", "fit"):
        report = compress_from_disk(
            tmp_path / "source", data, tmp_path / rows, massive_rows=rows, **options
        )
        out[rows] = toast.load_pretrained(tmp_path / rows).eval()
        assert report.spans[0].start == 1
    patched, _ = toast.compress(copy.deepcopy(model), data, method="toast", **options)
    batch = data[0]
    assert torch.equal(R.outputs(out["plain"], batch), R.outputs(patched, batch))
    assert not torch.equal(R.outputs(out["fit"], batch), R.outputs(patched, batch))
