"""ChunkedMoments (rows on disk, errors a chunk of states at a time) gives
the whole moments' error matrices and fits."""

from __future__ import annotations

import os

import numpy as np
import pytest

from toast.core import Moments, NonFiniteError, error_matrix, fit_translator
from toast.core.chunked import (
    ChunkedMoments,
    chunk_plan,
    chunk_sources,
    formed_nbytes,
    pair_nbytes,
    workspace_nbytes,
)


def _walk(states=7, dim=5, rows=240, seed=0):
    """States of a random walk (each the last plus noise), float32, in batches."""
    rng = np.random.default_rng(seed)
    x = [rng.standard_normal((rows, dim))]
    for _ in range(states - 1):
        x.append(x[-1] + 0.4 * rng.standard_normal((rows, dim)))
    x = [s.astype(np.float32) for s in x]
    return [[s[a : a + 40] for s in x] for a in range(0, rows, 40)]


def _both(batches, folds, pairs, masks=None, bound=None):
    states, dim = len(batches[0]), batches[0][0].shape[1]
    bound = pair_nbytes(dim, folds) if bound is None else bound
    whole = Moments(states, dim, folds=folds, pairs=pairs)
    chunked = ChunkedMoments(states, dim, folds=folds, pairs=pairs, bound=bound)
    for k, batch in enumerate(batches):
        mask = None if masks is None else masks[k]
        whole.update(batch, mask=mask)
        chunked.update(batch, mask=mask)
    return whole, chunked


@pytest.mark.parametrize(("folds", "estimator"), [(5, "cv"), (0, "gcv"), (3, "in_sample")])
@pytest.mark.parametrize("pairs", [2, "all"])
def test_chunked_errors_equal_the_whole_moments(folds, estimator, pairs):
    whole, chunked = _both(_walk(), folds, pairs)
    metrics = ["linear", "affine", "mse", "cosine", "cka"]
    tables = chunked.error_matrices([(m, estimator, 0.0) for m in metrics])
    span = whole.span
    for metric, table in zip(metrics, tables, strict=True):
        expected = error_matrix(whole, metric, estimator)
        expected[np.triu(np.ones(expected.shape, dtype=bool), span + 1)] = np.nan
        np.testing.assert_allclose(table, expected, rtol=1e-12, atol=0, err_msg=metric)


def test_chunked_errors_keep_the_masked_rows_and_their_folds():
    batches = _walk()
    rng = np.random.default_rng(1)
    masks = [rng.random(40) > 0.3 for _ in batches]
    whole, chunked = _both(batches, 5, 3, masks=masks)
    assert chunked.rows == whole.rows
    np.testing.assert_array_equal(chunked.replay(list(range(7))).fold_rows, whole.fold_rows)
    expected = error_matrix(whole, "affine", "cv")
    np.testing.assert_allclose(
        chunked.error_matrices([("affine", "cv", 0.0)])[0], expected, rtol=1e-12
    )


@pytest.mark.parametrize("extra", [0, 4, 8, 10**9])
def test_every_chunk_size_gives_the_same_errors(extra):
    # 0: a source with one target at a time; 4: with two; 8: with all three; then all
    bound = pair_nbytes(5, 5) + extra * 5 * 25 * 8
    whole, chunked = _both(_walk(), 5, 3, bound=bound)
    expected = error_matrix(whole, "linear", "cv")
    expected[np.triu(np.ones(expected.shape, dtype=bool), 4)] = np.nan
    np.testing.assert_allclose(chunked.error_matrices([("linear", "cv", 0.0)])[0], expected)


def test_pair_fits_equal_the_whole_moments_fits():
    whole, chunked = _both(_walk(), 5, "all")
    for i, j in [(0, 1), (2, 5), (1, 6)]:
        for kind in ("linear", "affine"):
            a = fit_translator(whole, i, j, kind=kind)
            b = fit_translator(chunked.pair(i, j), 0, 1, kind=kind)
            np.testing.assert_allclose(b.weight, a.weight, rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(b.bias, a.bias, rtol=1e-10, atol=1e-12)


def test_pair_moments_keep_only_what_a_fit_reads():
    # a search keeps one per span; the target's Gram would add half again at width 4,096
    _, chunked = _both(_walk(), 5, "all")
    kept = chunked.pair(2, 5)
    np.testing.assert_allclose(kept.cross(0, 0), chunked.replay([2]).cross(0, 0), rtol=1e-12)
    with pytest.raises(ValueError, match="not kept"):
        kept.cross(1, 1)


def test_each_replay_is_counted_with_the_total():
    _, chunked = _both(_walk(), 0, 3, bound=pair_nbytes(5, 0))
    calls = []
    chunked.error_matrices([("linear", "gcv", 0.0)], on_replay=lambda *c: calls.append(c))
    total = len(chunked.chunk(0))
    assert total > 1 and calls == [(k, total) for k in range(1, total + 1)]


def test_traces_equal_the_diagonal_blocks():
    whole, chunked = _both(_walk(), 0, 1)
    expected = [np.trace(whole.cross(j, j)) for j in range(7)]
    np.testing.assert_allclose(chunked.traces(), expected, rtol=1e-12)


def test_chunk_is_the_most_sources_whose_formed_blocks_fit_the_bound():
    work = workspace_nbytes(8)
    # a source's panel is span + 1 blocks; each of its span targets adds a diagonal
    one = formed_nbytes(4, 1, 3, 8, 5)
    assert one == 5 * 8 * (storage_off(4) + (4 + 3) * 64)
    assert chunk_sources(20, 8, 5, 3, one + work) == 1
    assert chunk_sources(20, 8, 5, 3, one + work - 1) == 0
    assert chunk_sources(20, 8, 5, 3, 10**9) == 19


def storage_off(states):
    return 1 + states * 8 + 4 * states * states  # count, sums, row statistics


def test_a_source_splits_its_targets_when_they_do_not_fit_together():
    work = workspace_nbytes(8)
    two = formed_nbytes(3, 1, 2, 8, 5) + work
    plan = chunk_plan(6, 8, 5, 3, two)
    # each source with groups of at most two of its (up to 3) targets, every pair once
    assert plan[:2] == [([0, 1, 2], 1), ([0, 3], 1)]
    pairs = [(s[0], t) for s, _ in plan for t in s[1:]]
    assert sorted(pairs) == [(i, j) for i in range(6) for j in range(i + 1, min(i + 4, 6))]


def test_a_bound_below_one_pair_is_refused_naming_the_least():
    least = pair_nbytes(8, 5)
    with pytest.raises(ValueError, match=f"statistics_bytes >= {least:,}.*estimator='gcv'"):
        chunk_plan(6, 8, 5, 3, least - 1)
    with pytest.raises(ValueError, match=f">= {pair_nbytes(8, 0):,}"):
        ChunkedMoments(6, 8, folds=5, pairs=3, bound=pair_nbytes(8, 0) - 1)


def test_the_buffer_is_unlinked_at_creation(tmp_path):
    chunked = ChunkedMoments(3, 4, bound=pair_nbytes(4, 0), directory=tmp_path)
    chunked.update([np.ones((5, 4), np.float32)] * 3)
    assert os.listdir(tmp_path) == []
    assert chunked.nbytes == 3 * 5 * 4 * 4


def test_non_finite_rows_are_refused_naming_the_state():
    chunked = ChunkedMoments(3, 4, bound=pair_nbytes(4, 0))
    bad = np.ones((5, 4), np.float32)
    bad[2, 1] = np.nan
    with pytest.raises(NonFiniteError) as caught:
        chunked.update([np.ones((5, 4), np.float32), bad, bad])
    assert caught.value.state == 1 and chunked.rows == 0
