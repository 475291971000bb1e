"""Ghosted Layers (arXiv 2605.15491) through TOAST's options
(:meth:`toast.methods.translate.config.ToastConfig.ghosted`) against a NumPy
reference from the paper's definitions: LLM-Streamline's window (highest
mean token cosine between its input and output states, start >= 1, ending
before the last block) and ``W = I + (XᵀX + εI)⁻¹ Xᵀ(Y − X)`` in float64,
applied to the output of the block before the window."""

import copy

import numpy as np
import pytest

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
from toast.methods.translate.config import GHOSTED_RIDGE, ToastConfig  # noqa: E402


def _states(model, batches):
    """Every state before the final norm, non-pad tokens stacked (float64)."""
    samples = per_sample_states(model, batches)
    return [np.concatenate([x[k] for x in samples]) for k in range(len(samples[0]))]


def _streamline_window(states, n):
    """LLM-Streamline's rule by brute force: the window of n blocks whose
    input and output states have the highest mean token cosine."""

    def cos(a, b):
        return np.sum(a * b, 1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))

    similarity = {s: cos(states[s], states[s + n]).mean() for s in range(1, LAYERS - n)}
    start = max(similarity, key=similarity.get)
    return start, start + n


def _ghosted_operator(x, y, eps=GHOSTED_RIDGE):
    d = x.shape[1]
    return np.eye(d) + np.linalg.solve(x.T @ x + eps * np.eye(d), x.T @ (y - x))


@pytest.mark.parametrize("n", [1, 2])
def test_ghosted_equals_the_numpy_reference(n):
    model, batches = decoder("llama"), text_loader()
    states = _states(model, batches)
    window = _streamline_window(states, n)
    w = _ghosted_operator(states[window[0]], states[window[1]])
    config = ToastConfig.ghosted(n, progress=False)
    pruned, report = toast.compress(copy.deepcopy(model), batches, method="toast", config=config)
    assert [(s.start, s.stop) for s in report.spans] == [window]
    inserted = pruned.model.layers[window[0]]
    linear = next(m for m in inserted.modules() if isinstance(m, torch.nn.Linear))
    assert linear.bias is None or not linear.bias.detach().any()
    got = linear.weight.detach().double().numpy().T
    np.testing.assert_allclose(got, w, atol=2e-6 * np.abs(w).max())
    reference = window_with_hook(model, window, w)
    for batch in batches[:2]:
        torch.testing.assert_close(
            outputs(pruned, batch), outputs(reference, batch), atol=1e-5, rtol=1e-5
        )


def test_identity_target_is_least_squares_at_zero_ridge_and_shrinks_to_identity():
    """``ridge_target="identity"``: at λ = 0 the plain least-squares fit
    ``X W ≈ Y`` (``lstsq``); at a huge λ the identity."""
    model, batches = decoder("llama"), text_loader()
    states = _states(model, batches)
    x, y = states[2], states[4]
    ls = np.linalg.lstsq(x, y, rcond=None)[0]

    def weight(**options):
        options = {**{"check_fraction": 0.0, "massive_rows": "fit", "progress": False}, **options}
        pruned, _ = toast.compress(
            copy.deepcopy(model), batches, method="toast", spans=[(2, 4)], **options
        )
        linear = next(m for m in pruned.model.layers[2].modules() if isinstance(m, torch.nn.Linear))
        return linear.weight.detach().double().numpy().T

    scale = np.abs(ls).max()
    for target in ("zero", "identity"):
        got = weight(translator="linear", ridge=0.0, ridge_target=target)
        np.testing.assert_allclose(got, ls, atol=1e-5 * scale)
    huge = weight(translator="linear", ridge=1e12, ridge_target="identity")
    np.testing.assert_allclose(huge, np.eye(x.shape[1]), atol=1e-4)


def test_single_window_with_another_metric_takes_its_lowest_error():
    model, batches = decoder("llama"), text_loader()
    analysis = toast.analyze(model, batches, metric="mse", progress=False)
    n = 2
    best = min(((a, a + n) for a in range(1, LAYERS - n)), key=lambda s: (analysis.errors[s], s[0]))
    _, report = toast.compress(
        model, batches, method="toast", budget=n, single_window=True, metric="mse",
        check_fraction=0.0, progress=False,
    )  # fmt: skip
    assert [(s.start, s.stop) for s in report.spans] == [best]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"budget": 2, "ridge_target": "identity"}, "translator='linear'"),
        ({"spans": [(1, 2)], "single_window": True}, "one window"),
        ({"budget": 2, "single_window": True, "metric": "cka"}, "lower means redundant"),
    ],
)
def test_refused_combinations(options, match):
    with pytest.raises(ValueError, match=match):
        ToastConfig(**options)


def test_the_search_plan_is_the_papers_model():
    """TOAST's stages propose Ghosted Layers' plans (family ``"ghosted"``):
    the best window is LLM-Streamline's, and the plan applied is the model
    ``ToastConfig.ghosted`` gives, at the size it states."""
    from toast.methods.base import Sizes, capture_shared, find_layout
    from toast.methods.translate.stages import STAGES

    model, batches = decoder("llama"), text_loader()
    n = 2
    layout = find_layout(model)
    calibration = toast.Calibration(progress=False)
    shared = capture_shared(model, batches, layout, calibration, "auto")
    stats = STAGES.calibrate(model, batches, layout, shared, calibration, n)
    sizes = Sizes(
        toast.count_params(model), tuple(toast.count_params(b) for b in layout.stack.blocks)
    )
    plans = [p for p in STAGES.propose(stats, sizes, n, False) if p.family == "ghosted"]
    best = next(p for p in plans if p.blocks_removed == n)
    assert best.spans == (_streamline_window(_states(model, batches), n),)
    built, copied = copy.deepcopy((model, layout))
    STAGES.apply(built, best, stats, copied)
    assert toast.count_params(built) == best.params_after
    config = ToastConfig.ghosted(n, progress=False)
    paper, _ = toast.compress(copy.deepcopy(model), batches, method="toast", config=config)
    for batch in batches[:2]:
        torch.testing.assert_close(outputs(built, batch), outputs(paper, batch))
