"""LinearPatch against a NumPy reference written from the paper's
equations (arXiv 2505.24680): the window of largest mean token cosine,
``d`` = per-sample ratio of mean |x H| after and before it, averaged over
samples, and the patch ``H diag(d) Hᵀ`` on the residual stream in the
window's place; then save/reload and the search's use of it."""

import copy

import numpy as np
import pytest
import scipy.linalg

torch = pytest.importorskip("torch")

import toast  # noqa: E402
from tests._helpers.replaceme_models import (  # noqa: E402
    LAYERS,
    decoder,
    outputs,
    per_sample_states,
    text_loader,
    window_with_hook,
)
from toast.methods.linearpatch.method import linearpatch  # noqa: E402


def _reference(model, batches, n):
    """The paper's selection and scale, in NumPy, from the hidden states."""
    samples = per_sample_states(model, batches)
    width = samples[0][0].shape[1]
    h = scipy.linalg.hadamard(width) / np.sqrt(width)  # width 32: Sylvester's matrix

    def cos(a, b):
        return np.sum(a * b, 1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))

    similarity = {
        s: np.concatenate([cos(x[s], x[s + n]) for x in samples]).mean()
        for s in range(1, LAYERS - n)  # start >= 1, the last state never a window's end
    }
    start = max(similarity, key=similarity.get)
    ratios = [np.abs(x[start + n] @ h).mean(0) / np.abs(x[start] @ h).mean(0) for x in samples]
    d = np.mean(ratios, axis=0)
    return (start, start + n), h @ np.diag(d) @ h.T, d


@pytest.mark.parametrize("n", [1, 2])
def test_linearpatch_equals_the_numpy_reference_from_the_paper(n):
    model, batches = decoder("llama"), text_loader()
    window, patch, d = _reference(model, batches, n)
    pruned, report = linearpatch(copy.deepcopy(model), batches, num_blocks=n)
    assert [(s.start, s.stop) for s in report.spans] == [window]
    np.testing.assert_allclose(report.scales[0], d, rtol=1e-6)
    inserted = pruned.model.layers[window[0]]
    weight = next(m for m in inserted.modules() if isinstance(m, torch.nn.Linear)).weight
    np.testing.assert_allclose(weight.detach().double().numpy().T, patch, atol=1e-6)
    reference = window_with_hook(model, window, patch)
    for batch in batches[:2]:
        torch.testing.assert_close(
            outputs(pruned, batch), outputs(reference, batch), atol=1e-5, rtol=1e-5
        )


def test_params_drop_by_the_window_and_add_d_squared():
    model, batches = decoder("llama"), text_loader()
    before = sum(p.numel() for p in model.parameters())
    window_params = sum(p.numel() for p in model.model.layers[2].parameters())
    _, report = linearpatch(model, batches, spans=[(2, 3)])
    width = model.config.hidden_size
    assert report.params_after == before - window_params + width * width
    assert report.params_after == sum(p.numel() for p in model.parameters())


def test_without_rotation_the_patch_is_the_raw_channel_scale():
    model, batches = decoder("llama"), text_loader()
    samples = per_sample_states(model, batches)
    d = np.mean([np.abs(x[3]).mean(0) / np.abs(x[2]).mean(0) for x in samples], axis=0)
    _, report = linearpatch(model, batches, spans=[(2, 3)], rotate=False)
    np.testing.assert_allclose(report.scales[0], d, rtol=1e-6)


def test_saved_linearpatch_model_reloads_with_equal_outputs(tmp_path):
    model, batches = decoder("llama"), text_loader()
    pruned, _ = toast.compress(model, batches, method="linearpatch", num_blocks=2)
    toast.save_pretrained(pruned, tmp_path / "out")
    again = toast.load_pretrained(tmp_path / "out")
    for batch in batches[:2]:
        torch.testing.assert_close(outputs(again, batch), outputs(pruned, batch))


def test_a_window_outside_the_papers_range_is_refused_with_the_limit():
    with pytest.raises(ValueError, match="remove at most 4"):
        linearpatch(decoder("llama"), text_loader(), num_blocks=5)


def test_linearpatch_needs_data():
    with pytest.raises(ValueError, match="calibration data"):
        toast.compress(decoder("llama"), None, method="linearpatch", num_blocks=1)
