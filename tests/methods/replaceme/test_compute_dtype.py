"""ReplaceMe on a float32 model whose forwards run under bf16 autocast
(``compute_dtype="bfloat16"``): the fold check allows for bf16 rounding
without letting a step after the MLP through, and the model keeps float32."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests._helpers import replaceme_models as R  # noqa: E402
from toast.methods.replaceme import NotFoldableError, replaceme  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

OPTIONS = {"spans": [(2, 4)], "check_fraction": 0.0, "progress": False}


def test_a_transform_folds_into_the_mlp_when_the_forwards_run_in_bf16():
    model, report = replaceme(
        R.decoder("llama"), R.text_loader(), placement="mlp", compute_dtype="bfloat16", **OPTIONS
    )
    assert report.spans and all(p.dtype == torch.float32 for p in model.parameters())


def test_a_step_after_the_mlp_is_still_caught_under_bf16():
    # a scale between the MLP's output and the residual add, which no
    # structure discovery sees: the shifted output moves twice as far
    model = R.decoder("llama")
    for layer in model.model.layers:
        layer.mlp.register_forward_hook(lambda module, args, out: 2 * out)
    with pytest.raises(NotFoldableError, match="relative mismatch"):
        replaceme(model, R.text_loader(), placement="mlp", compute_dtype="bfloat16", **OPTIONS)
