"""Regression tests for problems found by fuzzing the binding (fuzz/fuzz_core.py)."""

import ctypes
import subprocess
import sys

import numpy as np
import pytest

import toast

# ---------------------------------------------------------------- DLPack by hand


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _Device),
        ("ndim", ctypes.c_int32),
        ("dtype", _DType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _Managed(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_Managed))
_Managed._fields_ = [
    ("dl_tensor", _Tensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _Deleter),
]

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class PyCapsuleProducer:
    """A float64 (rows, d) "dltensor" capsule whose deleter is Python code."""

    def __init__(self, array: np.ndarray):
        self.array = np.ascontiguousarray(array, dtype=np.float64)
        self.calls = 0
        self.shape = (ctypes.c_int64 * 2)(*self.array.shape)
        self.managed = _Managed()
        t = self.managed.dl_tensor
        t.data = self.array.ctypes.data
        t.device = _Device(1, 0)  # CPU
        t.ndim = 2
        t.dtype = _DType(2, 64, 1)  # float64
        t.shape = self.shape

        def deleter(_ptr):
            # Python code in a deleter: must not run with an exception pending
            # (it would turn into SystemError).
            self.calls += int(np.ones(1).sum())

        self.deleter = _Deleter(deleter)
        self.managed.deleter = self.deleter
        self.capsule = _capsule_new(ctypes.addressof(self.managed), b"dltensor", None)


def test_failed_update_runs_python_deleters_without_a_pending_exception():
    # Found by fuzz/fuzz_core.py: the binding called the consumed capsule's
    # deleter with the update's ValueError set -> SystemError.
    bad = np.ones((3, 2))
    bad[1, 1] = np.nan
    producer = PyCapsuleProducer(bad)
    m = toast.Moments(1, 2)
    with pytest.raises(ValueError, match="NaN or Inf"):
        m.update([producer.capsule])
    assert producer.calls == 1
    assert m.rows == 0


def test_python_deleter_runs_once_after_a_good_update():
    producer = PyCapsuleProducer(np.arange(6.0).reshape(3, 2))
    m = toast.Moments(1, 2)
    m.update([producer.capsule])
    assert producer.calls == 1
    assert m.rows == 3
    np.testing.assert_array_equal(m.sum(0), [6.0, 9.0])
    with pytest.raises(TypeError, match="dltensor"):  # consumed: cannot be used again
        m.update([producer.capsule])
    assert producer.calls == 1


# ---------------------------------------------------------------- absurd sizes

ABSURD = """
import toast
for args in [(10**6, 1), (2**31 - 1, 1), (65536, 1), (2**31 - 1, 1, 0, "consecutive")]:
    try:
        toast.Moments.estimate_nbytes(*args)
    except OverflowError:
        pass
    else:
        raise SystemExit(f"estimate_nbytes{args} did not overflow")
for S in (10**6, 2**31 - 1):
    try:
        toast.Moments(S, 1)
    except OverflowError:
        pass
    else:
        raise SystemExit(f"Moments({S}, 1) did not overflow")
print("ok")
"""


def test_absurd_state_counts_fail_fast():
    # Found while writing the fuzzer: counting the kept pairs one by one took
    # O(S * span) steps (Moments.estimate_nbytes(10**6, 1) ran for minutes)
    # and overflowed int for S >= 65536 with all pairs.
    proc = subprocess.run(
        [sys.executable, "-c", ABSURD], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_largest_representable_pair_counts():
    # 65535 states keep 2147450880 <= INT_MAX pairs: no overflow in the count,
    # but the storage is far beyond memory: a number, not an error.
    assert toast.Moments.estimate_nbytes(65535, 1) > 10**11
    assert toast.Moments.estimate_nbytes(2**20, 1, pairs="consecutive") > 2**20


def test_row_counter_overflow_is_an_error():
    # Found by the ASan replay of the fuzz corpus: a row counter near 2**63
    # (restored through _set_data, as unpickling does) overflowed int64 in
    # merge (undefined behaviour); now OverflowError, nothing changed.
    m = toast.Moments(1, 2, folds=2)
    m.update([np.ones((3, 2))])
    m._set_data(m._get_data(), 2**63 - 2)
    before = m._get_data()
    with pytest.raises(OverflowError, match="overflow"):
        m.merge(m)
    with pytest.raises(OverflowError, match="overflow"):
        m.update([np.ones((3, 2))])
    assert m.rows == 2**63 - 2
    np.testing.assert_array_equal(m._get_data(), before)
    m.update([np.ones((1, 2))])  # exactly fits
    assert m.rows == 2**63 - 1


@pytest.mark.parametrize("kind", ["orthogonal", "diagonal", "linear", "affine", "ridge"])
@pytest.mark.parametrize("center", [None, True, False])
def test_fits_of_overflowing_moments_raise_value_error(kind, center):
    # Found by fuzzing: finite activations whose float64 products overflow
    # gave RuntimeError from the SVD (orthogonal, centered) or silent garbage
    # (diagonal, orthogonal); every kind now raises ValueError.
    if kind in ("affine", "ridge") and center is False:
        return
    X = np.array([[1e200, 1.0], [1.0, 2.0], [3.0, -1.0]])
    m = toast.Moments(2, 2)
    m.update([X, 2 * X])
    with pytest.raises(ValueError, match="Inf or NaN"):
        toast.fit_translator(m, 0, 1, kind=kind, center=center)
