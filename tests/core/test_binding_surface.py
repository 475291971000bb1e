"""The binding's surface: the storage layout read from the core, typed
NaN/Inf errors, the enum constants, text signatures, and pickles of Moments
written before the core module was split (they must still load)."""

import base64
import inspect
import pickle
import zlib

import numpy as np
import pytest

import toast
from toast import _core
from toast.core.moments import ROW_STATS, storage_layout

# pickle.dumps(m, protocol=4), zlib-compressed, of the moments below, written
# by toast at commit c6807d5 (toast.core.moments holding everything) from
#   rng = np.random.default_rng(0)
#   m = toast.Moments(3, 4, folds=2, pairs="consecutive", precision="mixed")
#   m.update([rng.standard_normal((5, 4)).astype(np.float32) for _ in range(3)])
OLD_PICKLE = (
    "eNqFVntMU1cYvy0Uq6AWJsxkbNQ5FzTYibplKrE3YEK0iiDgFmVShE4YbyhKTTY7nQNm1TmvoomREl0MBKMzEUFl"
    "7TA8DcIQhsIg16I8hEErjzEeup5fuc0NJHL+6Jfzne/3+77zPU6v1vHcmJjC0rmpk6PS1bLo5DSVLDE5UZWkTmd0"
    "ksg0VbraqorkVGcZ71hKN2+HfatwUDgqhDrn6OSkdFV0hjruoIrRiRLjMlUxjM4jKSMxRSOLtLFmJKjjotLSojSM"
    "zsVKTBDqtIxotZVFJ4Ilo5uXFGMzsTJTx5kAwX4mi9nFeCsEO4SC40zsAp0oRq1JURGM8OvPmZxs27GDTuDHBAUF"
    "bXtjXfhRUGpmf46/ZPqCFCWmrT/Sh8MWg1VGNMdPEKn0TG2TW2XRO6IhyAMtQ0Qftij4X7JXln3fT/a6pT7jZE/5"
    "fDBIpPjLdS6ET1J1iSV785548GI1nih6IF7fK290Ll1hGRuy67nVMFnXdWpv5yz9zFX+wnRZuPaVXBieH7Li4hv5"
    "zPNfujM9LhdMyOfiqYv3Kd7RIaEDsq4+Ms3/kJ553v4osOTwumX0XDzHfswSd1a+Ry/UuAcHH/KbZT+SY6hsdtvw"
    "Nh764+ZeEi9beN9MpF7c2Yg8hxSaSD60P61+gXPfyGIi6Yt5NdhfNiFfHI5aqcW9pd98ZcJ5/O6n5Nzoewv8Uq8H"
    "rcjvlmcWnMcENBh4/uy4wPEBIo0n3u9APO+ab4KH6UYc+vIm1Fe6zGWQH6fd3zROW5YLP/qtT7uIXlp/7wziHDzX"
    "hXtURfwHeaP3Oezn5VTDzteSjzha9P8gPnr9AOIudRoG/ybh38DtCuvn45Qn+16Dv78U/aVdVf8IcYa4jeJ8/goh"
    "+t1yhiJSK1YBz/mz47Iu4Vxq3vcK/BvznuN+/vpJxFGoERiJFGys4sdp9zeNo6NlDoTHKLpTiXuU/j4MfU3fCO45"
    "/7t26LdLlqA/ilQ9yHvm8Bj4ck87G3l6domTG7FjXw9g7qTl9/sMPHu7vvXuAmKnL0kflfN4OHtOL5W4OnJ9SWR1"
    "scmJ2BmjAsuRjydl1yEdjjwkck1bQzeR6j+CUa81/v0s4bt52gv1D2i/0oD4I/ubgVPdqSDy5p8tQnv/37gVeOFh"
    "mtkgyTuZxeZZZs3pD2ERm12PsXO+A5teJhx1DxiVn716KPSTLzpn8ZTcPdvgvHhozndA2XP09hb/pXSXX+j21HLJ"
    "rDk1a3b6bTYtmfMdKA+3lITEraUnZRUXNny0fJZ9piYk+6DTmrfxGMMrPFDfKe8m1HvheQHs871wD72/Vxnq3Ndv"
    "m4Nt9aXIkymw2cDD6Z3bK1Hf2nrUS9ntjnmltixvAa8s97Ztrj5rIpI+EYR3gfPH4aiTIvQRXbYaeu0qJ/QN3XHl"
    "GXD6WswLXRA8buDFyfnjcKxiADjjbU+8F+zUr4/hz/NnWz9+u+wV8IcHXiLu+OBQzGvdebwbVEoG/m+0CUW2+TrQ"
    "8gT7xr1j8HcobIKPY/dsfQx96rVrkJ+K7sGveeo89vnNyJM2rBf3UF7NfCrn+eNwrHkl+ort3Yf5k/pvq0HeW4eR"
    "RylVYZvjnaMj/Djt/qZxyqCNuLdUfqAe+COlyI/e/BjviT63APmjr/f8Btxuqhj7GGfEpQ3NZvl6bYnFVk/XNvQB"
    "HVf9F9+e0xs9ty5CPZtqMX8cD2fP6ZWxU4tpxvploBCprR8Osv8BS7OkMw=="
)


def _old_states():
    rng = np.random.default_rng(0)
    return [rng.standard_normal((5, 4)).astype(np.float32) for _ in range(3)]


def test_pickles_from_before_the_split_still_load():
    m = pickle.loads(zlib.decompress(base64.b64decode(OLD_PICKLE)))
    assert type(m) is toast.Moments
    assert (m.num_states, m.dim, m.folds, m.pairs, m.precision) == (3, 4, 2, "consecutive", "mixed")
    assert m.rows == 5 and m.fold_rows.tolist() == [3, 2]
    fresh = toast.Moments(3, 4, folds=2, pairs="consecutive", precision="mixed")
    fresh.update(_old_states())
    # independent reference: the sums and blocks of the same rows in float64
    X = [x.astype(np.float64) for x in _old_states()]
    np.testing.assert_allclose(m.sum(1), X[1].sum(axis=0), rtol=1e-12)
    np.testing.assert_allclose(m.cross(0, 1), X[0].T @ X[1], rtol=1e-6, atol=1e-6)
    # read, not raw: the old core kept both triangles of the diagonal blocks
    for i, j in [(0, 0), (0, 1), (1, 1), (1, 2), (2, 2)]:
        np.testing.assert_allclose(m.cross(i, j), fresh.cross(i, j), rtol=1e-6, atol=1e-6)
    for metric in ("cosine", "angular", "euclidean", "mse"):
        np.testing.assert_allclose(
            toast.error_matrix(m, metric), toast.error_matrix(fresh, metric), rtol=1e-6
        )
    assert not m.has_pair(0, 2)


def test_layout_comes_from_the_core_and_addresses_the_storage():
    S, d = 4, 3
    m = toast.Moments(S, d, folds=2, pairs=2)
    rng = np.random.default_rng(1)
    X = [rng.standard_normal((7, d)) for _ in range(S)]
    m.update(X, fold=np.zeros(7, dtype=np.int64))
    lay = m.layout()
    assert lay == _core.moments_layout(S, d, 2, 2) == storage_layout(S, d, 2, 2)
    data = m._get_data()
    assert data.shape == (lay["storage_len"],) == (lay["nsets"] * lay["set_len"],)
    first = data[: lay["set_len"]]
    assert first[lay["off_count"]] == 7
    sums = first[lay["off_sums"] : lay["off_rowstats"]].reshape(S, d)
    np.testing.assert_allclose(sums, [x.sum(axis=0) for x in X], rtol=1e-12)
    assert lay["rowstats"] == _core.RS_COUNT == len(ROW_STATS)
    rs = first[lay["off_rowstats"] : lay["off_blocks"]].reshape(lay["rowstats"], S, S)
    sq = ((X[2] - X[0]) ** 2).sum(axis=1)
    np.testing.assert_allclose(rs[ROW_STATS.index("sqdist"), 0, 2], sq.sum(), rtol=1e-12)
    for i in range(S):
        blocks, off = lay["panel_blocks"][i], lay["panel_offsets"][i]
        assert blocks == min(2, S - 1 - i) + 1
        panel = first[off : off + d * blocks * d].reshape(d, blocks * d)
        for k in range(blocks):
            want = X[i].T @ X[i + k]
            if k == 0:  # a diagonal block holds its upper triangle only
                want = np.triu(want)
            np.testing.assert_allclose(panel[:, k * d : (k + 1) * d], want, rtol=1e-12, atol=1e-12)
    assert lay["panel_offsets"][-1] + d * d == lay["set_len"]


def test_non_finite_updates_raise_a_typed_error_naming_the_state():
    m = toast.Moments(3, 2)
    X = [np.ones((4, 2)) for _ in range(3)]
    X[2] = X[2].copy()
    X[2][1, 0] = np.inf
    with pytest.raises(toast.core.NonFiniteError, match=r"states\[2\] contains NaN or Inf") as info:
        m.update(X)
    assert info.value.state == 2
    assert isinstance(info.value, ValueError)
    assert m.rows == 0
    assert toast.core.NonFiniteError is _core.NonFiniteError
    # the attribute survives pickling (errors cross process boundaries)
    again = pickle.loads(pickle.dumps(info.value))
    assert again.state == 2 and str(again) == str(info.value)


def test_non_finite_error_elsewhere_has_no_state():
    with pytest.raises(toast.core.NonFiniteError) as info:
        _core.geometric_median(np.array([[1.0, 2.0], [np.nan, 0.0]]))
    assert info.value.state is None


CONSTANTS = {
    "METRIC_": 8,
    "EST_": 3,
    "PRECISION_": 2,
    "FIT_": 4,
    "METHOD_": 4,
    "SETS_": 3,
    "DIMSCORE_": 5,
}


@pytest.mark.parametrize("prefix,count", list(CONSTANTS.items()))
def test_enums_are_module_constants_numbered_from_zero(prefix, count):
    values = sorted(getattr(_core, n) for n in dir(_core) if n.startswith(prefix))
    assert values == list(range(count))


def test_metric_and_estimator_codes_come_from_the_core():
    from toast.core.metrics import _ESTIMATOR_CODES, _METRIC_CODES

    assert _METRIC_CODES["cka"] == _core.METRIC_CKA
    assert _ESTIMATOR_CODES["gcv"] == _core.EST_GCV
    assert list(_METRIC_CODES) == list(toast.core.METRICS)


def _binding_callables():
    for name, value in vars(_core).items():
        is_error = isinstance(value, type) and issubclass(value, BaseException)
        if callable(value) and not name.startswith("__") and not is_error:
            yield f"_core.{name}", value
    for name, value in vars(_core.Moments).items():
        if callable(value) and not name.startswith("__"):
            yield f"_core.Moments.{name}", value


@pytest.mark.parametrize("name,func", list(_binding_callables()), ids=lambda v: str(v))
def test_every_binding_callable_has_a_signature(name, func):
    sig = inspect.signature(func)
    assert sig.parameters is not None, name


def test_signatures_name_the_arguments():
    assert list(inspect.signature(_core.solve_gram).parameters) == ["A", "B", "ridge"]
    assert list(inspect.signature(_core.Moments).parameters)[:2] == ["num_states", "dim"]
    assert list(inspect.signature(_core.Moments._cross).parameters) == [
        "self",
        "i",
        "j",
        "sel",
        "fold",
    ]


def test_mixed_chunk_rows_is_the_cores():
    from toast.core.moments import MIXED_CHUNK_ROWS

    assert MIXED_CHUNK_ROWS == _core.CHUNK_MAX_ROWS == 4096
    assert "4096" in toast.Moments.__doc__
