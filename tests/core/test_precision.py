"""precision="mixed": float32 products per chunk, float64 sums."""

import numpy as np
import pytest

import toast
from tests._helpers import assert_rel, make_states, stored_pairs


def _quantized_gram(states, i, j):
    return states[i].astype(np.float64).T @ states[j].astype(np.float64)


def test_mixed_precision_cross_blocks_match_float64_reference():
    S, n, d = 3, 3000, 40
    states = make_states(7, S, n, d, mean=0.5, dtype=np.float32)
    m = toast.Moments(S, d, precision="mixed").update(states)
    for i, j in stored_pairs(S, S - 1):
        # float32 products summed over at most 1024 rows, then in float64.
        assert_rel(m.cross(i, j), _quantized_gram(states, i, j), 1e-5, f"cross({i},{j})")


def test_mixed_precision_sums_and_row_statistics_are_float64():
    S, n, d = 3, 2000, 16
    states = make_states(8, S, n, d, dtype=np.float32)
    mixed = toast.Moments(S, d, precision="mixed").update(states)
    exact = toast.Moments(S, d).update(states)
    for i in range(S):
        assert_rel(mixed.sum(i), exact.sum(i), 1e-12, f"sum({i})")
    for metric in ("mse", "cosine", "angular", "euclidean"):
        a = toast.error_matrix(mixed, metric=metric)
        b = toast.error_matrix(exact, metric=metric)
        iu = np.triu_indices(S, 1)
        assert_rel(a[iu], b[iu], 1e-12, metric)


def test_mixed_precision_error_matrix_close_to_float64():
    S, n, d = 4, 4000, 24
    states = make_states(9, S, n, d, dtype=np.float32)
    mixed = toast.Moments(S, d, folds=4, precision="mixed").update(states)
    exact = toast.Moments(S, d, folds=4).update(states)
    iu = np.triu_indices(S, 1)
    a = toast.error_matrix(mixed, estimator="cv")[iu]
    b = toast.error_matrix(exact, estimator="cv")[iu]
    assert np.max(np.abs(a - b)) < 1e-4


def test_mixed_precision_survives_pickle():
    import pickle

    states = make_states(10, 2, 300, 8, dtype=np.float32)
    m = toast.Moments(2, 8, precision="mixed").update(states)
    back = pickle.loads(pickle.dumps(m))
    assert back.precision == "mixed"
    np.testing.assert_array_equal(back.cross(0, 1), m.cross(0, 1))


def test_unknown_precision_raises():
    with pytest.raises(ValueError, match="precision"):
        toast.Moments(2, 4, precision="float16")


def test_release_workspace_keeps_the_moments_and_updates_continue():
    states = make_states(11, 2, 400, 8)
    whole = toast.Moments(2, 8).update(states)
    split = toast.Moments(2, 8).update([s[:150] for s in states])
    split.release_workspace()
    split.update([s[150:] for s in states])
    assert_rel(split.cross(0, 1), whole.cross(0, 1), 1e-12, "cross after release")
