"""The C core's token channel selection (csrc/tcs.c) through the binding,
against NumPy re-implementations of the CLS attention row and of Eq. 6 / 7
scores with top-k, per image and per batch."""

import numpy as np
import pytest

from toast import _core


def _softmax(v):
    e = np.exp(v - v.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_cls_attention_matches_numpy():
    rng = np.random.default_rng(0)
    B, N, H, d = 3, 11, 4, 5
    q = rng.standard_normal((B, H * d)).astype(np.float32)
    K = rng.standard_normal((B, N, H * d)).astype(np.float32)
    got = _core.tcs_cls_attention(q, K, H, 0.37)
    qh = q.astype(np.float64).reshape(B, H, d)
    kh = K.astype(np.float64).reshape(B, N, H, d)
    want = _softmax(np.einsum("bhd,bnhd->bhn", qh, kh) * 0.37).mean(axis=1)
    assert got.dtype == np.float32 and got.shape == (B, N)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def _reference(X, sample, attn, k, cw, pw, batch):
    X = X.astype(np.float64)
    a = np.ones(X.shape[:2]) if attn is None else attn.astype(np.float64)
    if batch:
        a = np.broadcast_to(a.mean(axis=0, keepdims=True), a.shape)
    s = cw * np.abs(X[:, 0]) + pw * (a[:, sample, None] * np.abs(X[:, sample])).mean(axis=1)
    if batch:
        s = s.mean(axis=0, keepdims=True)
    order = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return np.sort(order, axis=1)


@pytest.mark.parametrize("batch", [False, True])
@pytest.mark.parametrize("with_attn", [False, True])
@pytest.mark.parametrize("k", [1, 17, 64])
def test_select_matches_numpy(batch, with_attn, k):
    rng = np.random.default_rng(k)
    B, N, C = 4, 9, 64
    X = rng.standard_normal((B, N, C)).astype(np.float32)
    attn = _softmax(rng.standard_normal((B, N))).astype(np.float32) if with_attn else None
    sample = np.array([2, 5, 8])
    cw, pw = (2.0, 1.0) if with_attn else (0.0, 1.0)
    got = _core.tcs_select(X, sample, attn, k, cw, pw, batch)
    assert got.dtype == np.int64 and got.shape == ((1 if batch else B), k)
    np.testing.assert_array_equal(got, _reference(X, sample, attn, k, cw, pw, batch))


@pytest.mark.parametrize(
    "args, exc",
    [
        ((np.ones((1, 2, 3), np.float32), [5], None, 1, 1.0, 1.0, False), ValueError),
        ((np.ones((1, 2, 3), np.float32), [1], None, 4, 1.0, 1.0, False), ValueError),
        ((np.ones((1, 2, 3), np.float32), [1], None, 0, 1.0, 1.0, False), ValueError),
        ((np.ones((1, 2, 3), np.float32), [], None, 1, 1.0, 1.0, False), ValueError),
        ((np.ones((1, 2, 3), np.float32), [1], None, 1, -1.0, 1.0, False), ValueError),
        (
            (np.ones((1, 2, 3), np.float32), [1], np.ones((2, 2), np.float32), 1, 1.0, 1.0, False),
            ValueError,
        ),
        ((np.full((1, 2, 3), np.nan, np.float32), [1], None, 1, 1.0, 1.0, False), ValueError),
        ((np.ones((1, 2, 3), np.float64), [1], None, 1, 1.0, 1.0, False), TypeError),
        ((np.ones((2, 3), np.float32), [1], None, 1, 1.0, 1.0, False), ValueError),
    ],
)
def test_select_bad_input(args, exc):
    with pytest.raises(exc):
        _core.tcs_select(*args)


def test_cls_attention_bad_input():
    q, K = np.ones((2, 6), np.float32), np.ones((2, 3, 6), np.float32)
    with pytest.raises(ValueError):
        _core.tcs_cls_attention(q, K, 4, 1.0)  # 4 heads do not divide 6
    with pytest.raises(ValueError):
        _core.tcs_cls_attention(q[:1], K, 2, 1.0)
    with pytest.raises(ValueError):
        _core.tcs_cls_attention(q, K, 2, float("nan"))
