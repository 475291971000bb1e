"""The front and the rank correlation, against brute force and SciPy."""

import math

import numpy as np
import pytest

from toast.frontier.pareto import dominates, pareto_front, spearman


@pytest.mark.parametrize("higher", [True, False])
def test_front_equals_brute_force_on_random_points(higher):
    rng = np.random.default_rng(0)
    for _ in range(50):
        points = [tuple(p) for p in rng.integers(0, 6, size=(12, 2)).astype(float)]
        front = set(pareto_front(points, higher))
        for k, p in enumerate(points):
            better = [q for q in points if dominates(q, p, higher)]
            assert (k in front) == (not better)


def test_front_is_sorted_by_size_and_skips_nan():
    points = [(3.0, 0.9), (1.0, 0.5), (float("nan"), 1.0), (2.0, 0.7)]
    assert pareto_front(points, higher_is_better=True) == [1, 3, 0]


def test_lower_is_better_flips_quality():
    # perplexity: (size 1, ppl 30) dominates (size 2, ppl 40)
    assert dominates((1.0, 30.0), (2.0, 40.0), higher_is_better=False)
    assert not dominates((1.0, 30.0), (2.0, 40.0), higher_is_better=True)


def test_equal_points_are_all_on_the_front():
    assert pareto_front([(1.0, 1.0), (1.0, 1.0)], True) == [0, 1]


def test_spearman_matches_scipy_with_ties():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(1)
    for _ in range(20):
        x = rng.integers(0, 5, 9).astype(float)
        y = x + rng.normal(0, 2, 9).round()
        expected = stats.spearmanr(x, y).statistic
        got = spearman(list(x), list(y))
        assert (math.isnan(got) and math.isnan(expected)) or got == pytest.approx(expected)


def test_spearman_needs_three_pairs():
    assert math.isnan(spearman([1.0, 2.0], [2.0, 1.0]))
