"""toast.core.blas_threads: OpenBLAS's thread count, set and restored."""

import numpy as np
import pytest

import toast
from toast.core.blas import get_blas_threads, set_blas_threads

pytestmark = pytest.mark.skipif(get_blas_threads() is None, reason="OpenBLAS not found")


def test_the_count_is_set_inside_and_restored_after():
    before = get_blas_threads()
    with toast.core.blas_threads(1):
        assert get_blas_threads() == 1
    assert get_blas_threads() == before


def test_the_count_is_restored_after_an_exception():
    before = get_blas_threads()
    with pytest.raises(KeyError), toast.core.blas_threads(1):
        raise KeyError
    assert get_blas_threads() == before


def test_moments_agree_to_rounding_whatever_the_count():
    rng = np.random.default_rng(0)
    states = [rng.standard_normal((3000, 96)) for _ in range(3)]
    with toast.core.blas_threads(1):
        one = toast.Moments(3, 96).update(states)._get_data()
    many = toast.Moments(3, 96).update(states)._get_data()
    np.testing.assert_allclose(many, one, rtol=1e-12, atol=1e-12 * np.abs(one).max())


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_counts_are_rejected(bad):
    with pytest.raises(ValueError, match=r"threads must be an int in \[1, inf\)"):
        set_blas_threads(bad)


@pytest.mark.parametrize("given", [None, "12"])
def test_the_thread_timeout_is_set_only_while_the_core_loads(given):
    # the core's OpenBLAS threads sleep at once after a call; the variable
    # must not leak to other libraries, and a user's own value wins
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    if given is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = given
    code = "import os, toast; print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(given)
