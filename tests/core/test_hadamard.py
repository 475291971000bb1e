"""The Hadamard-type rotations: orthonormal at every width, a true Hadamard
matrix where a construction exists, Sylvester's own for powers of two."""

import numpy as np
import pytest
import scipy.linalg

from toast.core.hadamard import hadamard, hadamard_order, is_hadamard

# the widths of the real models toast runs on, and a few without a Hadamard matrix
WIDTHS = [1, 2, 12, 28, 36, 384, 576, 768, 960, 1024, 3584, 6, 30, 100]


@pytest.mark.parametrize("n", WIDTHS)
def test_rotation_is_orthogonal_to_1e_12(n):
    h = hadamard(n)
    assert h.shape == (n, n) and h.dtype == np.float64
    assert np.abs(h @ h.T - np.eye(n)).max() < 1e-12
    assert np.abs(h.T @ h - np.eye(n)).max() < 1e-12


@pytest.mark.parametrize("n", [12, 20, 28, 36, 384, 576, 768, 960])
def test_widths_with_a_paley_factor_get_a_true_hadamard_matrix(n):
    h = hadamard(n) * np.sqrt(n)
    assert is_hadamard(n)
    np.testing.assert_allclose(np.abs(h), 1.0, atol=1e-12)


@pytest.mark.parametrize("n", [1, 2, 8, 64, 512])
def test_powers_of_two_are_sylvester_matrices(n):
    np.testing.assert_allclose(hadamard(n), scipy.linalg.hadamard(n) / np.sqrt(n), atol=1e-15)


def test_real_model_widths_factor_as_the_paper_needs():
    # SmolLM2 576 = 16 x 36 (Paley II, q = 17), MiniLM 384 and ViT-B 768 = 2^k x 12
    assert (hadamard_order(576), hadamard_order(384), hadamard_order(768)) == (36, 12, 12)


@pytest.mark.parametrize("n", [6, 30, 100])
def test_widths_without_a_construction_get_a_dense_orthogonal_transform(n):
    h = hadamard(n)
    assert not is_hadamard(n)
    assert np.abs(h).max() <= np.sqrt(2 / n) + 1e-12
    assert np.count_nonzero(np.abs(h) < 1e-12) < n  # dense: nearly no zero entry


def test_rotation_is_read_only():
    with pytest.raises(ValueError):
        hadamard(12)[0, 0] = 1.0


def test_bad_width_names_the_problem():
    with pytest.raises(ValueError, match="n"):
        hadamard(0)
