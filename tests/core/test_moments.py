"""toast.Moments: streaming count / sum / cross-product statistics.

References are NumPy float64 computations on the same data (docs/api-core.md).
"""

import copy
import pickle
import re

import numpy as np
import pytest

import toast
from tests._helpers import (
    assert_moments_equal,
    assert_moments_match_data,
    assert_rel,
    make_states,
    moments_snapshot,
    stored_pairs,
)

# --------------------------------------------------------------------------
# basic statistics against NumPy
# --------------------------------------------------------------------------


@pytest.mark.parametrize("S,n,d", [(2, 50, 4), (3, 400, 16), (5, 1000, 48)])
def test_cross_equals_numpy_gram(S, n, d):
    X = make_states(1, S, n, d)
    m = toast.Moments(S, d).update(X)
    for i, j in stored_pairs(S, S):
        assert_rel(m.cross(i, j), X[i].T @ X[j], 1e-12, f"cross({i},{j})")


def test_cross_reversed_order_is_transpose():
    S, d = 4, 12
    X = make_states(2, S, 300, d)
    m = toast.Moments(S, d).update(X)
    for i, j in stored_pairs(S, S):
        if i < j:
            assert_rel(m.cross(j, i), X[j].T @ X[i], 1e-12)
            assert_rel(m.cross(j, i), m.cross(i, j).T, 1e-14)


def test_sum_equals_column_sums():
    S, d = 3, 10
    X = make_states(3, S, 257, d, mean=2.0)
    m = toast.Moments(S, d).update(X)
    for i in range(S):
        s = m.sum(i)
        assert s.shape == (d,)
        assert_rel(s, X[i].sum(0), 1e-12)


def test_count_and_rows_equal_accepted_rows():
    X = make_states(4, 2, 123, 6)
    m = toast.Moments(2, 6)
    assert m.rows == 0
    m.update(X)
    m.update([x[:7] for x in X])
    assert m.rows == 130
    assert m.count() == 130


def test_results_are_float64_arrays():
    X = make_states(5, 2, 40, 5, dtype=np.float32)
    m = toast.Moments(2, 5).update(X)
    assert isinstance(m.cross(0, 1), np.ndarray) and m.cross(0, 1).dtype == np.float64
    assert m.cross(0, 1).shape == (5, 5)
    assert isinstance(m.sum(1), np.ndarray) and m.sum(1).dtype == np.float64


def test_returned_arrays_do_not_alias_storage():
    X = make_states(36, 2, 50, 5)
    m = toast.Moments(2, 5).update(X)
    m.cross(0, 1)[:] = 0
    m.cross(1, 1)[:] = 0
    m.sum(0)[:] = 0
    assert_rel(m.cross(0, 1), X[0].T @ X[1], 1e-12)
    assert_rel(m.cross(1, 1), X[1].T @ X[1], 1e-12)
    assert_rel(m.sum(0), X[0].sum(0), 1e-12)


def test_attributes_reflect_constructor():
    m = toast.Moments(4, 7, folds=3, pairs=2)
    assert (m.num_states, m.dim, m.folds, m.pairs, m.span) == (4, 7, 3, 2, 2)
    assert np.array_equal(np.asarray(m.fold_rows), np.zeros(3))
    assert np.asarray(m.fold_rows).shape == (3,)
    c = toast.Moments(4, 7, pairs="consecutive")
    assert (c.pairs, c.span) == ("consecutive", 1)
    a = toast.Moments(4, 7)
    assert a.pairs == "all"
    assert a.span >= 3


def test_update_returns_self():
    X = make_states(6, 2, 20, 4)
    m = toast.Moments(2, 4)
    assert m.update(X) is m


def test_update_accepts_tuple_of_states():
    X = make_states(7, 3, 60, 5)
    m_tuple = toast.Moments(3, 5).update(tuple(X))
    m_list = toast.Moments(3, 5).update(list(X))
    assert_moments_equal(m_tuple, m_list, tol=1e-14)


# --------------------------------------------------------------------------
# streaming and merging
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("folds", [0, 3])
def test_streaming_batches_equal_one_shot(dtype, folds):
    S, n, d = 3, 1500, 16
    X = make_states(8, S, n, d, dtype=dtype)
    rng = np.random.default_rng(80)
    streamed = toast.Moments(S, d, folds=folds)
    start = 0
    while start < n:
        size = int(rng.integers(1, 80))
        streamed.update([x[start : start + size] for x in X])
        start += size
    whole = toast.Moments(S, d, folds=folds).update(X)
    assert_moments_equal(streamed, whole, tol=1e-12)


def test_merge_two_halves_equals_whole():
    S, n, d = 4, 900, 12
    X = make_states(9, S, n, d)
    a = toast.Moments(S, d).update([x[:413] for x in X])
    b = toast.Moments(S, d).update([x[413:] for x in X])
    whole = toast.Moments(S, d).update(X)
    a.merge(b)
    assert_moments_equal(a, whole, tol=1e-12)


@pytest.mark.parametrize("restricted", [{}, {"sources": 1, "diagonals": True}])
def test_the_first_update_keeps_sums_restored_before_it(restricted):
    # the first update faults its storage in page by page; values already there stay
    S, n, d = 3, 600, 64
    X = make_states(11, S, n, d)
    first = toast.Moments(S, d, row_stats=False, **restricted).update([x[:250] for x in X])
    restored = pickle.loads(pickle.dumps(first))
    merged = toast.Moments(S, d, row_stats=False, **restricted).merge(first)
    whole = toast.Moments(S, d, row_stats=False, **restricted).update(X)
    for m in (restored, merged):
        m.update([x[250:] for x in X])
        assert_moments_equal(m, whole, tol=1e-12)


def test_merge_returns_self_and_leaves_other_unchanged():
    X = make_states(10, 2, 100, 4)
    a = toast.Moments(2, 4).update([x[:50] for x in X])
    b = toast.Moments(2, 4).update([x[50:] for x in X])
    before = moments_snapshot(b)
    assert a.merge(b) is a
    after = moments_snapshot(b)
    for key in before:
        assert np.array_equal(np.asarray(before[key]), np.asarray(after[key])), key


@pytest.mark.parametrize("split_kind", ["implicit_multiple_of_k", "explicit_ids"])
def test_merge_with_folds_equals_whole(split_kind):
    S, n, d, K = 3, 1000, 10, 4
    X = make_states(11, S, n, d)
    if split_kind == "implicit_multiple_of_k":
        # first half has a multiple of K rows, so implicit numbering in the
        # second object (which restarts at 0) gives the same fold ids.
        cut, fold = 400, None
        fa = fb = None
    else:
        cut = 397
        fold = np.random.default_rng(110).integers(0, K, n)
        fa, fb = fold[:cut], fold[cut:]
    a = toast.Moments(S, d, folds=K).update([x[:cut] for x in X], fold=fa)
    b = toast.Moments(S, d, folds=K).update([x[cut:] for x in X], fold=fb)
    whole = toast.Moments(S, d, folds=K).update(X, fold=fold)
    a.merge(b)
    assert_moments_equal(a, whole, tol=1e-12)


@pytest.mark.parametrize(
    "other_args",
    [
        dict(num_states=4, dim=8, folds=0, pairs="all"),
        dict(num_states=3, dim=9, folds=0, pairs="all"),
        dict(num_states=3, dim=8, folds=2, pairs="all"),
        dict(num_states=3, dim=8, folds=0, pairs="consecutive"),
        dict(num_states=3, dim=8, folds=0, pairs=1),
    ],
    ids=["num_states", "dim", "folds", "pairs_consecutive", "pairs_span"],
)
def test_merge_rejects_incompatible(other_args):
    m = toast.Moments(3, 8, folds=0, pairs="all")
    other = toast.Moments(
        other_args["num_states"],
        other_args["dim"],
        folds=other_args["folds"],
        pairs=other_args["pairs"],
    )
    with pytest.raises(ValueError):
        m.merge(other)


def test_merge_rejects_different_fold_count():
    m = toast.Moments(3, 8, folds=3)
    with pytest.raises(ValueError):
        m.merge(toast.Moments(3, 8, folds=5))


# --------------------------------------------------------------------------
# folds
# --------------------------------------------------------------------------


@pytest.mark.parametrize("K", [2, 3, 5])
def test_implicit_fold_is_row_number_mod_k_across_updates(K):
    S, n, d = 3, 700, 8
    X = make_states(12, S, n, d)
    m = toast.Moments(S, d, folds=K)
    for lo, hi in [(0, 1), (1, 8), (8, 250), (250, 251), (251, 700)]:
        m.update([x[lo:hi] for x in X])
    assert_moments_match_data(m, X, tol=1e-12, fold_of_row=np.arange(n) % K)


@pytest.mark.parametrize("fold_dtype", [np.int64, np.int32])
def test_explicit_fold_ids(fold_dtype):
    S, n, d, K = 3, 600, 8, 4
    X = make_states(13, S, n, d)
    fold = np.random.default_rng(130).integers(0, K, n).astype(fold_dtype)
    m = toast.Moments(S, d, folds=K)
    m.update([x[:222] for x in X], fold=fold[:222])
    m.update([x[222:] for x in X], fold=fold[222:])
    assert_moments_match_data(m, X, tol=1e-12, fold_of_row=fold.astype(np.int64))


def test_implicit_numbering_counts_rows_of_explicit_updates():
    # "accepted row number r (counting from the first row this object ever
    # accepted) goes to fold r % K" -- rows given explicit ids still count.
    S, d, K = 2, 6, 3
    X = make_states(14, S, 100, d)
    explicit = np.zeros(31, dtype=np.int64)
    m = toast.Moments(S, d, folds=K)
    m.update([x[:31] for x in X], fold=explicit)
    m.update([x[31:] for x in X])
    fold_of_row = np.concatenate([explicit, np.arange(31, 100) % K])
    assert_moments_match_data(m, X, tol=1e-12, fold_of_row=fold_of_row)


def test_all_folds_sum_to_total():
    S, d, K = 3, 9, 5
    X = make_states(15, S, 333, d)
    m = toast.Moments(S, d, folds=K).update(X)
    assert sum(m.count(fold=k) for k in range(K)) == m.count()
    for i, j in stored_pairs(S, S):
        total = sum(m.cross(i, j, fold=k) for k in range(K))
        assert_rel(total, m.cross(i, j), 1e-13)


# --------------------------------------------------------------------------
# masks and 3D input
# --------------------------------------------------------------------------


def test_masked_rows_are_skipped_entirely():
    # masked rows get no count and no fold id: the masked update followed by
    # a plain update equals updating with the selected rows only.
    S, n, d, K = 3, 400, 8, 3
    X = make_states(16, S, n, d)
    Z = make_states(17, S, 50, d)
    mask = np.random.default_rng(160).random(n) < 0.6
    masked = toast.Moments(S, d, folds=K)
    masked.update(X, mask=mask).update(Z)
    selected = toast.Moments(S, d, folds=K)
    selected.update([x[mask] for x in X]).update(Z)
    assert_moments_equal(masked, selected, tol=1e-12)


def test_mask_3d_input():
    S, b, t, d, K = 3, 6, 17, 8, 3
    X2 = make_states(18, S, b * t, d)
    X3 = [x.reshape(b, t, d) for x in X2]
    mask = np.random.default_rng(180).random((b, t)) < 0.5
    m = toast.Moments(S, d, folds=K).update(X3, mask=mask)
    ref = toast.Moments(S, d, folds=K).update([x[mask.ravel()] for x in X2])
    assert_moments_equal(m, ref, tol=1e-12)
    kept = [x[mask.ravel()] for x in X2]
    assert_moments_match_data(m, kept, tol=1e-12, fold_of_row=np.arange(int(mask.sum())) % K)


def test_all_true_mask_equals_no_mask():
    X = make_states(19, 2, 90, 5)
    a = toast.Moments(2, 5, folds=2).update(X, mask=np.ones(90, dtype=bool))
    b = toast.Moments(2, 5, folds=2).update(X)
    assert_moments_equal(a, b, tol=1e-14)


def test_all_false_mask_adds_nothing():
    # every row skipped: either a no-op or a clean ValueError, never a change
    X = make_states(35, 2, 30, 5)
    m = toast.Moments(2, 5, folds=2).update(X)
    before = moments_snapshot(m)
    try:
        m.update(X, mask=np.zeros(30, dtype=bool))
    except ValueError:
        pass
    after = moments_snapshot(m)
    for key in before:
        assert np.array_equal(np.asarray(before[key]), np.asarray(after[key])), key


def test_3d_input_equals_2d_reshape():
    # rows of (batch, tokens, d) are taken in C order (folds make order visible)
    S, b, t, d, K = 3, 5, 13, 8, 4
    X2 = make_states(20, S, b * t, d)
    m3 = toast.Moments(S, d, folds=K).update([x.reshape(b, t, d) for x in X2])
    assert_moments_match_data(m3, X2, tol=1e-12, fold_of_row=np.arange(b * t) % K)


def test_3d_noncontiguous_input_equals_its_reshape():
    S, b, t, d = 2, 7, 9, 6
    base = make_states(21, S, b * t, d)
    X3 = [x.reshape(t, b, d).transpose(1, 0, 2) for x in base]  # (b, t, d) view
    assert not X3[0].flags.c_contiguous
    m = toast.Moments(S, d, folds=3).update(X3)
    flat = [np.ascontiguousarray(x).reshape(-1, d) for x in X3]
    assert_moments_match_data(m, flat, tol=1e-12, fold_of_row=np.arange(b * t) % 3)


# --------------------------------------------------------------------------
# pair subsets and memory footprint
# --------------------------------------------------------------------------

PAIR_SPECS = [("all", None), ("consecutive", 1), (1, 1), (2, 2), (3, 3)]


@pytest.mark.parametrize("pairs,span", PAIR_SPECS, ids=[str(p) for p, _ in PAIR_SPECS])
def test_has_pair(pairs, span):
    S = 5
    span = S - 1 if span is None else span
    m = toast.Moments(S, 4, pairs=pairs)
    for i in range(S):
        for j in range(S):
            assert m.has_pair(i, j) == (abs(j - i) <= span), (i, j)


@pytest.mark.parametrize("pairs", ["consecutive", 1, 2])
def test_stored_blocks_equal_all_pairs_blocks(pairs):
    S, d = 5, 10
    X = make_states(22, S, 300, d)
    full = toast.Moments(S, d, folds=2).update(X)
    sub = toast.Moments(S, d, folds=2, pairs=pairs).update(X)
    span = 1 if pairs == "consecutive" else pairs
    for i, j in stored_pairs(S, span):
        for f in (None, 0, 1):
            assert_rel(sub.cross(i, j, fold=f), full.cross(i, j, fold=f), 1e-12)
    for i in range(S):
        assert_rel(sub.sum(i), full.sum(i), 1e-12)


@pytest.mark.parametrize("pairs", ["consecutive", 1, 2])
def test_unstored_pair_cross_raises(pairs):
    S = 5
    span = 1 if pairs == "consecutive" else pairs
    m = toast.Moments(S, 4, pairs=pairs).update(make_states(23, S, 20, 4))
    with pytest.raises((KeyError, ValueError)):
        m.cross(0, span + 1)
    with pytest.raises((KeyError, ValueError)):
        m.cross(span + 1, 0)


@pytest.mark.parametrize("i,j", [(0, 3), (3, 0), (-1, 0), (0, 99)])
def test_cross_out_of_range_raises(i, j):
    m = toast.Moments(3, 4).update(make_states(37, 3, 20, 4))
    with pytest.raises((KeyError, ValueError)):
        m.cross(i, j)


@pytest.mark.parametrize("i", [3, -1])
def test_sum_out_of_range_raises(i):
    m = toast.Moments(3, 4).update(make_states(38, 3, 20, 4))
    with pytest.raises((KeyError, ValueError, IndexError)):
        m.sum(i)


def test_nbytes_shrinks_with_fewer_pairs():
    S, d = 6, 32
    sizes = [toast.Moments(S, d, pairs=p).nbytes for p in ("consecutive", 2, 3, "all")]
    assert sizes == sorted(sizes) and len(set(sizes)) == 4, sizes


@pytest.mark.parametrize("pairs", ["all", "consecutive", 2])
@pytest.mark.parametrize("folds", [0, 3])
def test_nbytes_equals_estimate(pairs, folds):
    S, d = 5, 24
    m = toast.Moments(S, d, folds=folds, pairs=pairs)
    est = toast.Moments.estimate_nbytes(S, d, folds=folds, pairs=pairs)
    assert isinstance(est, int)
    assert m.nbytes == est
    m.update(make_states(24, S, 50, d))
    assert m.nbytes == est


def test_estimate_nbytes_bert_base_size():
    # 13 states of width 768, all pairs: 91 blocks of 768x768 float64 = 429 MB
    est = toast.Moments.estimate_nbytes(13, 768, folds=0, pairs="all")
    assert 0.40e9 <= est <= 0.45e9


@pytest.mark.parametrize("pairs,span", [("all", 5), ("consecutive", 1), (2, 2), (3, 3)])
def test_estimate_nbytes_dominated_by_cross_blocks(pairs, span):
    S, d = 6, 512
    blocks = len(stored_pairs(S, span))
    est = toast.Moments.estimate_nbytes(S, d, folds=0, pairs=pairs)
    ratio = est / (blocks * d * d * 8)
    # (a little below 1 would mean packed symmetric diagonal blocks)
    assert 0.5 <= ratio <= 1.1, ratio


@pytest.mark.parametrize("K", [2, 5])
def test_estimate_nbytes_scales_with_folds(K):
    S, d = 4, 256
    base = toast.Moments.estimate_nbytes(S, d, folds=0)
    with_folds = toast.Moments.estimate_nbytes(S, d, folds=K)
    # K per-fold copies of the blocks, possibly plus a total
    assert 0.95 * K <= with_folds / base <= 1.05 * (K + 1)


def test_estimate_nbytes_huge_does_not_allocate():
    est = toast.Moments.estimate_nbytes(100, 100_000)
    assert isinstance(est, int)
    assert est >= 5050 * 100_000**2 * 8


def test_estimate_nbytes_absurd_sizes_return_or_raise_cleanly():
    try:
        est = toast.Moments.estimate_nbytes(10**9, 10**12, folds=10**6)
    except (OverflowError, ValueError):
        return
    assert isinstance(est, int) and est > 10**30


# --------------------------------------------------------------------------
# pickle / deepcopy
# --------------------------------------------------------------------------


def _populated(folds=3, pairs=2):
    S, d = 4, 9
    m = toast.Moments(S, d, folds=folds, pairs=pairs)
    m.update(make_states(25, S, 211, d))
    return m


def test_pickle_roundtrip_exact():
    m = _populated()
    r = pickle.loads(pickle.dumps(m))
    assert isinstance(r, toast.Moments)
    assert (r.num_states, r.dim, r.folds, r.pairs, r.span) == (
        m.num_states,
        m.dim,
        m.folds,
        m.pairs,
        m.span,
    )
    assert_moments_equal(r, m, exact=True)


def test_pickled_object_continues_fold_numbering():
    S, d = 4, 9
    more = make_states(26, S, 50, d)
    m = _populated()
    r = pickle.loads(pickle.dumps(m))
    m.update(more)
    r.update(more)
    assert_moments_equal(r, m, exact=True)


def test_deepcopy_equal_and_independent():
    m = _populated()
    c = copy.deepcopy(m)
    assert_moments_equal(c, m, exact=True)
    before = moments_snapshot(m)
    c.update(make_states(27, 4, 30, 9))
    assert c.rows == m.rows + 30
    after = moments_snapshot(m)
    for key in before:
        assert np.array_equal(np.asarray(before[key]), np.asarray(after[key])), key


# --------------------------------------------------------------------------
# dtypes and memory layouts
# --------------------------------------------------------------------------
#
# Each case turns a float64 (n, d) array into (input object, float64 array of
# the values the implementation actually sees, tolerance against the original
# float64 data given the input precision).


def _np_cast(dtype):
    def make(X):
        q = X.astype(dtype)
        return q, q.astype(np.float64)

    return make


def _np_layout(kind):
    def make(X):
        n, d = X.shape
        if kind == "row_stride":
            big = np.repeat(X, 2, axis=0)
            big[1::2] = 1e6  # rows that must not be read
            v = big[::2]
        elif kind == "negative_stride":
            v = np.ascontiguousarray(X[::-1])[::-1]
        elif kind == "column_slice":
            big = np.full((n, d + 7), 1e6)
            big[:, 3 : 3 + d] = X
            v = big[:, 3 : 3 + d]
        elif kind == "fortran":
            v = np.asfortranarray(X)
        elif kind == "transposed_view":
            v = np.ascontiguousarray(X.T).T
        elif kind == "float32_transposed_view":
            v = np.ascontiguousarray(X.astype(np.float32).T).T
        else:  # pragma: no cover
            raise AssertionError(kind)
        if kind != "fortran":
            assert not v.flags.c_contiguous
        return v, np.array(v, dtype=np.float64)

    return make


def _torch_case(kind):
    def make(X):
        torch = pytest.importorskip("torch")
        n, d = X.shape
        base = torch.from_numpy(X.copy())
        if kind in ("float32", "float16", "bfloat16", "float64"):
            t = base.to(getattr(torch, kind))
        elif kind == "transposed":
            t = base.t().contiguous().t()
            assert not t.is_contiguous()
        elif kind == "float16_transposed":
            t = base.to(torch.float16).t().contiguous().t()
            assert not t.is_contiguous()
        elif kind == "row_slice":
            big = torch.from_numpy(np.repeat(X, 2, axis=0))
            big[1::2] = 1e6
            t = big[::2]
            assert not t.is_contiguous()
        elif kind == "column_slice":
            big = torch.full((n, d + 5), 1e6, dtype=torch.float64)
            big[:, 2 : 2 + d] = base
            t = big[:, 2 : 2 + d]
            assert not t.is_contiguous()
        elif kind == "bfloat16_column_slice":
            big = torch.full((n, d + 5), 1e6, dtype=torch.bfloat16)
            big[:, 2 : 2 + d] = base.to(torch.bfloat16)
            t = big[:, 2 : 2 + d]
        else:  # pragma: no cover
            raise AssertionError(kind)
        ref = t.detach().to(torch.float64).numpy().copy()
        return t, ref

    return make


# (id, maker, tolerance against the unquantized float64 data)
LAYOUT_CASES = [
    ("np_float64", _np_cast(np.float64), 1e-12),
    ("np_float32", _np_cast(np.float32), 1e-6),
    ("np_float16", _np_cast(np.float16), 1e-3),
    ("np_row_stride", _np_layout("row_stride"), 1e-12),
    ("np_negative_stride", _np_layout("negative_stride"), 1e-12),
    ("np_column_slice", _np_layout("column_slice"), 1e-12),
    ("np_fortran", _np_layout("fortran"), 1e-12),
    ("np_transposed_view", _np_layout("transposed_view"), 1e-12),
    ("np_float32_transposed_view", _np_layout("float32_transposed_view"), 1e-6),
    ("torch_float64", _torch_case("float64"), 1e-12),
    ("torch_float32", _torch_case("float32"), 1e-6),
    ("torch_float16", _torch_case("float16"), 1e-3),
    ("torch_bfloat16", _torch_case("bfloat16"), 1e-2),
    ("torch_transposed", _torch_case("transposed"), 1e-12),
    ("torch_float16_transposed", _torch_case("float16_transposed"), 1e-3),
    ("torch_row_slice", _torch_case("row_slice"), 1e-12),
    ("torch_column_slice", _torch_case("column_slice"), 1e-12),
    ("torch_bfloat16_column_slice", _torch_case("bfloat16_column_slice"), 1e-2),
]


def _layout_run(maker):
    S, n, d = 3, 301, 12
    X = make_states(28, S, n, d)
    inputs, refs = zip(*(maker(x) for x in X), strict=True)
    m = toast.Moments(S, d, folds=2).update(list(inputs))
    return m, X, list(refs)


@pytest.mark.parametrize("maker", [c[1] for c in LAYOUT_CASES], ids=[c[0] for c in LAYOUT_CASES])
def test_layout_matches_quantized_reference(maker):
    m, _, refs = _layout_run(maker)
    n = refs[0].shape[0]
    assert_moments_match_data(m, refs, tol=1e-12, fold_of_row=np.arange(n) % 2)


@pytest.mark.parametrize(
    "maker,tol", [(c[1], c[2]) for c in LAYOUT_CASES], ids=[c[0] for c in LAYOUT_CASES]
)
def test_layout_close_to_unquantized_data(maker, tol):
    m, X, _ = _layout_run(maker)
    S = len(X)
    for i in range(S):
        assert_rel(m.sum(i), X[i].sum(0), tol, f"sum({i})")
        for j in range(i, S):
            assert_rel(m.cross(i, j), X[i].T @ X[j], tol, f"cross({i},{j})")


def test_torch_requires_grad_tensor_is_accepted():
    torch = pytest.importorskip("torch")
    X = make_states(29, 2, 80, 6)
    ts = [torch.tensor(x, dtype=torch.float32, requires_grad=True) for x in X]
    m = toast.Moments(2, 6).update(ts)
    refs = [t.detach().to(torch.float64).numpy() for t in ts]
    assert_moments_match_data(m, refs, tol=1e-12)


def test_torch_3d_tensor_with_numpy_mask():
    torch = pytest.importorskip("torch")
    S, b, t, d = 2, 4, 11, 6
    X2 = make_states(30, S, b * t, d, dtype=np.float32)
    ts = [torch.from_numpy(x.reshape(b, t, d)) for x in X2]
    mask = np.random.default_rng(300).random((b, t)) < 0.7
    m = toast.Moments(S, d).update(ts, mask=mask)
    assert_moments_match_data(m, [x[mask.ravel()] for x in X2], tol=1e-12)


# --------------------------------------------------------------------------
# bad inputs
# --------------------------------------------------------------------------

S_BAD, N_BAD, D_BAD = 3, 20, 8
LOOSE = r"(?i)state|shape|dim|width|rows|match|expected"
NAN_MSG = re.escape("states[2] contains NaN or Inf")


def _good():
    return make_states(31, S_BAD, N_BAD, D_BAD)


def _replace(k, value):
    def build():
        X = _good()
        X[k] = value(X[k]) if callable(value) else value
        return X, {}

    return build


def _with_nonfinite(value, dtype=np.float64):
    def build():
        X = [x.astype(dtype) for x in _good()]
        X[2][5, 3] = value
        return X, {}

    return build


def _kw(**kwargs):
    def build():
        return _good(), {k: (v() if callable(v) else v) for k, v in kwargs.items()}

    return build


BAD_UPDATES = [
    # id, builder, folds, exception, match
    ("too_few_states", lambda: (_good()[:2], {}), 0, ValueError, LOOSE),
    ("too_many_states", lambda: (_good() + _good()[:1], {}), 0, ValueError, LOOSE),
    ("states_not_sequence", lambda: (5, {}), 0, TypeError, r"(?i)states"),
    ("list_of_lists", _replace(0, lambda x: x.tolist()), 0, TypeError, r"states\[0\]"),
    ("string", _replace(0, "abc"), 0, TypeError, r"states\[0\]"),
    ("none", _replace(0, None), 0, TypeError, r"states\[0\]"),
    (
        "int32",
        _replace(1, lambda x: x.astype(np.int32)),
        0,
        TypeError,
        r"(?s)(?=.*states\[1\])(?=.*(dtype|int32))",
    ),
    ("int64", _replace(1, lambda x: x.astype(np.int64)), 0, TypeError, r"states\[1\]"),
    ("bool", _replace(1, lambda x: x > 0), 0, TypeError, r"states\[1\]"),
    ("complex", _replace(1, lambda x: x.astype(np.complex128)), 0, TypeError, r"states\[1\]"),
    ("object", _replace(1, lambda x: x.astype(object)), 0, TypeError, r"states\[1\]"),
    ("row_mismatch", _replace(2, lambda x: np.vstack([x, x[:1]])), 0, ValueError, LOOSE),
    ("leading_shape_mismatch", _replace(2, lambda x: x.reshape(4, 5, D_BAD)), 0, ValueError, LOOSE),
    (
        "width_mismatch_one_state",
        _replace(1, lambda x: np.hstack([x, x[:, :1]])),
        0,
        ValueError,
        LOOSE,
    ),
    (
        "width_not_dim",
        lambda: ([np.hstack([x, x[:, :2]]) for x in _good()], {}),
        0,
        ValueError,
        LOOSE,
    ),
    ("one_dimensional", lambda: ([x[:, 0].copy() for x in _good()], {}), 0, ValueError, LOOSE),
    (
        "four_dimensional",
        lambda: ([x.reshape(2, 2, 5, D_BAD) for x in _good()], {}),
        0,
        ValueError,
        LOOSE,
    ),
    ("nan", _with_nonfinite(np.nan), 0, ValueError, NAN_MSG),
    ("inf", _with_nonfinite(np.inf), 0, ValueError, NAN_MSG),
    ("neg_inf", _with_nonfinite(-np.inf), 0, ValueError, NAN_MSG),
    ("nan_float32", _with_nonfinite(np.nan, np.float32), 0, ValueError, NAN_MSG),
    ("inf_float16", _with_nonfinite(np.inf, np.float16), 0, ValueError, NAN_MSG),
    ("zero_rows", lambda: ([x[:0] for x in _good()], {}), 0, ValueError, r"(?i)rows"),
    ("mask_wrong_length", _kw(mask=lambda: np.ones(N_BAD + 1, dtype=bool)), 0, ValueError, r"mask"),
    ("mask_wrong_ndim", _kw(mask=lambda: np.ones((N_BAD, 1), dtype=bool)), 0, ValueError, r"mask"),
    ("mask_float", _kw(mask=lambda: np.ones(N_BAD)), 0, TypeError, r"mask"),
    ("mask_int", _kw(mask=lambda: np.ones(N_BAD, dtype=np.int64)), 0, TypeError, r"mask"),
    ("fold_too_large", _kw(fold=lambda: np.full(N_BAD, 3)), 3, ValueError, r"fold"),
    ("fold_negative", _kw(fold=lambda: np.full(N_BAD, -1)), 3, ValueError, r"fold"),
    (
        "fold_without_folds",
        _kw(fold=lambda: np.zeros(N_BAD, dtype=np.int64)),
        0,
        ValueError,
        r"fold",
    ),
    ("fold_float", _kw(fold=lambda: np.zeros(N_BAD)), 3, TypeError, r"fold"),
    (
        "fold_wrong_length",
        _kw(fold=lambda: np.zeros(N_BAD - 1, dtype=np.int64)),
        3,
        ValueError,
        r"fold",
    ),
]


@pytest.mark.parametrize(
    "build,folds,exc,match", [c[1:] for c in BAD_UPDATES], ids=[c[0] for c in BAD_UPDATES]
)
def test_update_rejects_bad_input(build, folds, exc, match):
    m = toast.Moments(S_BAD, D_BAD, folds=folds)
    states, kwargs = build()
    with pytest.raises(exc, match=match):
        m.update(states, **kwargs)
    assert m.rows == 0


def test_update_rejects_torch_integer_tensor():
    torch = pytest.importorskip("torch")
    X = _good()
    X[1] = torch.from_numpy(X[1]).to(torch.int32)
    m = toast.Moments(S_BAD, D_BAD)
    with pytest.raises(TypeError, match=r"states\[1\]"):
        m.update(X)


def test_update_rejects_torch_nan():
    torch = pytest.importorskip("torch")
    X = [torch.from_numpy(x).to(torch.bfloat16) for x in _good()]
    X[2][3, 1] = float("nan")
    m = toast.Moments(S_BAD, D_BAD)
    with pytest.raises(ValueError, match=NAN_MSG):
        m.update(X)


BAD_CONSTRUCTORS = [
    ("num_states_zero", (0, 4), {}, None),
    ("num_states_negative", (-1, 4), {}, None),
    ("dim_zero", (3, 0), {}, None),
    ("dim_negative", (3, -2), {}, None),
    ("folds_one", (3, 4), {"folds": 1}, re.escape("folds must be 0 or an int >= 2; got ")),
    ("folds_negative", (3, 4), {"folds": -1}, re.escape("folds must be 0 or an int >= 2; got ")),
    ("pairs_bogus", (3, 4), {"pairs": "bogus"}, None),
    ("pairs_zero", (3, 4), {"pairs": 0}, None),
    ("pairs_negative", (3, 4), {"pairs": -2}, None),
]


@pytest.mark.parametrize(
    "args,kwargs,match", [c[1:] for c in BAD_CONSTRUCTORS], ids=[c[0] for c in BAD_CONSTRUCTORS]
)
def test_constructor_rejects_bad_arguments(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        toast.Moments(*args, **kwargs)


def test_estimate_nbytes_rejects_bad_arguments():
    with pytest.raises(ValueError):
        toast.Moments.estimate_nbytes(3, 4, folds=1)
    with pytest.raises(ValueError):
        toast.Moments.estimate_nbytes(0, 4)


def _nan_last_state(X):
    X = [x.copy() for x in X]
    X[-1][7, 2] = np.nan
    return X, {}


def _shape_mismatch_last_state(X):
    X = [x.copy() for x in X]
    X[-1] = X[-1][:-1]
    return X, {}


def _fold_out_of_range_last_row(X):
    fold = np.zeros(X[0].shape[0], dtype=np.int64)
    fold[-1] = 3
    return X, {"fold": fold}


def _mask_wrong_shape(X):
    return X, {"mask": np.ones(X[0].shape[0] + 2, dtype=bool)}


@pytest.mark.parametrize(
    "corrupt",
    [_nan_last_state, _shape_mismatch_last_state, _fold_out_of_range_last_row, _mask_wrong_shape],
    ids=[
        "nan_last_state",
        "shape_mismatch_last_state",
        "fold_out_of_range_last_row",
        "mask_wrong_shape",
    ],
)
def test_failed_update_leaves_object_unchanged(corrupt):
    S, d, K = 3, 8, 3
    A = make_states(32, S, 100, d)
    B = make_states(33, S, 40, d)
    C = make_states(34, S, 61, d)
    m = toast.Moments(S, d, folds=K).update(A)
    before = moments_snapshot(m)
    bad_states, kwargs = corrupt(B)
    with pytest.raises((ValueError, TypeError)):
        m.update(bad_states, **kwargs)
    after = moments_snapshot(m)
    for key in before:
        assert np.array_equal(np.asarray(before[key]), np.asarray(after[key])), key
    # the implicit row counter did not move either
    m.update(C)
    ref = toast.Moments(S, d, folds=K).update(A).update(C)
    assert_moments_equal(m, ref, tol=1e-14)


# --------------------------------------------------------------------------
# what is formed: row statistics and sources
# --------------------------------------------------------------------------


@pytest.mark.parametrize("precision,tol", [("float64", 1e-12), ("mixed", 1e-5)])
def test_least_squares_moments_form_the_source_blocks_and_sums(precision, tol):
    X = make_states(11, 2, 500, 24)
    m = toast.Moments(2, 24, precision=precision, row_stats=False, sources=1).update(X)
    assert_rel(m.cross(0, 0), X[0].T @ X[0], tol, "cross(0,0)")
    assert_rel(m.cross(0, 1), X[0].T @ X[1], tol, "cross(0,1)")
    assert_rel(m.cross(1, 0), X[1].T @ X[0], tol, "cross(1,0)")
    assert_rel(m.sum(1), X[1].sum(axis=0), tol, "sum(1)")
    assert m.count() == 500


def test_blocks_of_non_sources_raise_on_reading():
    X = make_states(12, 3, 40, 5)
    m = toast.Moments(3, 5, sources=2).update(X)
    m.cross(1, 2)
    assert not m.has_pair(2, 2)
    with pytest.raises(ValueError, match=r"\(2, 2\) is not kept.*sources=2"):
        m.cross(2, 2)
    with pytest.raises(ValueError, match="not kept"):
        toast.error_matrix(m, "linear", "in_sample")


def test_row_metrics_refuse_moments_without_row_statistics():
    m = toast.Moments(3, 5, row_stats=False).update(make_states(13, 3, 40, 5))
    with pytest.raises(ValueError, match="row_stats=False"):
        toast.error_matrix(m, "cosine")
    full = toast.Moments(3, 5).update(make_states(13, 3, 40, 5))
    np.testing.assert_array_equal(
        toast.error_matrix(m, "linear", "in_sample"),
        toast.error_matrix(full, "linear", "in_sample"),
    )


def test_restricted_moments_pickle_and_merge_only_with_their_kind():
    X = make_states(14, 2, 60, 6)
    m = toast.Moments(2, 6, row_stats=False, sources=1).update(X)
    back = pickle.loads(pickle.dumps(m))
    assert (back.row_stats, back.sources) == (False, 1)
    np.testing.assert_array_equal(back.cross(0, 1), m.cross(0, 1))
    with pytest.raises(ValueError, match="sources"):
        toast.Moments(2, 6).merge(m)
    with pytest.raises(ValueError, match="sources"):
        toast.Moments(2, 6, sources=3)


@pytest.mark.parametrize("precision,tol", [("float64", 1e-13), ("mixed", 1e-6)])
def test_rows_read_in_place_equal_rows_copied(precision, tol):
    # contiguous rows of the working type are read in place; a mask of
    # all-true rows (or strided rows) takes the copying path
    dtype = np.float64 if precision == "float64" else np.float32
    X = [x.astype(dtype) for x in make_states(15, 3, 700, 20)]
    direct = toast.Moments(3, 20, precision=precision).update(X)
    copied = toast.Moments(3, 20, precision=precision).update(X, mask=np.ones(700, dtype=bool))
    strided = toast.Moments(3, 20, precision=precision)
    strided.update([np.asfortranarray(x) for x in X])
    for other in (copied, strided):
        for i, j in stored_pairs(3, 3):
            assert_rel(direct.cross(i, j), other.cross(i, j), tol, f"cross({i},{j})")
        np.testing.assert_allclose(
            toast.error_matrix(direct, "cosine"), toast.error_matrix(other, "cosine"), rtol=1e-9
        )


@pytest.mark.parametrize("sources", [None, 1])
def test_selected_states_equal_their_moments_and_merge_with_more_rows(sources):
    rng = np.random.default_rng(3)
    first = [rng.normal(size=(40, 5)) for _ in range(4)]
    more = [rng.normal(size=(25, 5)) for _ in range(4)]
    whole = toast.Moments(4, 5, folds=3)
    whole.update(first)
    extra = toast.Moments(4, 5)
    extra.update(more)
    merged = whole.select([1, 3], sources).merge(extra.select([1, 3], sources))
    direct = toast.Moments(2, 5, row_stats=False, sources=sources)
    direct.update([np.vstack([first[k], more[k]]) for k in (1, 3)])
    assert merged.rows == direct.rows == 65
    blocks = [(0, 0), (0, 1)] + ([(1, 1)] if sources is None else [])
    for i, j in blocks:
        np.testing.assert_allclose(merged.cross(i, j), direct.cross(i, j), rtol=1e-12)
    for i in (0, 1):
        np.testing.assert_allclose(merged.sum(i), direct.sum(i), rtol=1e-12)


def test_select_refuses_states_out_of_order():
    with pytest.raises(ValueError, match="distinct and ascending"):
        toast.Moments(3, 2).select([2, 1])
