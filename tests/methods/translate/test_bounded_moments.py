"""TOAST's moments within a memory bound: the span-bounded default and the
rows on disk (statistics_bytes) give the all-pairs plan, errors and fits."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import toast  # noqa: E402
from tests._helpers import replaceme_models as R  # noqa: E402
from toast.core.chunked import ChunkedMoments, pair_nbytes  # noqa: E402
from toast.methods.translate.config import ToastConfig  # noqa: E402
from toast.methods.translate.from_disk import compress_from_disk  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

#: The least bound of the test decoder's width (32) with 5 folds: one source, one target.
LEAST = pair_nbytes(32, 5)
# held-out folds: their statistics are what the bounds below are sized for
OPTIONS = {
    "budget": 2,
    "translator": "affine",
    "progress": False,
    "check_fraction": 0.0,
    "estimator": "cv",
}


def _weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_default_pairs_reach_the_budget_or_the_longest_given_span():
    assert ToastConfig(budget=3).pairs == 3
    assert ToastConfig(budget=3, max_span=2).pairs == 2
    assert ToastConfig(spans=[(1, 3), (4, 5)]).pairs == 2
    assert ToastConfig(max_error=0.5).pairs == "all"


@pytest.mark.parametrize("statistics_bytes", [LEAST, 2**30])
def test_bounded_and_chunked_analyses_give_the_all_pairs_plan_and_fits(statistics_bytes):
    model, data = R.decoder("llama"), R.text_loader()
    # every pair in memory: the reference (max_span reaching every pair)
    _, expected = toast.compress(R.decoder("llama"), data, method="toast", max_span=10, **OPTIONS)
    patched, report = toast.compress(
        model, data, method="toast", statistics_bytes=statistics_bytes, **OPTIONS
    )
    assert isinstance(report.analysis.moments, ChunkedMoments) == (statistics_bytes == LEAST)
    assert report.spans == expected.spans
    e, b = expected.analysis.errors, report.analysis.errors
    near = np.triu(np.ones(e.shape, dtype=bool), 1) & ~np.triu(np.ones(e.shape, dtype=bool), 3)
    np.testing.assert_allclose(b[near], e[near], rtol=1e-12)
    assert np.isnan(b[np.triu(np.ones(e.shape, dtype=bool), 3)]).all()
    a = toast.compress(R.decoder("llama"), data, method="toast", max_span=10, **OPTIONS)[0]
    for key, value in _weights(a).items():
        torch.testing.assert_close(_weights(patched)[key], value, rtol=1e-5, atol=1e-6)


def test_chunked_analysis_from_disk_writes_the_in_memory_save(tmp_path):
    model, data = R.decoder("llama"), R.text_loader()
    model.save_pretrained(tmp_path / "source")
    options = dict(OPTIONS, statistics_bytes=LEAST)
    report = compress_from_disk(tmp_path / "source", data, tmp_path / "disk", **options)
    _, expected = toast.compress(model, data, method="toast", **OPTIONS)
    assert isinstance(report.analysis.moments, ChunkedMoments)
    assert report.spans == expected.spans
    np.testing.assert_allclose(report.analysis.errors, expected.analysis.errors, rtol=1e-12)


def test_a_bound_the_folds_do_not_fit_uses_gcv_and_says_so():
    model, data = R.decoder("llama"), R.text_loader()
    assert model.config.hidden_size == 32
    _, expected = toast.compress(
        R.decoder("llama"), data, method="toast", **dict(OPTIONS, estimator="gcv")
    )
    with pytest.warns(UserWarning, match="estimator='gcv'"):
        _, report = toast.compress(
            model, data, method="toast", statistics_bytes=LEAST - 1, **OPTIONS
        )
    assert report.analysis.estimator == "gcv"
    assert report.spans == expected.spans
    np.testing.assert_allclose(report.analysis.errors, expected.analysis.errors, rtol=1e-12)


def test_a_bound_below_one_pair_without_folds_is_refused_naming_the_least():
    model, data = R.decoder("llama"), R.text_loader()
    with pytest.raises(ValueError, match=f"statistics_bytes >= {pair_nbytes(32, 0):,}"):
        toast.compress(model, data, method="toast", statistics_bytes=1000, **OPTIONS)


@pytest.mark.parametrize("bad", [0, -5, 1.5, "1GiB"])
def test_bad_statistics_bytes_is_refused(bad):
    with pytest.raises((ValueError, TypeError), match="statistics_bytes"):
        ToastConfig(budget=2, statistics_bytes=bad)


@pytest.mark.parametrize("translator", ["patch_ridge", "rotated_diagonal"])
def test_hadamard_basis_fits_from_rows_on_disk_equal_the_in_memory_fits(translator):
    data = R.text_loader()
    options = dict(OPTIONS, translator=translator)
    a = toast.compress(R.decoder("llama"), data, method="toast", max_span=10, **options)[0]
    b, report = toast.compress(
        R.decoder("llama"), data, method="toast", statistics_bytes=LEAST, **options
    )
    assert isinstance(report.analysis.moments, ChunkedMoments)
    for key, value in _weights(a).items():
        torch.testing.assert_close(_weights(b)[key], value, rtol=1e-5, atol=1e-6)
