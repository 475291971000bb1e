"""Long core kernels stop for Ctrl-C instead of running to the end."""

import _thread
import threading

import numpy as np
import pytest

import toast
from toast import _core
from toast.core.metrics import _ESTIMATOR_CODES, _METRIC_CODES


def _moments(S=6, d=8, folds=3):
    rng = np.random.default_rng(0)
    m = toast.Moments(S, d, folds=folds)
    m.update([rng.standard_normal((40, d)) for _ in range(S)])
    return m


@pytest.mark.parametrize("metric", ["linear", "affine", "cka"])
@pytest.mark.parametrize("estimator", ["in_sample", "cv", "gcv"])
def test_error_matrix_stops_at_the_poll_that_raises(metric, estimator):
    m = _moments()
    calls = []

    def poll():
        calls.append(None)
        if len(calls) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _core.error_matrix(m, _METRIC_CODES[metric], _ESTIMATOR_CODES[estimator], 0.0, False, poll)
    assert len(calls) == 3
    # nothing was left locked or half-written: the same moments still work
    E = toast.error_matrix(m, metric=metric, estimator=estimator)
    assert np.isfinite(E[np.triu_indices(6, 1)]).all()


def test_a_poll_that_returns_changes_nothing():
    m = _moments()
    code = (_METRIC_CODES["linear"], _ESTIMATOR_CODES["cv"])
    plain, _ = _core.error_matrix(m, *code)
    polled, _ = _core.error_matrix(m, *code, 0.0, False, lambda: None)
    np.testing.assert_array_equal(polled, plain)


def test_poll_must_be_callable():
    with pytest.raises(TypeError, match="callable"):
        _core.error_matrix(_moments(), 0, 0, 0.0, False, 42)


@pytest.mark.usefixtures("sigint_raises")
def test_sigint_reaches_a_running_error_matrix():
    # A wide cv error matrix runs for seconds without the GIL; the simulated
    # Ctrl-C from another thread must surface as KeyboardInterrupt.
    m = _moments(S=13, d=256, folds=5)
    started = threading.Event()

    def poll():
        started.set()

    timer = threading.Thread(target=lambda: started.wait() and _thread.interrupt_main())
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            _core.error_matrix(m, _METRIC_CODES["linear"], _ESTIMATOR_CODES["cv"], 0.0, False, poll)
    finally:
        timer.join()
