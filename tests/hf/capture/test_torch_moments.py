"""The torch backend of the moments against the C core on the same rows."""

import numpy as np
import pytest

from tests._helpers import assert_rel, make_states

torch = pytest.importorskip("torch")

import toast  # noqa: E402
from toast.core.moments import ROW_STATS  # noqa: E402
from toast.hf.capture.torch_moments import TorchMoments, WindowedMoments  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _states(S, n, d, seed):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(n, d, generator=gen, dtype=torch.float64)
    return [
        base + 0.3 * k * torch.randn(n, d, generator=gen, dtype=torch.float64) for k in range(S)
    ]


@pytest.mark.parametrize(
    "folds,pairs", [(0, "all"), (3, "all"), (0, "consecutive"), (4, 2)], ids=str
)
def test_torch_storage_equals_the_core_storage(folds, pairs):
    S, d = 4, 6
    c = toast.Moments(S, d, folds=folds, pairs=pairs)
    t = TorchMoments(S, d, folds=folds, pairs=pairs)
    for seed, n in enumerate((7, 1, 13)):
        states = _states(S, n, d, seed)
        mask = torch.arange(n) % 3 != 1
        c.update(states, mask=mask)
        t.update(states, mask=mask)
    converted = t.to_moments()
    assert converted.rows == c.rows
    np.testing.assert_allclose(converted._get_data(), c._get_data(), rtol=1e-12, atol=1e-12)


def test_zero_rows_follow_the_core_cosine_convention():
    # A zero vector against a zero vector agrees (cos 1); against anything else, cos 0.
    states = [torch.zeros(3, 4, dtype=torch.float64), torch.zeros(3, 4, dtype=torch.float64)]
    states[1][0] = 1.0
    c = toast.Moments(2, 4).update(states)
    t = TorchMoments(2, 4)
    t.update(states)
    np.testing.assert_allclose(t.to_moments()._get_data(), c._get_data(), atol=1e-15)


def test_mixed_precision_is_close_to_float64():
    states = [s.float() for s in _states(3, 50, 8, 1)]
    exact = TorchMoments(3, 8)
    mixed = TorchMoments(3, 8, precision="mixed")
    exact.update(states)
    mixed.update(states)
    assert_rel(mixed.to_moments().cross(0, 2), exact.to_moments().cross(0, 2), 1e-5, "cross")


def test_non_finite_rows_are_rejected_naming_the_state():
    states = _states(3, 5, 4, 2)
    states[2][1, 1] = float("nan")
    t = TorchMoments(3, 4)
    with pytest.raises(ValueError, match=r"states\[2\]"):
        t.update(states)
    assert t.rows == 0


def test_layout_is_validated_like_the_core():
    with pytest.raises(ValueError, match="folds"):
        TorchMoments(3, 4, folds=1)
    with pytest.raises(ValueError, match="shape"):
        TorchMoments(2, 4).update([torch.zeros(3, 4), torch.zeros(3, 5)])


hf_models = pytest.importorskip("tests._helpers.hf_models")


@pytest.mark.hf
# BERT's rank-deficient states
@pytest.mark.filterwarnings("ignore::toast.core.IllConditionedWarning")
@pytest.mark.parametrize("name", ["vit", "bert", "llama"])
def test_capture_backends_agree(name):
    family = next(f for f in hf_models.FAMILIES if f.name == name)
    model = hf_models.build(family)
    batches = hf_models.loader(family, n=24, batch_size=5)
    on_host, _ = toast.hf.capture_moments(model, batches, folds=3, backend="c", progress=False)
    on_device, _ = toast.hf.capture_moments(
        model, batches, folds=3, backend="torch", progress=False
    )
    assert on_device.rows == on_host.rows
    np.testing.assert_allclose(on_device._get_data(), on_host._get_data(), rtol=1e-9, atol=1e-9)
    e_host = toast.error_matrix(on_host, estimator="cv")
    e_device = toast.error_matrix(on_device, estimator="cv")
    np.testing.assert_allclose(e_device, e_host, rtol=1e-8, atol=1e-12)


@pytest.mark.hf
def test_capture_of_chosen_states_equals_the_full_capture():
    family = hf_models.FAMILIES[0]
    model = hf_models.build(family)
    batches = hf_models.loader(family, n=6, batch_size=3)
    full, _ = toast.hf.capture_moments(model, batches, folds=0, progress=False)
    part, _ = toast.hf.capture_moments(model, batches, states=[1, 3], folds=0, progress=False)
    assert part.num_states == 2
    np.testing.assert_array_equal(part.cross(0, 1), full.cross(1, 3))
    with pytest.raises(ValueError, match="out of range"):
        toast.hf.capture_moments(model, batches, states=[0, 9], progress=False)


def _far_row_stats(m: toast.Moments) -> np.ndarray:
    """A mask of the storage: the row statistics of pairs beyond the span."""
    layout, S = m.layout(), m.num_states
    far = np.zeros(layout["set_len"], dtype=bool)
    span = np.triu(np.ones((S, S), dtype=bool), layout["span"] + 1)
    for k in range(len(ROW_STATS)):
        at = layout["off_rowstats"] + k * S * S
        far[at : at + S * S] = span.reshape(-1)
    return np.tile(far, layout["nsets"])


@pytest.mark.parametrize("folds,pairs", [(0, "consecutive"), (3, 2), (4, 1)], ids=str)
def test_windowed_moments_state_by_state_equal_the_core_on_whole_batches(folds, pairs):
    S, d = 5, 6
    c = toast.Moments(S, d, folds=folds, pairs=pairs)
    w = WindowedMoments(S, d, folds=folds, pairs=pairs)
    batches = [(_states(S, n, d, seed), torch.arange(n) % 3 != 1) for seed, n in enumerate((7, 13))]
    for states, mask in batches:
        c.update(states, mask=mask)
    for j in range(S):  # state by state, as the pass from disk sees them
        for states, mask in batches:
            w.add_state(j, states[max(j - w.span, 0) : j + 1], mask)
    got, want, far = w.to_moments()._get_data(), c._get_data(), _far_row_stats(c)
    assert np.isnan(got[far]).all()
    np.testing.assert_allclose(got[~far], want[~far], rtol=1e-12, atol=1e-12)


def test_windowed_moments_refuse_a_window_of_the_wrong_length():
    w = WindowedMoments(4, 3, pairs=2)
    with pytest.raises(ValueError, match="pairs with states 1..3: expected 3 tensors"):
        w.add_state(3, _states(2, 5, 3, 0))


@pytest.mark.parametrize("precision", ["float64", "mixed"])
def test_restricted_torch_moments_equal_restricted_core_moments(precision):
    X = [torch.from_numpy(x) for x in make_states(21, 2, 300, 16)]
    asked = {"precision": precision, "row_stats": False, "sources": 1}
    t = TorchMoments(2, 16, **asked)
    t.update(X)
    c = toast.Moments(2, 16, **asked).update(X)
    got = t.to_moments()
    assert (got.row_stats, got.sources) == (False, 1)
    tol = 1e-6 if precision == "mixed" else 1e-12  # of the storage's norm
    assert_rel(got._get_data(), c._get_data(), tol, "storage")
